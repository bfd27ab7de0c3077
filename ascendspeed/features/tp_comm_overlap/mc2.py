"""MC2 on Ascend NPUs: the sequence-parallel linears as torch_npu's fused communication-and-matmul kernels
(``npu_all_gather_base_mm``, ``npu_mm_reduce_scatter_base``), which overlap inside one kernel on the NPU.

The kernels take matrices: ``[sequence, batch, hidden]`` activations go in as ``[sequence * batch, hidden]``,
and gathering their rows in rank order is gathering the sequence. Only usable where ``torch_npu`` imports,
an NPU is the device and the kernels exist (``mc2_absence``); the feature refuses ``--use-ascend-mc2``
elsewhere at argument validation.
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch
import torch.distributed as dist

from ascendspeed.features.tp_comm_overlap.chunked import WeightGradient
from ascendspeed.features.tp_comm_overlap.collectives import TpGroup

KERNELS = ("npu_all_gather_base_mm", "npu_mm_reduce_scatter_base")


def mc2_absence() -> Optional[str]:
    """Why MC2 cannot run here, or None when it can."""
    from ascendspeed.accelerator import device_type

    if device_type() != "npu":
        return f"the device is {device_type()}, and MC2's kernels are Ascend NPU kernels"
    try:
        torch_npu = importlib.import_module("torch_npu")
    except ImportError as error:
        return f"torch_npu does not import ({error})"
    missing = [name for name in KERNELS if not hasattr(torch_npu, name)]
    if missing:
        return f"this torch_npu has no {', '.join(missing)}"
    return None


def _torch_npu():
    return importlib.import_module("torch_npu")


def _hccl_name(group: TpGroup) -> str:
    """The HCCL communicator name the fused kernels address the tensor-parallel group by."""
    backend = group.group._get_backend(torch.device("npu"))
    return backend.get_hccl_comm_name(dist.get_rank())


def _matrix(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1, tensor.size(-1))


class AllGatherMatmul(torch.autograd.Function):
    """``all_gather(input) @ weight.T + bias`` in one kernel; backward: matmul -> reduce-scatter in one."""

    @staticmethod
    def forward(ctx, input, weight, bias, group: TpGroup):
        output, gathered = _torch_npu().npu_all_gather_base_mm(
            _matrix(input), weight.t(), _hccl_name(group), group.size, bias=bias, gather_index=0,
            gather_output=True, comm_turn=0)
        ctx.save_for_backward(gathered, weight)
        ctx.group, ctx.use_bias, ctx.input_shape = group, bias is not None, input.shape
        return output.view((group.size * input.size(0),) + input.shape[1:-1] + (weight.size(0),))

    @staticmethod
    def backward(ctx, grad_output):
        gathered, weight = ctx.saved_tensors
        grad_rows = _matrix(grad_output)
        grad_input = _torch_npu().npu_mm_reduce_scatter_base(
            grad_rows, weight, _hccl_name(ctx.group), ctx.group.size, reduce_op="sum", bias=None, comm_turn=0)
        accumulated = WeightGradient(weight, None)
        accumulated.add(grad_rows, gathered)
        grad_bias = grad_rows.sum(dim=0) if ctx.use_bias else None
        return grad_input.view(ctx.input_shape), accumulated.result(), grad_bias, None


class MatmulReduceScatter(torch.autograd.Function):
    """``reduce_scatter(input @ weight.T)`` in one kernel; backward: all-gather -> matmul in one."""

    @staticmethod
    def forward(ctx, input, weight, group: TpGroup):
        output = _torch_npu().npu_mm_reduce_scatter_base(
            _matrix(input), weight.t(), _hccl_name(group), group.size, reduce_op="sum", bias=None, comm_turn=0)
        ctx.save_for_backward(input, weight)
        ctx.group = group
        return output.view((input.size(0) // group.size,) + input.shape[1:-1] + (weight.size(0),))

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input, gathered_grad = _torch_npu().npu_all_gather_base_mm(
            _matrix(grad_output), weight, _hccl_name(ctx.group), ctx.group.size, bias=None, gather_index=0,
            gather_output=True, comm_turn=0)
        accumulated = WeightGradient(weight, None)
        accumulated.add(gathered_grad, _matrix(input))
        return grad_input.view(input.shape), accumulated.result(), None
