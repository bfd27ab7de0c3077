"""The patches: megatron-core's tensor-parallel linears run their GEMM and collective chunk by chunk (CoC), or
as one fused NPU kernel (MC2), wherever the layer's communication is one of the four the kernels implement;
with ``--optimize-recomp-communication-level`` a recomputed forward skips its redundant collectives.

Both patches wrap: a layer they do not serve (a frozen weight, expert layers with explicit expert
communication, deferred embedding weight gradients, a tensor-parallel group of one, CPU offloading of
activations, megatron-core 0.19's GTP re-materialisation) keeps megatron-core's own code.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from ascendspeed.accelerator.cpu_half_gemm import multiplies_in_fp32
from ascendspeed.features.tp_comm_overlap import chunked, mc2, recompute
from ascendspeed.features.tp_comm_overlap.collectives import TpGroup
from ascendspeed.features.tp_comm_overlap.settings import TpCommOverlapSettings
from ascendspeed.patching import Patch, wrap

_GROUP_ATTRIBUTE = "_ascendspeed_tp_comm_group"


def _tp_group(layer: torch.nn.Module, group, settings: TpCommOverlapSettings) -> Optional[TpGroup]:
    """The layer's tensor-parallel group (cached on the layer), or None for a group of one rank."""
    cached = getattr(layer, _GROUP_ATTRIBUTE, None)
    if cached is None or cached.group is not group:
        cached = TpGroup.of(group, settings.recorder)
        setattr(layer, _GROUP_ATTRIBUTE, cached)
    return cached if cached.size > 1 else None


def _main_grad(weight: torch.Tensor, gradient_accumulation_fusion: bool) -> Optional[torch.Tensor]:
    return weight.main_grad if gradient_accumulation_fusion and hasattr(weight, "main_grad") else None


def _fp32_products(input: torch.Tensor, weight: torch.Tensor, settings: TpCommOverlapSettings) -> bool:
    """Whether the chunked kernels multiply this layer's half-precision operands in fp32 (a CPU without a fast
    GEMM for their dtype), as ``cpu_half_gemm`` has megatron-core's own linear functions do."""
    return multiplies_in_fp32(input, settings.cpu_fp32_gemm_dtypes) and weight.dtype == input.dtype


def _offloading_activations(layer: torch.nn.Module) -> bool:
    context = getattr(layer.config, "_cpu_offloading_context", None)
    return context is not None and bool(getattr(context, "inside_context", False))


def wrap_column_parallel_forward_impl(settings: TpCommOverlapSettings) -> Callable:
    """``ColumnParallelLinear._forward_impl`` (the linear and its collectives; megatron-core calls it with
    keywords only): all-gather -> GEMM with sequence parallelism, GEMM with the input gradient all-reduced
    without; in a recomputed forward at recompute level 2, the gathered input kept for backward."""
    tracker = settings.recompute

    def factory(original):
        @functools.wraps(original)
        def _forward_impl(self, input, weight, *args, **kwargs):
            sequence_parallel = kwargs.get("sequence_parallel", False)
            allreduce_dgrad = kwargs.get("allreduce_dgrad", False)
            keep_gathered = (settings.recompute_level >= 2 and sequence_parallel and tracker.recomputing)
            served = (
                (settings.overlap or keep_gathered) and not args and weight.requires_grad
                and (sequence_parallel or allreduce_dgrad)
                and kwargs.get("grad_output_buffer") is None and kwargs.get("gtp_remat_size", 1) in (None, 1)
                and not _offloading_activations(self)
            )
            group = _tp_group(self, kwargs.get("tp_group") or self.tp_group, settings) if served else None
            if group is None:
                return original(self, input, weight, *args, **kwargs)
            bias = kwargs.get("bias")
            main_grad = _main_grad(weight, kwargs.get("gradient_accumulation_fusion", False))
            fp32_products = _fp32_products(input, weight, settings)
            if not sequence_parallel:
                return chunked.MatmulAllReduceInputGrad.apply(input, weight, bias, group, settings.chunks, main_grad,
                                                              fp32_products)
            if settings.mc2 and not keep_gathered:
                return mc2.AllGatherMatmul.apply(input, weight, bias, group)
            chunks = settings.chunks if settings.overlap and not settings.mc2 else 1
            return chunked.AllGatherMatmul.apply(input, weight, bias, group, chunks, main_grad, keep_gathered,
                                                 fp32_products)

        return _forward_impl

    return factory


def wrap_row_parallel_forward(settings: TpCommOverlapSettings) -> Callable:
    """``RowParallelLinear.forward``: GEMM -> reduce-scatter with sequence parallelism, GEMM -> all-reduce
    without; the bias is added after the reduction, as megatron-core adds it. With recompute level 1 or 2 the
    recomputed forward's last reduction of a checkpointed chunk is skipped (``recompute``)."""
    tracker = settings.recompute

    def factory(original):
        @functools.wraps(original)
        def forward(self, input_):
            served = (
                self.input_is_parallel and not self.explicit_expert_comm and self.weight.requires_grad
                and getattr(self, "gtp_remat_size", 1) == 1 and not _offloading_activations(self)
            )
            group = _tp_group(self, self.tp_group, settings) if served else None
            if group is None:
                return original(self, input_)
            if tracker is not None and tracker.reduction_is_redundant():
                output = recompute.partial_product_without_reduction(self, input_, group)
            elif not settings.overlap:
                return original(self, input_)
            elif settings.mc2 and self.sequence_parallel:
                output = mc2.MatmulReduceScatter.apply(input_, self.weight, group)
            else:
                kernel = chunked.MatmulReduceScatter if self.sequence_parallel else chunked.MatmulAllReduce
                output = kernel.apply(input_, self.weight, group, settings.chunks,
                                      _main_grad(self.weight, self.gradient_accumulation_fusion),
                                      _fp32_products(input_, self.weight, settings))
            if self.skip_bias_add:
                return output, self.bias
            return (output + self.bias if self.bias is not None else output), None

        return forward

    return factory


def patches(settings: TpCommOverlapSettings) -> list[Patch]:
    kind = "MC2" if settings.mc2 else f"CoC, {settings.chunks} chunks" if settings.overlap else "no overlap"
    found = [
        wrap("megatron.core.tensor_parallel.layers:ColumnParallelLinear._forward_impl",
             wrap_column_parallel_forward_impl(settings), expect="(self, input, weight, *args, **kwargs)",
             name=f"tp comm overlap: wrap ColumnParallelLinear._forward_impl, all-gather -> GEMM ({kind})"),
        wrap("megatron.core.tensor_parallel.layers:RowParallelLinear.forward", wrap_row_parallel_forward(settings),
             expect="(self, input_)",
             name=f"tp comm overlap: wrap RowParallelLinear.forward, GEMM -> reduce-scatter ({kind})"),
    ]
    if settings.recompute is not None:
        found += recompute.patches(settings.recompute)
    return found
