"""MoE token permutation: the rearrangements around a mixture-of-experts layer's experts, as torch operators.

A router marks, for every token ``t``, the experts ``e`` it goes to (``routing_map[t, e]``). The experts
want their tokens contiguous, so the dispatcher *permutes* the tokens into expert order (expert by expert,
tokens ascending within an expert), runs the experts, and *unpermutes*: each token's rows summed back into
its place, optionally weighted by its routing probabilities. The alltoall dispatcher also *sorts chunks*:
regroups the blocks of rows it received from every rank by local expert.

megatron-core's unfused path does this with an argsort, ``index_select``, ``masked_select`` and
``scatter_add``; Transformer Engine has fused kernels. These operators are ascendspeed's: one pass over
memory each, the row order found by counting (no sort), and the result equal to megatron-core's unfused
path to the bit, forward and backward (see ``docs/ops/moe_permute.md``).

* ``torch.ops.ascendspeed.moe_permute_index(routing_map, num_out_tokens)``: the permuted rows, each named by
  ``e * num_tokens + t`` (one int64 says both which token and which expert);
* ``moe_gather(x, row_id_map, probs=None)``: ``out[r] = x[t(r)]`` (times ``probs[t(r), e(r)]``);
* ``moe_scatter_add(y, row_id_map, probs, num_tokens)``: ``out[t] = sum of y[r] (times probs[t, e(r)])`` over
  the rows ``r`` of token ``t``, in row order;
* ``moe_sort_chunks(x, split_sizes, sorted_idxs)``: ``x``'s row chunks in the order ``sorted_idxs`` names.

``moe_gather`` and ``moe_scatter_add`` are each other's gradients. Kernels: C++ on the CPU
(``ascendspeed/csrc/moe_permute``); elsewhere (CUDA, NPU) the composition of torch ops megatron-core's
unfused path runs, on the device. torch_npu's ``npu_moe_token_permute`` family takes top-k expert indices,
a fixed number per token, which a routing map after token dropping does not have; it is not used.
"""
from __future__ import annotations

from typing import Optional

import torch

from ascendspeed.ops._autograd import register_autograd
from ascendspeed.ops._extension import composite_kernel_devices, load_extension

__all__ = [
    "permute_tokens",
    "unpermute_tokens",
    "sort_chunks",
    "permute_tokens_reference",
    "unpermute_tokens_reference",
]

load_extension()  # defines the operators and their CPU and Meta kernels

#: Rows per step of the probs gradient (the product of the output gradient and the expert outputs is
#: materialised this many rows at a time instead of all at once).
PROBS_GRAD_ROWS = 4096


