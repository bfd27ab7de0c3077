"""Ulysses: trade the sequence split for a head split with one all-to-all, attend, and trade back.

Each of the ``U`` ranks of the group starts with all heads of its share of the sequence. The all-to-all
gives rank ``j`` heads ``[j h / U, (j + 1) h / U)`` of the whole group's sequence; any core attention runs
on that, and a second all-to-all returns the output to the sequence split. The gathered tokens are put in
ascending position order first (with the balanced layout rank ``r`` holds two distant chunks), so the core
attention sees an ordinary sequence: the whole one when the group is the full context-parallel group,
one member's share of a ring in the hybrid scheme.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ascendspeed.features.context_parallel.dropout import PositionalDropout
from ascendspeed.features.context_parallel.ring import ring_attention


def _all_to_all(tensor: torch.Tensor, group) -> torch.Tensor:
    """``all_to_all_single`` along dim 0 (one slice per rank)."""
    tensor = tensor.contiguous()
    received = torch.empty_like(tensor)
    dist.all_to_all_single(received, tensor, group=group)
    return received


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[b, h, s, d] (all heads, my tokens) -> [b, h / U, U * s, d] (my heads, every member's tokens in rank order)."""
    size = dist.get_world_size(group)
    b, h, s, d = x.shape
    parts = x.reshape(b, size, h // size, s, d).transpose(0, 1)
    received = _all_to_all(parts, group)  # [U (source member), b, h / U, s, d]
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of ``sequence_to_heads``."""
    size = dist.get_world_size(group)
    b, heads, total, d = x.shape
    parts = x.reshape(b, heads, size, total // size, d).permute(2, 0, 1, 3, 4)
    received = _all_to_all(parts, group)  # [U (source head group), b, h / U, s, d]
    return received.transpose(0, 1).reshape(b, size * heads, total // size, d)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_sequence(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return sequence_to_heads(grad, ctx.group), None


def _gather_mask_rows(mask: torch.Tensor, group) -> torch.Tensor:
    """Every member's query rows of ``mask`` ([.., local sequence, S]), concatenated in rank order."""
    pieces = [torch.empty_like(mask, dtype=torch.uint8) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, mask.to(torch.uint8).contiguous(), group=group)
    return torch.cat(pieces, dim=-2).bool()


#: A core attention: (q, k, v, ascending positions of the tokens, ALiBi slopes of the heads or None,
#: bool mask rows [b or 1, heads or 1, tokens, S] or None, PositionalDropout of the heads or None) -> output,
#: all [b, heads, tokens, head dim].
CoreAttention = Callable[..., torch.Tensor]


def local_core_attention(causal: bool = True, scale: Optional[float] = None, symmetric_alibi: Optional[bool] = None,
                         segments: Optional[torch.Tensor] = None) -> CoreAttention:
    """Exact attention over the tokens at hand (the reference path of ``ring_attention``, no communication)."""

    def core(q, k, v, positions, slopes, mask, dropout=None):
        return ring_attention(q, k, v, [positions], causal=causal, scale=scale, slopes=slopes,
                              symmetric_alibi=symmetric_alibi, mask=mask, dropout=dropout, segments=segments)

    return core


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: Sequence[torch.Tensor],
    *,
    group: Optional[dist.ProcessGroup],
    core: CoreAttention,
    slopes: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    dropout: Optional[PositionalDropout] = None,
) -> torch.Tensor:
    """Ulysses attention of this rank's [b, heads, local sequence, d] q, k, v over ``group``.

    ``positions[j]``: absolute positions of the tokens member ``j`` holds. ``slopes``, ``dropout``: ALiBi
    slopes and attention dropout of all ``heads`` (each member keeps its share). ``mask``: bool rows of this
    rank's queries [b or 1, heads or 1, local sequence, S]. The heads must divide by the group size.
    """
    size = dist.get_world_size(group) if group is not None else 1
    heads = q.size(1)
    if heads % size or k.size(1) != heads or v.size(1) != heads:
        raise ValueError(
            f"Ulysses splits the attention heads over {size} ranks: q, k and v need the same number of heads, "
            f"divisible by {size}; got {q.size(1)}, {k.size(1)}, {v.size(1)} (choose --ulysses-degree-in-cp or "
            "--context-parallel-size dividing --num-attention-heads / --tensor-model-parallel-size)"
        )
    if size == 1:
        return core(q, k, v, positions[0], slopes, mask, dropout)
    member = dist.get_rank(group)
    gathered = torch.cat([p.to("cpu", torch.int64) for p in positions])
    order = torch.argsort(gathered, stable=True)
    reorder = not torch.equal(order, torch.arange(order.numel()))
    device_order = order.to(q.device)

    def to_heads(x):
        x = _SequenceToHeads.apply(x, group)
        return x.index_select(2, device_order) if reorder else x

    q, k, v = (to_heads(x) for x in (q, k, v))
    if slopes is not None:
        slopes = slopes.chunk(size)[member]
    if dropout is not None:
        dropout = dropout.head_share(size, member)
    if mask is not None:
        mask = _gather_mask_rows(mask, group)
        if reorder:
            mask = mask.index_select(-2, device_order.to(mask.device))
        if mask.size(1) > 1:
            mask = mask.chunk(size, dim=1)[member]
    out = core(q, k, v, gathered[order], slopes, mask, dropout)
    if reorder:
        out = out.index_select(2, torch.argsort(order).to(out.device))
    return _HeadsToSequence.apply(out, group)
