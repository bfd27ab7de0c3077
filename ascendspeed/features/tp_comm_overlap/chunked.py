"""Tensor-parallel linears whose GEMM is split into chunks along the sequence, each chunk's collective
running while the next chunk computes (communication over computation, CoC).

Shapes follow megatron-core: activations are ``[sequence, batch, hidden]``, a weight is ``[out, in]`` and
sequence parallelism shards the sequence (dimension 0) over the tensor-parallel ranks. A chunk of a
sequence-parallel tensor is the same slice of every rank's shard, so ``[size, chunk, ...]`` holds a chunk's
rows of the whole sequence in rank order.

* ``AllGatherMatmul`` (column-parallel with sequence parallelism): forward gathers the input chunk by chunk
  into the GEMM; backward reduce-scatters the input gradient chunk by chunk behind the next chunk's GEMM and
  re-gathers the input (saving the gathered input would keep ``size`` times the activation) behind the input
  gradient GEMMs for the weight gradient, unless told to keep it (``keep_gathered``: a recomputed forward,
  whose backward follows at once).
* ``MatmulReduceScatter`` (row-parallel with sequence parallelism): forward reduce-scatters each chunk's
  partial product behind the next chunk's GEMM; backward gathers the output gradient chunk by chunk.
* ``MatmulAllReduce`` (row-parallel without it): each chunk's partial product is all-reduced behind the next.
* ``MatmulAllReduceInputGrad`` (column-parallel without it): backward all-reduces each chunk of the input
  gradient behind the next chunk's GEMM and the weight-gradient GEMM.

Every element of an output or input gradient is computed as in the unchunked layer (the same dot product,
the same sum over ranks), so those are equal to it; a weight gradient that is summed over chunks adds the
chunks' partial sums in another order than one GEMM does, so it equals the unchunked one to rounding.

``fp32_products`` (every kernel's last argument): the operands are in a half-precision dtype this CPU has no
fast GEMM for (``ascendspeed.accelerator.cpu_half_gemm``), so every product multiplies fp32 copies of the same
values and is rounded once to the dtype, before it is communicated or stored, as the unchunked layer rounds it;
the weight is widened once per call, not per chunk, and what is saved for backward stays in half precision.
"""
from __future__ import annotations

from typing import Optional

import torch

from ascendspeed.features.tp_comm_overlap.collectives import TpGroup, all_gather, all_reduce, reduce_scatter


