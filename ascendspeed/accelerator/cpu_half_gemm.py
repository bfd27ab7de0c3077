"""Megatron's linear layers in bf16 and fp16 on CPUs without a fast half-precision GEMM: the products in fp32.

torch multiplies bf16 matrices with oneDNN only where the CPU has AVX-512 (fp16: AVX512-FP16 or AMX-FP16;
torch's answers: ``torch.ops.mkldnn._is_mkldnn_bf16_supported`` / ``_is_mkldnn_fp16_supported``); elsewhere
its half-precision matmul is a scalar loop, 7x to 158x the fp32 time on an AVX2 AMD EPYC
(``bench/bf16_gemm.py``). What oneDNN's bf16 GEMM computes -- exact products of bf16 inputs summed in fp32,
rounded once to bf16 -- is what an fp32 GEMM of the same values, widened, computes, up to the order of the sums.
So on such CPUs the two functions every Megatron linear layer runs
(``megatron.core.tensor_parallel.layers.linear_with_grad_accumulation_and_async_allreduce`` and
``linear_with_frozen_weight``: column- and row-parallel layers, the output layer, experts) are wrapped to run
on widened copies of the input, weight and bias, and to round the output once; autograd rounds the input and
weight gradients once on their way back through the widening.

The widened copies are not kept for backward: while Megatron's function runs, saved-tensor hooks store a saved
widened input or weight as its half-precision original (the values are the same) and widen it again when
backward needs it, so activation memory stays what the half-precision GEMM keeps.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable, FrozenSet, Iterable, Optional, Tuple

import torch

from ascendspeed.patching import Patch, wrap

#: ``ASCENDSPEED_CPU_HALF_GEMM``: ``auto`` (the default: widen the half-precision dtypes this CPU has no fast
#: GEMM for), ``fp32`` (widen bf16 and fp16 on any CPU) or ``native`` (never widen).
ENVIRONMENT_VARIABLE = "ASCENDSPEED_CPU_HALF_GEMM"
POLICIES = ("auto", "fp32", "native")
HALF_DTYPES = frozenset((torch.bfloat16, torch.float16))


def slow_half_gemm_dtypes() -> FrozenSet[torch.dtype]:
    """The half-precision dtypes torch has no fast (oneDNN) GEMM for on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return HALF_DTYPES
    fast = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
            torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported()}
    return frozenset(dtype for dtype, supported in fast.items() if not supported)


def widened_dtypes() -> FrozenSet[torch.dtype]:
    """The dtypes whose linear-layer GEMMs run in fp32, per ``ASCENDSPEED_CPU_HALF_GEMM``."""
    policy = os.environ.get(ENVIRONMENT_VARIABLE, "auto").strip().lower() or "auto"
    if policy not in POLICIES:
        raise ValueError(f"{ENVIRONMENT_VARIABLE}={os.environ[ENVIRONMENT_VARIABLE]!r}: use one of "
                         f"{', '.join(POLICIES)} (auto widens only where this CPU has no fast bf16 / fp16 GEMM)")
    if policy == "native":
        return frozenset()
    return HALF_DTYPES if policy == "fp32" else slow_half_gemm_dtypes()


def multiplies_in_fp32(tensor: torch.Tensor, widened: FrozenSet[torch.dtype]) -> bool:
    """Whether GEMMs on ``tensor`` run on fp32 copies: a CPU tensor of a dtype in ``widened``."""
    return tensor.device.type == "cpu" and tensor.dtype in widened


class _Narrowed:
    """A saved widened tensor, stored as the half-precision tensor it was widened from."""

    __slots__ = ("original", "version")

    def __init__(self, original: torch.Tensor):
        self.original = original
        self.version = original._version

    def widened(self) -> torch.Tensor:
        if self.original._version != self.version:
            raise RuntimeError(
                "ascendspeed (fp32 GEMMs for half precision on this CPU): a tensor a linear layer saved for "
                "backward was modified in place after the forward (its version went from "
                f"{self.version} to {self.original._version}); clone it before modifying it, as torch requires "
                f"of any tensor saved for backward")
        return self.original.float()


