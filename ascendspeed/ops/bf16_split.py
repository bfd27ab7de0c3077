"""The exact split of fp32 values into bf16 values and 16-bit remainders, in place, and its inverse.

An fp32 value ``u`` (its 32 bits, little-endian: low half first) is stored as

* ``high`` -- the bf16 value: ``u`` rounded to nearest even, exactly as torch's cast and so Megatron's
  ``model_param.copy_(main_param)`` round it (on CPU every NaN becomes ``0xFFFF``, as torch's cast makes
  it);
* ``low`` -- the low 16 bits of ``u``, kept as they are.

Rounding to nearest even either keeps the upper half of ``u`` (``high == u >> 16``) or rounds it up by
one (``high == (u >> 16) + 1``), so restoring ``u`` means knowing whether it rounded up. The low half
says so: below ``0x8000`` it rounded down, above it rounded up. Only the exact tie ``low == 0x8000`` is
ambiguous: it rounds to whichever of ``u >> 16`` and ``(u >> 16) + 1`` is even, and both cases end with
the same even ``high``. That is a counting fact, not a missing trick: an even bf16 value is the rounding
of 65537 fp32 patterns, one more than 16 bits can tell apart. So ties that rounded *down* are kept aside
as a (tiny, about one element in 131072) sorted list of positions, ``ties``. With it, the split is exact
for every fp32 value except NaN, which stays NaN (its payload bits are not all kept; Megatron's own bf16
cast does not keep them either).

Two operators switch a buffer between the layouts (``--reuse-fp32-param``'s layout switches), in place,
on ``halves``, the buffer viewed as 1-D int16:

* ``bf16_split_(halves, high_offset=0, low=None) -> ties``: the ``n`` fp32 values in ``halves[0:2n]``
  become their bf16 values in ``halves[high_offset:high_offset + n]`` and their remainders in ``low``
  (``n = low.numel()``); without ``low`` (``n = halves.numel() // 2``) the bf16 values go to
  ``halves[0:n]`` and the remainders to ``halves[n:2n]``. Slots of ``halves[0:2n]`` neither of them
  takes are left undefined.
* ``bf16_join_(halves, ties, high_offset=0, low=None)``: the inverse, the exact fp32 values back into
  ``halves[0:2n]``; slots of ``halves[0:2n]`` that held other data are overwritten.

Each has one kernel per device:

* CPU: the C++ kernels in ``ascendspeed/csrc/reuse_fp32_param``: one pass over memory, multi-threaded,
  whatever the overlap of the fp32 region with the bf16 values and remainders; only the interleaved
  layout (``low=None``) stages anything, the remainders of half the elements (1 byte per element);
* CUDA, and NPU where ``torch_npu`` imports: the torch composition below (``split_reference``,
  ``join_reference``), whose transient tensors are 4 to 6 bytes per element;
* Meta: the C++ argument checks. ``bf16_split_``'s number of ties depends on the values, so it is tagged
  ``dynamic_output_shape``: torch.compile breaks the graph at it, as at ``torch.nonzero``.
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch

from ascendspeed.ops._extension import load_extension

__all__ = ["bf16_split_", "bf16_join_", "split_reference", "join_reference", "NPU_KERNELS", "TIE"]

load_extension()  # defines the operators, their CPU and Meta kernels and argument checks

#: The low half of an exact tie, as a signed 16-bit integer (0x8000).
TIE = -32768


def bf16_split_(halves: torch.Tensor, high_offset: int = 0, low: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Split the fp32 values in ``halves[0:2n]`` in place; returns the sorted int64 tie positions.

    ``halves``: 1-D contiguous int16 starting at an even storage offset. With ``low`` (1-D int16, ``n``
    elements, not sharing memory with ``halves``) the bf16 values go to
    ``halves[high_offset:high_offset + n]``; without it, to ``halves[0:n]`` and the remainders to
    ``halves[n:2n]``. Any overlap of the fp32 region with the bf16 values is allowed.
    """
    return torch.ops.ascendspeed.bf16_split_(halves, high_offset, low)