def chunk_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` (at most ``rows``) contiguous ``(start, stop)`` ranges covering ``rows``, sizes within one."""
    chunks = max(1, min(chunks, rows))
    base, extra = divmod(rows, chunks)
    bounds, start = [], 0
    for index in range(chunks):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _matmul(a: torch.Tensor, b: torch.Tensor, fp32_products: bool, out: Optional[torch.Tensor] = None):
    """``a @ b`` (into ``out`` if given); with ``fp32_products`` the product of fp32 copies, rounded once to
    ``a``'s dtype. ``b`` may have been widened already (``.float()`` of an fp32 tensor is the tensor)."""
    if not fp32_products:
        return torch.matmul(a, b, out=out)
    product = torch.matmul(a.float(), b.float())
    return product.to(a.dtype) if out is None else out.copy_(product)


def _weight_operand(weight: torch.Tensor, fp32_products: bool) -> torch.Tensor:
    """The weight as every chunk's GEMM takes it: widened once per call with ``fp32_products``."""
    return weight.float() if fp32_products else weight


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a matrix of its last dimension's vectors."""
    return tensor.reshape(-1, tensor.size(-1))


class WeightGradient:
    """A weight gradient summed chunk by chunk.

    With gradient-accumulation fusion (``main_grad`` given) each chunk is added to ``main_grad`` and the
    autograd gradient follows megatron-core's convention (a placeholder when the parameter carries
    ``grad_added_to_main_grad``, else None). Otherwise fp32 sums in place; a half-precision gradient is
    summed in fp32 and rounded once (with ``fp32_products`` each chunk's product is already fp32).
    """

    def __init__(self, weight: torch.Tensor, main_grad: Optional[torch.Tensor], fp32_products: bool = False):
        self.weight = weight
        self.main_grad = main_grad
        self.fp32_products = fp32_products
        self.total: Optional[torch.Tensor] = None

    def add(self, grad_rows: torch.Tensor, input_rows: torch.Tensor) -> None:
        if self.fp32_products:
            grad_rows, input_rows = grad_rows.float(), input_rows.float()
        part = torch.mm(grad_rows.t(), input_rows)
        if self.main_grad is not None:
            self.main_grad.add_(part)
        elif self.total is None:
            self.total = part if part.dtype == torch.float32 else part.float()
        else:
            self.total.add_(part)

    def result(self) -> Optional[torch.Tensor]:
        weight = self.weight
        if self.main_grad is None:
            return self.total.to(weight.dtype)
        if not hasattr(weight, "grad_added_to_main_grad"):
            return None
        weight.grad_added_to_main_grad = True
        make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        return make(self.main_grad.shape, dtype=weight.dtype, device=weight.device)


def _linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            fp32_products: bool = False) -> torch.Tensor:
    """The product, then the bias, as megatron-core's linear computes them (a fused add rounds otherwise); with
    ``fp32_products`` both in fp32 and the sum rounded once, as the fp32 GEMMs of ``cpu_half_gemm`` do."""
    if not fp32_products:
        output = torch.matmul(input, weight.t())
        return output + bias if bias is not None else output
    output = torch.matmul(input.float(), weight.float().t())
    return (output + bias.float() if bias is not None else output).to(input.dtype)


def _bias_grad(grad_output: torch.Tensor, needed: bool) -> Optional[torch.Tensor]:
    return _rows(grad_output).sum(dim=0) if needed else None


class AllGatherMatmul(torch.autograd.Function):
    """``all_gather(input) @ weight.T + bias`` for a column-parallel linear with sequence parallelism."""

    @staticmethod
    def forward(ctx, input, weight, bias, group: TpGroup, chunks: int, main_grad, keep_gathered: bool = False,
                fp32_products: bool = False):
        rows = input.size(0)
        bounds = chunk_bounds(rows, chunks)
        gathered = [input.new_empty((group.size, stop - start) + input.shape[1:]) for start, stop in bounds]
        pending = [all_gather(buffer, input[start:stop].contiguous(), group)
                   for buffer, (start, stop) in zip(gathered, bounds)]
        output = input.new_empty((group.size * rows,) + input.shape[1:-1] + (weight.size(0),))
        blocks = output.view((group.size, rows) + output.shape[1:])
        operand = _weight_operand(weight, fp32_products)
        for buffer, (start, stop), collective in zip(gathered, bounds, pending):
            collective.wait()
            blocks[:, start:stop] = _linear(buffer, operand, bias, fp32_products)
        ctx.save_for_backward(input, weight)
        ctx.group, ctx.bounds, ctx.main_grad, ctx.use_bias = group, bounds, main_grad, bias is not None
        ctx.fp32_products = fp32_products
        ctx.gathered = gathered if keep_gathered else None
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        group, bounds = ctx.group, ctx.bounds
        grad_output = grad_output.view((group.size, input.size(0)) + grad_output.shape[1:])
        needs_input, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gathered, gathering = ctx.gathered or [], []
        if needs_weight and ctx.gathered is not None:
            gathering = [None] * len(bounds)
        elif needs_weight:
            for start, stop in bounds:
                buffer = input.new_empty((group.size, stop - start) + input.shape[1:])
                gathered.append(buffer)
                gathering.append(all_gather(buffer, input[start:stop].contiguous(), group))
        grad_input, scattering = None, []
        if needs_input:
            grad_input = torch.empty_like(input)
            operand = _weight_operand(weight, ctx.fp32_products)
            for start, stop in bounds:
                partial = _matmul(grad_output[:, start:stop], operand, ctx.fp32_products)
                scattering.append(reduce_scatter(grad_input[start:stop], partial, group))
        grad_weight = None
        if needs_weight:
            accumulated = WeightGradient(weight, ctx.main_grad, ctx.fp32_products)
            for buffer, (start, stop), collective in zip(gathered, bounds, gathering):
                if collective is not None:
                    collective.wait()
                accumulated.add(_rows(grad_output[:, start:stop]), _rows(buffer))
            grad_weight = accumulated.result()
        grad_bias = _bias_grad(grad_output, ctx.use_bias)
        for collective in scattering:
            collective.wait()
        ctx.gathered = None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class MatmulReduceScatter(torch.autograd.Function):
    """``reduce_scatter(input @ weight.T)`` for a row-parallel linear with sequence parallelism."""

    @staticmethod
    def forward(ctx, input, weight, group: TpGroup, chunks: int, main_grad, fp32_products: bool = False):
        rows = input.size(0) // group.size
        bounds = chunk_bounds(rows, chunks)
        shards = input.view((group.size, rows) + input.shape[1:])
        output = input.new_empty((rows,) + input.shape[1:-1] + (weight.size(0),))
        pending, operand = [], _weight_operand(weight, fp32_products).t()
        for start, stop in bounds:
            partial = _matmul(shards[:, start:stop], operand, fp32_products)
            pending.append(reduce_scatter(output[start:stop], partial, group))
        for collective in pending:
            collective.wait()
        ctx.save_for_backward(input, weight)
        ctx.group, ctx.bounds, ctx.main_grad, ctx.fp32_products = group, bounds, main_grad, fp32_products
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        group, bounds = ctx.group, ctx.bounds
        shards = input.view((group.size, grad_output.size(0)) + input.shape[1:])
        gathered, gathering = [], []
        for start, stop in bounds:
            buffer = grad_output.new_empty((group.size, stop - start) + grad_output.shape[1:])
            gathered.append(buffer)
            gathering.append(all_gather(buffer, grad_output[start:stop].contiguous(), group))
        needs_input, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_input = torch.empty_like(input) if needs_input else None
        grad_shards = grad_input.view_as(shards) if needs_input else None
        accumulated = WeightGradient(weight, ctx.main_grad, ctx.fp32_products) if needs_weight else None
        operand = _weight_operand(weight, ctx.fp32_products) if needs_input else None
        for buffer, (start, stop), collective in zip(gathered, bounds, gathering):
            collective.wait()
            if needs_input:
                grad_shards[:, start:stop] = _matmul(buffer, operand, ctx.fp32_products)
            if needs_weight:
                accumulated.add(_rows(buffer), _rows(shards[:, start:stop]))
        return grad_input, accumulated.result() if needs_weight else None, None, None, None, None


class MatmulAllReduce(torch.autograd.Function):
    """``all_reduce(input @ weight.T)`` for a row-parallel linear without sequence parallelism."""

    @staticmethod
    def forward(ctx, input, weight, group: TpGroup, chunks: int, main_grad, fp32_products: bool = False):
        output = input.new_empty(input.shape[:-1] + (weight.size(0),))
        pending, operand = [], _weight_operand(weight, fp32_products).t()
        for start, stop in chunk_bounds(input.size(0), chunks):
            _matmul(input[start:stop], operand, fp32_products, out=output[start:stop])
            pending.append(all_reduce(output[start:stop], group))
        for collective in pending:
            collective.wait()
        ctx.save_for_backward(input, weight)
        ctx.main_grad, ctx.fp32_products = main_grad, fp32_products
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = _matmul(grad_output, weight, ctx.fp32_products) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            accumulated = WeightGradient(weight, ctx.main_grad, ctx.fp32_products)
            accumulated.add(_rows(grad_output), _rows(input))
            grad_weight = accumulated.result()
        return grad_input, grad_weight, None, None, None, None


class MatmulAllReduceInputGrad(torch.autograd.Function):
    """``input @ weight.T + bias`` whose input gradient is all-reduced, for a column-parallel linear without
    sequence parallelism (megatron-core's ``allreduce_dgrad``)."""

    @staticmethod
    def forward(ctx, input, weight, bias, group: TpGroup, chunks: int, main_grad, fp32_products: bool = False):
        ctx.save_for_backward(input, weight)
        ctx.group, ctx.chunks, ctx.main_grad, ctx.use_bias = group, chunks, main_grad, bias is not None
        ctx.fp32_products = fp32_products
        return _linear(input, weight, bias, fp32_products)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input, pending = None, []
        if ctx.needs_input_grad[0]:
            grad_input = input.new_empty(input.shape)
            operand = _weight_operand(weight, ctx.fp32_products)
            for start, stop in chunk_bounds(input.size(0), ctx.chunks):
                _matmul(grad_output[start:stop], operand, ctx.fp32_products, out=grad_input[start:stop])
                pending.append(all_reduce(grad_input[start:stop], ctx.group))
        grad_weight = None
        if ctx.needs_input_grad[1]:
            accumulated = WeightGradient(weight, ctx.main_grad, ctx.fp32_products)
            accumulated.add(_rows(grad_output), _rows(input))
            grad_weight = accumulated.result()
        grad_bias = _bias_grad(grad_output, ctx.use_bias)
        for collective in pending:
            collective.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None
