"""Attention of one block of queries against one block of keys, at absolute positions.

Context-parallel attention is a sum over blocks: each rank's queries against the keys of every rank.
A block returns its output normalised over its own keys together with the log-sum-exp of its scores,
and blocks are merged with ``merge_block_``, exactly, whatever order they arrive in. The backward of a
block only needs the final output and log-sum-exp of its rows (the flash-attention identity
``dS = P * (dP - rowsum(dO * O))``), so no probabilities are kept between forward and backward.

Scores and accumulators are fp32 (float64 for float64 inputs). What can hide a key from a query:

* ``causal``: the key's position is after the query's;
* ``segments``: the key lies in another sequence of a pack than the query (``layout.segment_ids``);
* ``mask``: a boolean tensor ``[b or 1, heads or 1, block queries, S]``, True where hidden, whose last
  dimension is indexed by the keys' absolute positions (Megatron's ``attention_mask`` rows);

and ALiBi adds ``-m_h * (q_pos - k_pos)`` (causal) or ``-m_h * |q_pos - k_pos|`` (otherwise) to the
scaled scores, as ``ascendspeed.ops.alibi`` does on a single device (``ScoreRule.symmetric_alibi``).
Attention dropout (``ScoreRule.dropout``) scales the probabilities by a mask of the positions
(``dropout.py``) and leaves the log-sum-exp alone, so blocks merge as without it.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ascendspeed.features.context_parallel.dropout import PositionalDropout


@dataclasses.dataclass(frozen=True)
class ScoreRule:
    """How scores are formed: softmax scale, causal masking, ALiBi slopes of the heads at hand.

    ``symmetric_alibi``: the ALiBi distance is ``|q_pos - k_pos|`` (None: when not ``causal``), as
    Megatron's local path does for a layer whose mask type is not causal. ``dropout``: the attention
    dropout of the heads at hand (None: none). ``segments``: the bounds (int64, ascending, from 0) of the
    sequences of a pack, in positions (None: one sequence).
    """

    scale: float
    causal: bool = True
    slopes: Optional[torch.Tensor] = None
    symmetric_alibi: Optional[bool] = None
    dropout: Optional[PositionalDropout] = None
    segments: Optional[torch.Tensor] = None

    @property
    def alibi_distance_is_absolute(self) -> bool:
        return (not self.causal) if self.symmetric_alibi is None else self.symmetric_alibi


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with the -inf of rows that see no key replaced by 0, so ``exp(score - lse)`` gives 0, not NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def positional_hidden(q_pos, k_pos, rule: ScoreRule, needs_causal_mask: bool, device) -> Optional[torch.Tensor]:
    """[queries, keys], True where the causal mask or a sequence bound of a pack hides the key; None: neither."""
    hidden = (k_pos[None, :] > q_pos[:, None]) if needs_causal_mask else None
    if rule.segments is not None:
        from ascendspeed.features.context_parallel.layout import segment_ids

        apart = segment_ids(q_pos, rule.segments)[:, None] != segment_ids(k_pos, rule.segments)[None, :]
        hidden = apart if hidden is None else hidden | apart
    return None if hidden is None else hidden.to(device)


def block_scores(q, k, q_pos, k_pos, rule: ScoreRule, mask: Optional[torch.Tensor], needs_causal_mask: bool):
    """Scaled, biased, masked scores [b, h, sq, sk] in the accumulator dtype; hidden entries are -inf."""
    acc = accumulator_dtype(q.dtype)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)).mul_(rule.scale)
    if rule.slopes is not None:
        distance = (q_pos[:, None] - k_pos[None, :]).to(q.device)
        gap = distance.abs().to(acc) if rule.alibi_distance_is_absolute else distance.to(acc)
        scores.sub_(rule.slopes.to(device=q.device, dtype=acc)[:, None, None] * gap)
    hidden = positional_hidden(q_pos, k_pos, rule, needs_causal_mask, q.device)
    if mask is not None:
        by_key = mask.index_select(-1, k_pos.to(mask.device))
        hidden = by_key if hidden is None else hidden | by_key
    if hidden is not None:
        scores.masked_fill_(hidden, float("-inf"))
    return scores


def block_forward(q, k, v, q_pos, k_pos, rule, mask=None, needs_causal_mask=True):
    """(output normalised over this block's keys, log-sum-exp of its rows), both in the accumulator dtype."""
    scores = block_scores(q, k, q_pos, k_pos, rule, mask, needs_causal_mask)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores.sub_(finite_lse(lse)[..., None]))
    if rule.dropout is not None:
        probs.mul_(rule.dropout.keep_scale(q.size(0), q_pos, k_pos, probs.dtype, probs.device))
    return torch.matmul(probs, v.to(probs.dtype)), lse


def merge_block_(out, lse, block_out, block_lse) -> None:
    """Fold one block into the running (``out``, ``lse``) of the same rows, in place."""
    merged = torch.logaddexp(lse, block_lse)
    reference = finite_lse(merged)
    out.mul_(torch.exp(lse - reference)[..., None]).add_(block_out * torch.exp(block_lse - reference)[..., None])
    lse.copy_(merged)


def block_backward(q, k, v, grad_out, lse, delta, q_pos, k_pos, rule, mask=None, needs_causal_mask=True):
    """(dq, dk, dv) of one block, given the final ``lse`` and ``delta = rowsum(grad_out * out)`` of its rows."""
    scores = block_scores(q, k, q_pos, k_pos, rule, mask, needs_causal_mask)
    probs = torch.exp(scores.sub_(finite_lse(lse)[..., None]))
    acc = probs.dtype
    grad_out = grad_out.to(acc)
    grad_probs = torch.matmul(grad_out, v.to(acc).transpose(-1, -2))
    if rule.dropout is None:
        grad_v = torch.matmul(probs.transpose(-1, -2), grad_out)
    else:
        keep = rule.dropout.keep_scale(q.size(0), q_pos, k_pos, acc, probs.device)
        grad_v = torch.matmul((probs * keep).transpose(-1, -2), grad_out)
        grad_probs.mul_(keep)
    grad_scores = probs.mul_(grad_probs.sub_(delta[..., None]))
    grad_q = torch.matmul(grad_scores, k.to(acc)).mul_(rule.scale)
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q.to(acc)).mul_(rule.scale)
    return grad_q, grad_k, grad_v
