"""Hybrid context parallelism: Ulysses inside groups of ``K`` ranks, ring attention across the groups.

Context-parallel rank ``c`` belongs to Ulysses group ``c // K`` (ranks ``gK .. gK + K - 1``) and to the ring
of the ranks with the same ``c % K``. After the Ulysses all-to-all a rank holds ``heads / K`` heads of its
group's tokens in ascending order; with the balanced layout those are the chunks ``g`` and ``2R - 1 - g``
of a sequence cut into ``2R`` chunks (``R = cp / K``), so the ring is balanced too.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ascendspeed.features.context_parallel.dropout import PositionalDropout
from ascendspeed.features.context_parallel.ring import ring_attention
from ascendspeed.features.context_parallel.telemetry import RingTelemetry
from ascendspeed.features.context_parallel.ulysses import ulysses_attention


@dataclasses.dataclass(frozen=True)
class HybridGroups:
    """This rank's Ulysses and ring groups, and the context-parallel global ranks they were cut from."""

    cp_ranks: tuple[int, ...]
    ulysses_degree: int
    ulysses: dist.ProcessGroup
    ring: dist.ProcessGroup

    @property
    def ring_size(self) -> int:
        return len(self.cp_ranks) // self.ulysses_degree


def check_hybrid_sizes(cp_size: int, ulysses_degree: int) -> None:
    if ulysses_degree < 1 or cp_size % ulysses_degree:
        raise ValueError(
            f"--ulysses-degree-in-cp {ulysses_degree} must divide --context-parallel-size {cp_size}"
        )


def build_hybrid_groups(cp_ranks: Sequence[int], ulysses_degree: int) -> HybridGroups:
    """Create this rank's two groups. Every member of the context-parallel group calls it (only members
    of a new group take part in creating it)."""
    cp_ranks = tuple(cp_ranks)
    check_hybrid_sizes(len(cp_ranks), ulysses_degree)
    me = cp_ranks.index(dist.get_rank())
    group_index, lane = divmod(me, ulysses_degree)
    ulysses_ranks = cp_ranks[group_index * ulysses_degree:(group_index + 1) * ulysses_degree]
    ring_ranks = cp_ranks[lane::ulysses_degree]
    ulysses = dist.new_group(list(ulysses_ranks), use_local_synchronization=True)
    ring = dist.new_group(list(ring_ranks), use_local_synchronization=True)
    return HybridGroups(cp_ranks, ulysses_degree, ulysses, ring)


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: Sequence[torch.Tensor],
    groups: HybridGroups,
    *,
    causal: bool = True,
    scale: Optional[float] = None,
    slopes: Optional[torch.Tensor] = None,
    symmetric_alibi: Optional[bool] = None,
    mask: Optional[torch.Tensor] = None,
    dropout: Optional[PositionalDropout] = None,
    telemetry: Optional[RingTelemetry] = None,
    segments: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of this rank's [b, heads, local sequence, d] tensors; ``positions[c]`` for every cp rank ``c``,
    ``segments`` the bounds of a pack's sequences (``ring_attention``)."""
    by_global_rank = dict(zip(groups.cp_ranks, positions))
    ulysses_positions = [by_global_rank[r] for r in dist.get_process_group_ranks(groups.ulysses)]
    ring_positions = []
    for ring_member in dist.get_process_group_ranks(groups.ring):
        start = groups.cp_ranks.index(ring_member) // groups.ulysses_degree * groups.ulysses_degree
        members = groups.cp_ranks[start:start + groups.ulysses_degree]
        ring_positions.append(torch.sort(torch.cat([by_global_rank[r] for r in members])).values)

    def ring_core(q, k, v, gathered_positions, head_slopes, mask_rows, head_dropout):
        return ring_attention(q, k, v, ring_positions, group=groups.ring, causal=causal, scale=scale,
                              slopes=head_slopes, symmetric_alibi=symmetric_alibi, mask=mask_rows,
                              dropout=head_dropout, telemetry=telemetry, segments=segments)

    return ulysses_attention(q, k, v, ulysses_positions, group=groups.ulysses, core=ring_core, slopes=slopes,
                             mask=mask, dropout=dropout)