@contextlib.contextmanager
def saved_as_originals(pairs: Iterable[Tuple[torch.Tensor, torch.Tensor]]):
    """While active, autograd saves each ``wide`` tensor of ``(wide, original)`` as its ``original`` and widens
    it again when backward unpacks it; other saved tensors are kept as they are."""
    pairs = tuple(pairs)

    def pack(tensor: torch.Tensor):
        for wide, original in pairs:
            if tensor is wide:
                return _Narrowed(original)
        return tensor

    def unpack(packed):
        return packed.widened() if isinstance(packed, _Narrowed) else packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


@contextlib.contextmanager
def fp32_copies(*tensors: Optional[torch.Tensor]):
    """fp32 copies of ``tensors`` (None stays None), which autograd saves, while the block runs, as the tensors
    they were widened from (``saved_as_originals``): the widening pattern of every half-precision GEMM here."""
    wide = [None if tensor is None else tensor.float() for tensor in tensors]
    with saved_as_originals((copy, tensor) for copy, tensor in zip(wide, tensors) if tensor is not None):
        yield wide


def wrap_in_fp32_gemm(original: Callable, widened: FrozenSet[torch.dtype]) -> Callable:
    """``original`` (a Megatron linear function: ``(input, weight, bias, gradient_accumulation_fusion, ...)``)
    run on fp32 copies of its tensors when the input is CPU-resident and of a dtype in ``widened``, the output
    rounded back. Gradient-accumulation fusion writes into the weight's ``main_grad`` and is left to the
    original (it needs apex or TE, which a CPU does not have)."""

    @functools.wraps(original)
    def linear(input, weight, bias, gradient_accumulation_fusion, *args, **kwargs):
        if not multiplies_in_fp32(input, widened) or weight.dtype != input.dtype or gradient_accumulation_fusion:
            return original(input, weight, bias, gradient_accumulation_fusion, *args, **kwargs)
        with fp32_copies(input, weight, bias) as (wide_input, wide_weight, wide_bias):
            output = original(wide_input, wide_weight, wide_bias, gradient_accumulation_fusion, *args, **kwargs)
        return output.to(input.dtype)

    return linear


_LINEAR = "megatron.core.tensor_parallel.layers:linear_with_grad_accumulation_and_async_allreduce"
_FROZEN = "megatron.core.tensor_parallel.layers:linear_with_frozen_weight"
_LEADING = "input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel"
#: (megatron-core releases, the linear function's signature, the frozen-weight function's signature).
_SIGNATURES = (
    ("<0.17", f"({_LEADING}, grad_output_buffer=None, wgrad_deferral_limit=0, async_grad_allreduce=None, "
              f"tp_group=None)",
     f"({_LEADING}, tp_group, grad_output_buffer=None, wgrad_deferral_limit=None, async_grad_allreduce=None)"),
    (">=0.17,<0.19", f"({_LEADING}, grad_output_buffer=None, wgrad_deferral_limit=0, tp_group=None)",
     f"({_LEADING}, tp_group, grad_output_buffer=None, wgrad_deferral_limit=None)"),
    (">=0.19", f"({_LEADING}, grad_output_buffer=None, wgrad_deferral_limit=0, tp_group=None, gtp_remat_size=1)",
     f"({_LEADING}, tp_group, grad_output_buffer=None, wgrad_deferral_limit=None, gtp_remat_size=1)"),
)


def patches(widened: FrozenSet[torch.dtype]) -> list[Patch]:
    """Wrap both linear functions so their ``widened`` dtypes multiply in fp32; none when ``widened`` is empty."""
    if not widened:
        return []
    factory = functools.partial(wrap_in_fp32_gemm, widened=widened)
    found = []
    for releases, linear, frozen in _SIGNATURES:
        found += [
            wrap(_LINEAR, factory, expect=linear, megatron=releases,
                 name="CPU half-precision linear layers: GEMMs in fp32 (wrap)"),
            wrap(_FROZEN, factory, expect=frozen, megatron=releases,
                 name="CPU half-precision frozen-weight linear layers: GEMMs in fp32 (wrap)"),
        ]
    return found
