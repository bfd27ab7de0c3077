"""Ring attention: every rank keeps its queries and passes key/value blocks around the context-parallel ring.

Forward: at step ``t`` rank ``i`` holds the keys and values of rank ``i - t``; it sends them on to
``i + 1`` (``batch_isend_irecv``) while it computes their block, and folds the block into its output with
the log-sum-exp merge. Backward is a second ring pass: the key/value blocks travel again, each with the
gradient of its keys and values accumulated by the ranks it has visited, and after a full turn (one
extra hop) every dK/dV is back with its owner. dQ never leaves the rank.

A block is computed by ``block_kernels``: the blockwise torch code, or torch_npu's fused attention on an
NPU. Under a causal mask the plan of a block comes from positions: only the queries at or after the block's
first key and the keys at or before the block's last query take part, and the causal mask is applied
only where the two ranges overlap. With the balanced layout (``layout.py``) that is: the diagonal block
causal, blocks from earlier ranks with all queries against their first chunk, blocks from later ranks
with the second query chunk against all keys -- the same work on every rank.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ascendspeed.features.context_parallel.block_kernels import kernels_for
from ascendspeed.features.context_parallel.blockwise import ScoreRule, accumulator_dtype, merge_block_
from ascendspeed.features.context_parallel.dropout import PositionalDropout
from ascendspeed.features.context_parallel.telemetry import RingTelemetry

_TAG_KV = 7
_TAG_GRAD_KV = 8


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """The rows (queries) and columns (keys) of a block that take part, and whether to mask causally."""

    rows: slice
    cols: slice
    causal_mask: bool


def plan_block(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> Optional[BlockPlan]:
    """What of a (queries at ``q_pos``) x (keys at ``k_pos``) block to compute; None when nothing is visible.

    Positions must be ascending (the layouts of this package are) for the causal plan.
    """
    everything = slice(None)
    if not causal:
        return BlockPlan(everything, everything, False)
    first_row = int(torch.searchsorted(q_pos, k_pos[0]))
    end_col = int(torch.searchsorted(k_pos, q_pos[-1], right=True))
    if first_row == q_pos.numel() or end_col == 0:
        return None
    causal_mask = bool(k_pos[end_col - 1] > q_pos[first_row])
    return BlockPlan(slice(first_row, None), slice(0, end_col), causal_mask)


class _Exchange:
    """One ring hop in flight: ``tensor`` to the next rank, a buffer of the same shape from the previous."""

    def __init__(self, ring: "Ring", tensor: torch.Tensor, tag: int):
        self.received = torch.empty_like(tensor)
        self._telemetry = ring.telemetry
        ops = [
            dist.P2POp(dist.isend, tensor, ring.next_rank, ring.group, tag),
            dist.P2POp(dist.irecv, self.received, ring.previous_rank, ring.group, tag),
        ]
        self._posted = time.perf_counter()
        self._works = dist.batch_isend_irecv(ops)
        self._watcher = None
        if self._telemetry is not None:
            self._completed = None
            self._watcher = threading.Thread(target=self._watch, daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        for work in self._works:
            work.wait()
        self._completed = time.perf_counter()

    def wait(self) -> torch.Tensor:
        if self._watcher is None:
            for work in self._works:
                work.wait()
            return self.received
        blocked = time.perf_counter()
        self._watcher.join()
        now = time.perf_counter()
        self._telemetry.record_hop(self._posted, self._completed, now - blocked)
        return self.received


@dataclasses.dataclass
class Ring:
    """The ring: its process group and, per member (in group rank order), the positions it holds."""

    group: Optional[dist.ProcessGroup]
    positions: Sequence[torch.Tensor]
    telemetry: Optional[RingTelemetry] = None

    def __post_init__(self):
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else None
        self.size = len(ranks) if ranks is not None else 1
        if len(self.positions) != self.size:
            raise ValueError(f"the ring has {self.size} members but positions were given for {len(self.positions)}")
        self.index = dist.get_rank(self.group) if ranks is not None else 0
        self.next_rank = ranks[(self.index + 1) % self.size] if ranks else 0
        self.previous_rank = ranks[(self.index - 1) % self.size] if ranks else 0

    def source(self, step: int) -> int:
        """The member whose key/value block this rank holds at ``step``."""
        return (self.index - step) % self.size

    def send_on(self, tensor: torch.Tensor, tag: int) -> _Exchange:
        if self.telemetry is not None:
            self.telemetry.sent_bytes += tensor.numel() * tensor.element_size()
        return _Exchange(self, tensor, tag)

    @contextlib.contextmanager
    def computing(self):
        """Counts the block computation inside into the telemetry."""
        start = time.perf_counter()
        yield
        if self.telemetry is not None:
            self.telemetry.compute_s += time.perf_counter() - start


def _mask_rows(mask, rows):
    return None if mask is None else mask[..., rows, :]


def _ring_forward(q, k, v, mask, ring: Ring, rule: ScoreRule, kernels):
    acc = accumulator_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    q_pos = ring.positions[ring.index]
    key_value = torch.stack([k, v])
    for step in range(ring.size):
        source = ring.source(step)
        exchange = ring.send_on(key_value, _TAG_KV) if step < ring.size - 1 else None
        plan = plan_block(q_pos, ring.positions[source], rule.causal)
        if plan is not None:
            with ring.computing():
                k_block, v_block = key_value[:, :, :, plan.cols]
                block_out, block_lse = kernels.forward(
                    q[:, :, plan.rows], k_block, v_block, q_pos[plan.rows], ring.positions[source][plan.cols],
                    rule, _mask_rows(mask, plan.rows), plan.causal_mask,
                )
                merge_block_(out[:, :, plan.rows], lse[:, :, plan.rows], block_out, block_lse)
        if exchange is not None:
            key_value = exchange.wait()
    return out, lse


def _ring_backward(q, k, v, mask, out, lse, grad_out, ring: Ring, rule: ScoreRule, kernels):
    acc = accumulator_dtype(q.dtype)
    grad_q = torch.zeros(q.shape, dtype=acc, device=q.device)
    delta = (grad_out.to(acc) * out.to(acc)).sum(dim=-1)
    q_pos = ring.positions[ring.index]
    key_value = torch.stack([k, v])
    incoming_grad = None
    for step in range(ring.size):
        source = ring.source(step)
        exchange = ring.send_on(key_value, _TAG_KV) if step < ring.size - 1 else None
        k_pos = ring.positions[source]
        grad_key_value = torch.zeros(key_value.shape, dtype=acc, device=q.device)
        plan = plan_block(q_pos, k_pos, rule.causal)
        if plan is not None:
            with ring.computing():
                rows, cols = plan.rows, plan.cols
                k_block, v_block = key_value[:, :, :, cols]
                block_grad_q, block_grad_k, block_grad_v = kernels.backward(
                    q[:, :, rows], k_block, v_block, grad_out[:, :, rows], out[:, :, rows], lse[:, :, rows],
                    delta[:, :, rows], q_pos[rows], k_pos[cols], rule, _mask_rows(mask, rows), plan.causal_mask,
                )
                grad_q[:, :, rows] += block_grad_q
                grad_key_value[0, :, :, cols] += block_grad_k
                grad_key_value[1, :, :, cols] += block_grad_v
        if incoming_grad is not None:
            grad_key_value += incoming_grad.wait()
        incoming_grad = ring.send_on(grad_key_value, _TAG_GRAD_KV) if ring.size > 1 else None
        if exchange is not None:
            key_value = exchange.wait()
    grad_key_value = incoming_grad.wait() if incoming_grad is not None else grad_key_value
    return grad_q, grad_key_value[0], grad_key_value[1]


class RingAttention(torch.autograd.Function):
    """Autograd of ring attention over [b, heads, local sequence, head dim] tensors."""

    @staticmethod
    def forward(ctx, q, k, v, mask, ring: Ring, rule: ScoreRule, kernels):
        out, lse = _ring_forward(q, k, v, mask, ring, rule, kernels)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.ring, ctx.rule, ctx.kernels = ring, rule, kernels
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = _ring_backward(q, k, v, mask, out, lse, grad_out.contiguous(), ctx.ring, ctx.rule,
                                                ctx.kernels)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: Sequence[torch.Tensor],
    *,
    group: Optional[dist.ProcessGroup] = None,
    causal: bool = True,
    scale: Optional[float] = None,
    slopes: Optional[torch.Tensor] = None,
    symmetric_alibi: Optional[bool] = None,
    mask: Optional[torch.Tensor] = None,
    dropout: Optional[PositionalDropout] = None,
    telemetry: Optional[RingTelemetry] = None,
    kernels=None,
    segments: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the keys of every rank of ``group``.

    ``q``, ``k``, ``v``: [batch, heads, local sequence, head dim], the same heads on every rank.
    ``positions[j]``: the absolute positions (int64, ascending) of the tokens member ``j`` of the group holds.
    ``slopes``: ALiBi slopes of the heads (None: no ALiBi); ``symmetric_alibi``: distance ``|q - k|``
    (default: when not ``causal``). ``mask``: bool [b or 1, heads or 1, local
    sequence, S], True where a query must not see a key, columns indexed by absolute key position.
    ``dropout``: attention dropout of these heads by position (None: none). ``segments``: the bounds of the
    sequences of a pack (int64, ascending, from 0; TE's ``cu_seqlens``), whose tokens see their own
    sequence only, ``positions`` counting through the whole pack (None: one sequence).
    ``group`` None: a single process (no communication), the reference path. ``kernels``: what computes
    each block (``block_kernels``; None: torch_npu's fused attention for NPU tensors, the blockwise torch
    code otherwise).
    """
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.size(-1) != k.size(-1):
        raise ValueError(
            f"ring_attention takes q, k, v as [batch, heads, sequence, head dim] with the same batch, heads and "
            f"head dim; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    ring = Ring(group, [p.to("cpu", torch.int64) for p in positions], telemetry)
    if ring.positions[ring.index].numel() != q.size(2):
        raise ValueError(
            f"this rank holds {q.size(2)} queries but positions[{ring.index}] has {ring.positions[ring.index].numel()}"
        )
    if causal and any(bool((p[1:] < p[:-1]).any()) for p in ring.positions):
        raise ValueError("causal ring attention needs each member's positions in ascending order")
    if dropout is not None and dropout.heads.numel() != q.size(1):
        raise ValueError(f"dropout covers {dropout.heads.numel()} heads but q has {q.size(1)}")
    if segments is not None:
        segments = segments.to("cpu", torch.int64)
        if segments.dim() != 1 or segments.numel() < 2 or int(segments[0]) != 0 or bool((segments.diff() < 0).any()):
            raise ValueError(f"segments must be the ascending bounds of a pack's sequences from 0, "
                             f"got {segments.tolist()}")
    rule = ScoreRule(scale=q.size(-1) ** -0.5 if scale is None else scale, causal=causal, slopes=slopes,
                     symmetric_alibi=symmetric_alibi, dropout=dropout, segments=segments)
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool (True = hidden), got {mask.dtype}")
    kernels = kernels_for(q, with_dropout=dropout is not None) if kernels is None else kernels
    return RingAttention.apply(q, k, v, mask, ring, rule, kernels)