def permute_tokens(
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    probs: Optional[torch.Tensor] = None,
    num_out_tokens: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``(permuted_tokens, permuted_probs, row_id_map)``: the tokens of ``[num_tokens, hidden]`` in expert order
    (``routing_map`` ``[num_tokens, num_experts]``, non-zero = routed), the first ``num_out_tokens`` rows of it
    (default: every routed pair), with the matching ``probs[t, e]`` when ``probs`` is given. Differentiable in
    ``tokens`` and ``probs``."""
    if num_out_tokens is None or num_out_tokens < 0:
        num_out_tokens = int(torch.count_nonzero(routing_map))
    row_id_map = torch.ops.ascendspeed.moe_permute_index(routing_map, num_out_tokens)
    permuted = torch.ops.ascendspeed.moe_gather(tokens, row_id_map)
    permuted_probs = None if probs is None else _probs_of_rows(probs, row_id_map)
    return permuted, permuted_probs, row_id_map


def unpermute_tokens(
    permuted_tokens: torch.Tensor,
    row_id_map: torch.Tensor,
    num_tokens: int,
    probs: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[num_tokens, hidden]``: every token's rows summed in row order, each weighted by ``probs[t, e]``
    (``[num_tokens, num_experts]``) when given. Differentiable in ``permuted_tokens`` and ``probs``."""
    return torch.ops.ascendspeed.moe_scatter_add(permuted_tokens, row_id_map, probs, num_tokens)


def sort_chunks(
    x: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_idxs: torch.Tensor,
    probs: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``x`` (and ``probs``, one per row) cut into chunks of ``split_sizes`` rows, the chunks in the order of
    the permutation ``sorted_idxs``. Differentiable."""
    out = torch.ops.ascendspeed.moe_sort_chunks(x, split_sizes, sorted_idxs)
    return out, None if probs is None else torch.ops.ascendspeed.moe_sort_chunks(probs, split_sizes, sorted_idxs)


def _probs_of_rows(probs: torch.Tensor, row_id_map: torch.Tensor) -> torch.Tensor:
    """``probs[t(r), e(r)]`` for every row: ``row_id_map`` indexes the transposed probs as it comes (the
    gather megatron-core's unfused path runs, so its gradient is the same too)."""
    return probs.T.contiguous().reshape(-1).index_select(0, row_id_map)


# -- references: megatron-core's unfused composition ---------------------------------------------------------
def permute_tokens_reference(tokens, routing_map, probs=None, num_out_tokens=None):
    """megatron-core's unfused permutation (argsort of the transposed routing map, then ``index_select``)."""
    num_tokens = tokens.size(0)
    if num_out_tokens is None or num_out_tokens < 0:
        num_out_tokens = int(torch.count_nonzero(routing_map))
    flat = routing_map.bool().T.contiguous().reshape(-1).argsort(descending=True, stable=True)[:num_out_tokens]
    permuted = tokens.index_select(0, flat % num_tokens)
    permuted_probs = None if probs is None else probs.T.contiguous().reshape(-1)[flat]
    return permuted, permuted_probs, flat


def unpermute_tokens_reference(permuted_tokens, row_id_map, num_tokens, probs=None):
    """megatron-core's unfused unpermutation: rows times their probs (in the promoted dtype), ``scatter_add``
    into zeros, cast back to the rows' dtype."""
    dtype = permuted_tokens.dtype
    if probs is not None:
        permuted_tokens = permuted_tokens * _probs_of_rows(probs, row_id_map).unsqueeze(-1)
    tokens = row_id_map % num_tokens
    out = torch.zeros((num_tokens, *permuted_tokens.shape[1:]), dtype=permuted_tokens.dtype,
                      device=permuted_tokens.device)
    index = tokens.view(-1, *([1] * (permuted_tokens.dim() - 1))).expand_as(permuted_tokens)
    return out.scatter_add_(0, index, permuted_tokens).to(dtype)


# -- autograd ------------------------------------------------------------------------------------------------
def _compute_dtype(x: torch.Tensor, probs: Optional[torch.Tensor]) -> torch.dtype:
    return x.dtype if probs is None else torch.promote_types(x.dtype, probs.dtype)


def _probs_grad(grad_rows_of, rows: torch.Tensor, row_id_map: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``d loss / d probs`` where row ``r`` was multiplied by ``probs[t(r), e(r)]``: the row's dot product with
    its output gradient, ``(grad_row * row).sum(-1)`` as megatron-core's unfused autograd takes it, a block of
    rows at a time (no block of a single row, whose sum torch may split differently), placed at ``(t, e)``."""
    compute = _compute_dtype(rows, probs)
    n = rows.size(0)
    dots = torch.empty(n, dtype=compute, device=rows.device)
    start = 0
    while start < n:
        end = n if n - start < 2 * PROBS_GRAD_ROWS else start + PROBS_GRAD_ROWS
        block = grad_rows_of(start, end).to(compute) * rows[start:end]
        dots[start:end] = block.reshape(end - start, -1).sum(-1)
        start = end
    grad = torch.zeros(probs.numel(), dtype=probs.dtype, device=probs.device)
    grad.index_put_((row_id_map,), dots.to(probs.dtype))
    return grad.view(probs.size(1), probs.size(0)).T


def _gather_setup_context(ctx, inputs, output) -> None:
    x, row_id_map, probs = inputs
    ctx.num_tokens = x.size(0)
    ctx.save_for_backward(x if probs is not None and probs.requires_grad else None, row_id_map, probs)


def _gather_backward(ctx, grad_out):
    x, row_id_map, probs = ctx.saved_tensors
    grad_x = torch.ops.ascendspeed.moe_scatter_add(grad_out, row_id_map, probs, ctx.num_tokens)
    grad_probs = None
    if probs is not None and ctx.needs_input_grad[2]:
        tokens = row_id_map % ctx.num_tokens
        grad_probs = _probs_grad(lambda s, e: x.index_select(0, tokens[s:e]), grad_out, row_id_map, probs)
    return grad_x, None, grad_probs


def _scatter_add_setup_context(ctx, inputs, output) -> None:
    y, row_id_map, probs, num_tokens = inputs
    ctx.num_tokens = num_tokens
    ctx.save_for_backward(y if probs is not None and probs.requires_grad else None, row_id_map, probs)


def _scatter_add_backward(ctx, grad_out):
    y, row_id_map, probs = ctx.saved_tensors
    grad_y = torch.ops.ascendspeed.moe_gather(grad_out, row_id_map, probs)
    grad_probs = None
    if probs is not None and ctx.needs_input_grad[2]:
        tokens = row_id_map % ctx.num_tokens
        compute = _compute_dtype(y, probs)
        grad_probs = _probs_grad(lambda s, e: grad_out.index_select(0, tokens[s:e]).to(compute), y, row_id_map,
                                 probs)
    return grad_y, None, grad_probs, None


def _sort_chunks_setup_context(ctx, inputs, output) -> None:
    x, split_sizes, sorted_idxs = inputs
    ctx.save_for_backward(split_sizes, sorted_idxs)


def _sort_chunks_backward(ctx, grad_out):
    split_sizes, sorted_idxs = ctx.saved_tensors
    order = sorted_idxs.to(split_sizes.device)
    inverse = torch.argsort(order)
    return torch.ops.ascendspeed.moe_sort_chunks(grad_out, split_sizes[order], inverse), None, None


register_autograd("moe_gather", _gather_backward, _gather_setup_context)
register_autograd("moe_scatter_add", _scatter_add_backward, _scatter_add_setup_context)
register_autograd("moe_sort_chunks", _sort_chunks_backward, _sort_chunks_setup_context)


# -- kernels of devices without a C++ kernel here (CUDA, NPU): megatron-core's composition on the device ------
def _composite_permute_index(routing_map: torch.Tensor, num_out_tokens: int) -> torch.Tensor:
    torch.ops.ascendspeed.moe_permute_index(routing_map.to("meta"), num_out_tokens)
    routed = int(torch.count_nonzero(routing_map))
    if num_out_tokens > routed:
        raise ValueError(f"moe_permute_index: num_out_tokens = {num_out_tokens} is more than the {routed} "
                         "(token, expert) pairs routing_map routes; pass at most routing_map.sum()")
    return routing_map.ne(0).T.contiguous().reshape(-1).argsort(descending=True, stable=True)[:num_out_tokens]


def _composite_gather(x: torch.Tensor, row_id_map: torch.Tensor, probs: Optional[torch.Tensor] = None):
    torch.ops.ascendspeed.moe_gather(x.to("meta"), row_id_map.to("meta"), None if probs is None else probs.to("meta"))
    rows = x.index_select(0, row_id_map % x.size(0))
    if probs is None:
        return rows
    scale = _probs_of_rows(probs, row_id_map).view(-1, *([1] * (x.dim() - 1)))
    return (rows.to(_compute_dtype(x, probs)) * scale).to(x.dtype)


def _composite_scatter_add(y: torch.Tensor, row_id_map: torch.Tensor, probs: Optional[torch.Tensor],
                           num_tokens: int):
    torch.ops.ascendspeed.moe_scatter_add(y.to("meta"), row_id_map.to("meta"),
                                          None if probs is None else probs.to("meta"), num_tokens)
    return unpermute_tokens_reference(y, row_id_map, num_tokens, probs)


def _composite_sort_chunks(x: torch.Tensor, split_sizes: torch.Tensor, sorted_idxs: torch.Tensor):
    chunks = torch.split(x, split_sizes.tolist(), dim=0)
    return torch.cat([chunks[i] for i in sorted_idxs.tolist()], dim=0)


for _device in composite_kernel_devices():
    torch.library.register_kernel("ascendspeed::moe_permute_index", _device, _composite_permute_index)
    torch.library.register_kernel("ascendspeed::moe_gather", _device, _composite_gather)
    torch.library.register_kernel("ascendspeed::moe_scatter_add", _device, _composite_scatter_add)
    torch.library.register_kernel("ascendspeed::moe_sort_chunks", _device, _composite_sort_chunks)
