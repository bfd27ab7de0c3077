"""The exact split of fp32 weights into a bf16 weight and a 16-bit remainder, and its inverse.

An fp32 value ``u`` (its 32 bits, little-endian: low half first) is stored as

* ``high`` -- the bf16 weight the model computes with: ``u`` cast to bf16 by torch, which rounds to
  nearest even exactly as Megatron's ``model_param.copy_(main_param)`` does;
* ``low`` -- the low 16 bits of ``u``, kept as they are.

Rounding to nearest even either keeps the upper half of ``u`` (``high == u >> 16``) or rounds it up by
one (``high == (u >> 16) + 1``), so restoring ``u`` means knowing whether it rounded up. The low half
says so: below ``0x8000`` it rounded down, above it rounded up. Only the exact tie ``low == 0x8000``
is ambiguous: it rounds to whichever of ``u >> 16`` and ``(u >> 16) + 1`` is even, and both cases end
with the same even ``high``. That is a counting fact, not a missing trick: an even bf16 value is the
rounding of 65537 fp32 patterns, one more than 16 bits can tell apart. So ties that rounded *down*
are kept aside as a (tiny, about one element in 131072) list of positions, ``ties``. With it, the
split is exact for every fp32 value except NaN, which stays NaN (its payload bits are not kept;
Megatron's own bf16 cast does not keep them either).

Everything here is vectorised torch on integer views of the same bytes (``Tensor.view(dtype)``); no
bits are reinterpreted behind torch's back.
"""
from __future__ import annotations

import torch

#: The low half of an exact tie, as a signed 16-bit integer (0x8000).
TIE = -32768


def encode(main: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split contiguous fp32 ``main`` (1-D) into new tensors ``(high, low, ties)``.

    ``high`` (int16 bits of the bf16 weight) and ``low`` (int16) have ``main``'s length; ``ties`` holds
    the int64 positions of exact ties that rounded down.
    """
    high = main.to(torch.bfloat16).view(torch.int16)
    halves = main.view(torch.int16).view(-1, 2)
    low = halves[:, 0].clone()
    candidates = torch.nonzero(low == TIE).flatten()  # exact ties: rare, so test their rounding sparsely
    ties = candidates[halves[candidates, 1] == high[candidates]]
    return high, low, ties


def decode(high: torch.Tensor, low: torch.Tensor, ties: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
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


def decode_new(high: torch.Tensor, low: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
    """The fp32 values ``(high, low, ties)`` stand for, as a new 1-D tensor."""
    out = torch.empty((high.numel(), 2), dtype=torch.int16, device=high.device)
    return decode(high, low, ties, out).view(torch.float32).view(-1)


def ties_in_range(ties: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The positions of ``ties`` within ``[start, end)``, relative to ``start``."""
    if not ties.numel():
        return ties
    return ties[(ties >= start) & (ties < end)] - start


def replace_ties_in_range(ties: torch.Tensor, start: int, end: int, new: torch.Tensor) -> torch.Tensor:
    """``ties`` with those in ``[start, end)`` replaced by ``new`` (relative to ``start``), sorted."""
    kept = ties[(ties < start) | (ties >= end)] if ties.numel() else ties
    return torch.sort(torch.cat((kept, new + start))).values