def bf16_join_(halves: torch.Tensor, ties: torch.Tensor, high_offset: int = 0,
               low: Optional[torch.Tensor] = None) -> None:
    """The inverse of ``bf16_split_``: the exact fp32 values into ``halves[0:2n]``, in place.

    ``ties`` are the positions ``bf16_split_`` returned (strictly increasing, in ``[0, n)``); the
    layout arguments are the ones it was called with.
    """
    torch.ops.ascendspeed.bf16_join_(halves, ties, high_offset, low)


# -- the torch composition: the reference for the CPU kernels and the kernel of other devices -----------
def split_reference(main: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split contiguous fp32 ``main`` (1-D) into new tensors ``(high, low, ties)``.

    ``high`` (int16 bits of the bf16 value) and ``low`` (int16) have ``main``'s length; ``ties`` holds
    the int64 positions of exact ties that rounded down.
    """
    high = main.to(torch.bfloat16).view(torch.int16)
    halves = main.view(torch.int16).view(-1, 2)
    low = halves[:, 0].clone()
    candidates = torch.nonzero(low == TIE).flatten()  # exact ties: rare, so test their rounding sparsely
    ties = candidates[halves[candidates, 1] == high[candidates]]
    return high, low, ties


def join_reference(high: torch.Tensor, low: torch.Tensor, ties: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write the fp32 values ``(high, low, ties)`` stand for into ``out``, int16 pairs of shape ``[n, 2]``.

    The fp32 bits are ``(high << 16) + low`` with ``low`` read as a signed number: a negative ``low``
    (above 0x8000) borrows the one the rounding added. A tie that rounded down has ``low == -0x8000``
    but borrowed nothing: it gets 0x10000 back. ``out`` may share memory with ``high`` (it is widened
    into a new tensor first) but not with ``low``. Returns ``out``.
    """
    bits = out.view(torch.int32).view(-1)
    torch.add(high.to(torch.int32).bitwise_left_shift_(16), low, out=bits)
    if ties.numel():
        bits[ties] += 1 << 16
    return out


def _check_on_meta(op, *tensors_and_args):
    """Run the C++ argument check (the Meta kernel) on meta tensors of the same shapes and dtypes."""
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in tensors_and_args]
    op(*meta)


def _value_count(halves: torch.Tensor, low: Optional[torch.Tensor]) -> int:
    return low.numel() if low is not None else halves.numel() // 2


def _composite_split(halves, high_offset=0, low=None):
    _check_on_meta(torch.ops.ascendspeed.bf16_split_, halves, high_offset, low)
    n = _value_count(halves, low)
    high, low_values, ties = split_reference(halves[: 2 * n].view(torch.float32))
    halves[high_offset: high_offset + n].copy_(high)
    (low if low is not None else halves[n: 2 * n]).copy_(low_values)
    return ties


def _composite_join(halves, ties, high_offset=0, low=None):
    _check_on_meta(torch.ops.ascendspeed.bf16_join_, halves, ties, high_offset, low)
    n = _value_count(halves, low)
    high = halves[high_offset: high_offset + n]
    low = low if low is not None else halves[n: 2 * n].clone()  # the fp32 values cover the remainders
    join_reference(high, low, ties, halves[: 2 * n].view(n, 2))


torch.library.register_kernel("ascendspeed::bf16_split_", "cuda", _composite_split)
torch.library.register_kernel("ascendspeed::bf16_join_", "cuda", _composite_join)


def _register_npu_kernels() -> bool:
    """torch_npu is optional: the NPU (PrivateUse1) kernels exist only where it imports. torch_npu has
    no fused kernel for this split; the composition runs on the NPU's own torch operators."""
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    torch.library.register_kernel("ascendspeed::bf16_split_", "npu", _composite_split)
    torch.library.register_kernel("ascendspeed::bf16_join_", "npu", _composite_join)
    return True


NPU_KERNELS: bool = _register_npu_kernels()
"""Whether torch_npu imported and the operators run the torch composition on NPU tensors."""
