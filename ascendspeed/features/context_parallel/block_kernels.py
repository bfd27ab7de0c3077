"""Which code computes one ring block: ascendspeed's flash kernel on the CPU, torch_npu's fused attention on
an NPU, or the blockwise torch code.

The ring (``ring.py``) works with blocks of queries against keys at absolute positions and merges them by
log-sum-exp. ``BlockwiseKernels`` is ``blockwise.py`` (every device and dtype, every rule: masks, packs,
dropout). On the CPU ``FlashBlockKernels`` runs the causal blocks without a mask or dropout (packs included,
cut at their sequences' bounds) through ``ascendspeed::alibi_flash_attention`` (ALiBi slopes, or zeros
without ALiBi), which keeps no [queries, keys] scores; on an Ascend NPU ``FusedAttentionKernels`` calls
``torch_npu.npu_fusion_attention`` for a block's forward and ``torch_npu.npu_fusion_attention_grad`` for its
backward; ``kernels_for`` makes the choice, in this one place.

torch_npu's conventions, and the conversions this module makes explicit:

* layout ``"BNSD"`` is ours ([batch, heads, tokens, head dim]), so q/k/v pass through (made contiguous);
* scores are ``(q k^T + pse) * scale``: our bias, added to already scaled scores, is passed as
  ``pse = bias / scale`` ([1, heads, queries, keys], the query dtype, ALiBi only);
* ``atten_mask`` is True where a query must not see a key, like ours (``sparse_mode`` 0: the whole mask);
* instead of a log-sum-exp the forward returns ``softmax_max`` and ``softmax_sum``, fp32 [b, heads,
  queries, 8] (each row's value repeated 8 times): ``lse = max + log(sum)``; the backward takes them back,
  and given ``max = lse`` (the final one) and ``sum = 1`` it recomputes the final probabilities, so each
  block's gradient is exact, as in ``blockwise.block_backward``.

The NPU path has not run on an NPU (none was available when it was written): its glue is tested on the CPU
against kernels that follow torch_npu's documented formula (tests/features/test_context_parallel_npu.py).
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Optional

import torch

import ascendspeed.ops.alibi_flash_attention  # noqa: F401  (registers ascendspeed::alibi_flash_attention)
from ascendspeed.features.context_parallel.blockwise import (
    ScoreRule,
    accumulator_dtype,
    block_backward,
    block_forward,
    finite_lse,
    merge_block_,
    positional_hidden,
)

#: torch_npu repeats each row's softmax max and sum this many times in the last dimension.
NPU_SOFTMAX_STATS_WIDTH = 8
#: Input dtypes torch_npu's fused attention takes; other dtypes (float64) stay on the blockwise code.
NPU_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def lse_from_softmax_stats(softmax_max: torch.Tensor, softmax_sum: torch.Tensor) -> torch.Tensor:
    """torch_npu's per-row (max, sum of exp(score - max)), [..., 8], as our log-sum-exp [...]."""
    return softmax_max[..., 0] + torch.log(softmax_sum[..., 0])


def softmax_stats_from_lse(lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our (final) log-sum-exp [...] as the (max, sum) pair torch_npu's backward takes, [..., 8] in the dtype
    of ``lse`` (fp32 for every input dtype the kernel takes): ``max = lse`` and ``sum = 1``, so that
    ``exp(score - max) / sum`` is the final probability. A row that saw no key (lse -inf) gets max 0, whose
    probabilities are 0 as its scores are all masked."""
    softmax_max = finite_lse(lse)[..., None].expand(*lse.shape, NPU_SOFTMAX_STATS_WIDTH).contiguous()
    return softmax_max, torch.ones_like(softmax_max)


def alibi_pse(q_pos, k_pos, rule: ScoreRule, dtype: torch.dtype, device) -> Optional[torch.Tensor]:
    """ALiBi as torch_npu's ``pse`` [1, heads, queries, keys]: our bias divided by the softmax scale (the
    kernel adds pse before scaling), clamped to ``dtype``'s range (far entries carry no weight anyway; keys
    after the query, positive, are hidden by the mask)."""
    if rule.slopes is None:
        return None
    acc = accumulator_dtype(dtype)
    distance = (q_pos[:, None] - k_pos[None, :]).to(device=device, dtype=acc)
    gap = distance.abs() if rule.alibi_distance_is_absolute else distance
    bias = -rule.slopes.to(device=device, dtype=acc)[:, None, None] * gap / rule.scale
    limits = torch.finfo(dtype)
    return bias.clamp(min=limits.min, max=limits.max)[None].to(dtype)


def hidden_keys(q_pos, k_pos, rule: ScoreRule, mask: Optional[torch.Tensor], needs_causal_mask: bool, batch: int,
                device):
    """torch_npu's ``atten_mask`` of a block (True = hidden): [queries, keys] (SS) or [batch or 1, heads or 1,
    queries, keys] (BNSS, B1SS, 11SS), or None when every key is visible. ``mask`` columns are absolute key
    positions."""
    hidden = positional_hidden(q_pos, k_pos, rule, needs_causal_mask, device)
    if mask is not None:
        by_key = mask.index_select(-1, k_pos.to(mask.device))
        if by_key.size(0) == 1 and by_key.size(1) > 1:
            by_key = by_key.expand(batch, *by_key.shape[1:])  # 1NSS is not among torch_npu's mask layouts
        hidden = by_key if hidden is None else by_key | hidden
    return None if hidden is None else hidden.contiguous()


def pse_and_mask(q, q_pos, k_pos, rule: ScoreRule, mask, needs_causal_mask: bool):
    """The ``pse`` and ``atten_mask`` of a block for queries ``q``. Hidden entries get pse 0: ALiBi is
    positive for keys after the query, and a mask applied by adding a finite number (as torch_npu's
    documented formula does) must not be outweighed."""
    hidden = hidden_keys(q_pos, k_pos, rule, mask, needs_causal_mask, q.size(0), q.device)
    pse = alibi_pse(q_pos, k_pos, rule, q.dtype, q.device)
    if pse is not None and hidden is not None:
        pse = torch.where(hidden, torch.zeros((), dtype=pse.dtype, device=pse.device), pse).contiguous()
    return pse, hidden


class BlockwiseKernels:
    """The blockwise torch code of ``blockwise.py`` (every device and dtype)."""

    name = "blockwise"

    @staticmethod
    def forward(q, k, v, q_pos, k_pos, rule: ScoreRule, mask=None, needs_causal_mask=True):
        return block_forward(q, k, v, q_pos, k_pos, rule, mask, needs_causal_mask)

    @staticmethod
    def backward(q, k, v, grad_out, out, lse, delta, q_pos, k_pos, rule: ScoreRule, mask=None,
                 needs_causal_mask=True):
        """``out`` (the final output rows) is not needed: ``delta = rowsum(grad_out * out)`` is."""
        return block_backward(q, k, v, grad_out, lse, delta, q_pos, k_pos, rule, mask, needs_causal_mask)


def _runs(positions: torch.Tensor, segments: Optional[torch.Tensor]) -> list[tuple[int, int, int, int]]:
    """The runs of consecutive positions of one sequence in ascending ``positions``: (first index, end index,
    first position, sequence of a pack; 0 without one)."""
    if segments is None:
        sequence = torch.zeros_like(positions)
        breaks = positions.diff() != 1
    else:
        from ascendspeed.features.context_parallel.layout import segment_ids

        sequence = segment_ids(positions, segments)
        breaks = (positions.diff() != 1) | (sequence.diff() != 0)
    bounds = [0, *(torch.nonzero(breaks).flatten() + 1).tolist(), positions.numel()]
    return [(start, end, int(positions[start]), int(sequence[start])) for start, end in zip(bounds, bounds[1:])]


def causal_sub_blocks(q_pos: torch.Tensor, k_pos: torch.Tensor, segments: Optional[torch.Tensor] = None):
    """The (query rows, key columns, q_offset) of a causal block cut where its positions jump (a rank of the
    balanced layout holds two chunks; of a pack, two chunks of every sequence) and, in a pack, where a sequence
    ends: each a run of queries against a run of keys of the same sequence that starts at or before every
    query, what the flash kernel computes (query row i at position q_offset + i, keys from 0). Rows and columns
    nobody sees are trimmed; pieces with nothing visible, and pieces of two different sequences, are left out."""
    key_runs = _runs(k_pos, segments)
    for q_start, q_end, q_first, q_sequence in _runs(q_pos, segments):
        q_last = q_first + (q_end - q_start) - 1
        for k_start, k_end, k_first, k_sequence in key_runs:
            if k_sequence != q_sequence:
                continue
            skipped_rows = max(0, k_first - q_first)  # queries before the first key see none of these keys
            visible_cols = min(k_end - k_start, q_last - k_first + 1)
            if skipped_rows < q_end - q_start and visible_cols > 0:
                yield (slice(q_start + skipped_rows, q_end), slice(k_start, k_start + visible_cols),
                       q_first + skipped_rows - k_first)


class FlashBlockKernels:
    """Causal blocks through ascendspeed's flash kernel on the CPU: ``alibi_flash_attention`` (its forward
    returns the output and the log-sum-exp the ring merges by; its backward takes the final output and
    log-sum-exp of the rows, as ``blockwise.block_backward``), with the rule's ALiBi slopes or zeros. In a pack
    each sequence's pieces are computed and the pieces between two sequences skipped. A block the kernel
    cannot express (a mask, dropout, non-causal) runs the blockwise code.

    The kernel rounds each block's output and gradients to the input dtype before they are merged in fp32 (as
    flash kernels on accelerators do); the blockwise code keeps them in fp32 until the end.
    """

    name = "alibi_flash_attention"

    @staticmethod
    def takes(q: torch.Tensor, rule: ScoreRule, mask) -> bool:
        return q.device.type == "cpu" and rule.causal and mask is None and rule.dropout is None

    @staticmethod
    def _slopes(q: torch.Tensor, rule: ScoreRule) -> torch.Tensor:
        if rule.slopes is None:
            return torch.zeros(q.size(1), dtype=torch.float32)
        return rule.slopes.to(device=q.device, dtype=torch.float32).contiguous()

    @classmethod
    def forward(cls, q, k, v, q_pos, k_pos, rule: ScoreRule, mask=None, needs_causal_mask=True):
        if not cls.takes(q, rule, mask):
            return block_forward(q, k, v, q_pos, k_pos, rule, mask, needs_causal_mask)
        acc = accumulator_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        slopes = cls._slopes(q, rule)
        for rows, cols, q_offset in causal_sub_blocks(q_pos, k_pos, rule.segments):
            block_out, block_lse = torch.ops.ascendspeed.alibi_flash_attention(
                q[:, :, rows].contiguous(), k[:, :, cols].contiguous(), v[:, :, cols].contiguous(), slopes,
                rule.scale, q_offset)
            merge_block_(out[:, :, rows], lse[:, :, rows], block_out.to(acc), block_lse)
        return out, lse

    @classmethod
    def backward(cls, q, k, v, grad_out, out, lse, delta, q_pos, k_pos, rule: ScoreRule, mask=None,
                 needs_causal_mask=True):
        if not cls.takes(q, rule, mask):
            return block_backward(q, k, v, grad_out, lse, delta, q_pos, k_pos, rule, mask, needs_causal_mask)
        acc = accumulator_dtype(q.dtype)
        grads = [torch.zeros(t.shape, dtype=acc, device=q.device) for t in (q, k, v)]
        slopes = cls._slopes(q, rule)
        for rows, cols, q_offset in causal_sub_blocks(q_pos, k_pos, rule.segments):
            block_grads = torch.ops.ascendspeed.alibi_flash_attention_backward(
                grad_out[:, :, rows].to(q.dtype).contiguous(), q[:, :, rows].contiguous(),
                k[:, :, cols].contiguous(), v[:, :, cols].contiguous(), out[:, :, rows].to(q.dtype).contiguous(),
                lse[:, :, rows].contiguous(), slopes, rule.scale, q_offset)
            for grad, index, block_grad in zip(grads, (rows, cols, cols), block_grads):
                grad[:, :, index] += block_grad
        return tuple(grads)


@dataclasses.dataclass(frozen=True)
class FusedAttentionKernels:
    """Ring blocks through torch_npu's fused attention; ``fusion_attention`` and ``fusion_attention_grad``
    have the signatures of ``torch_npu.npu_fusion_attention`` and ``torch_npu.npu_fusion_attention_grad``."""

    fusion_attention: Callable
    fusion_attention_grad: Callable
    name: str = "npu_fusion_attention"

    def forward(self, q, k, v, q_pos, k_pos, rule: ScoreRule, mask=None, needs_causal_mask=True):
        """(output normalised over this block's keys, log-sum-exp of its rows), in the accumulator dtype."""
        q, k, v = (t.contiguous() for t in (q, k, v))
        pse, hidden = pse_and_mask(q, q_pos, k_pos, rule, mask, needs_causal_mask)
        out, softmax_max, softmax_sum = self.fusion_attention(
            q, k, v, q.size(1), "BNSD", pse=pse, atten_mask=hidden, scale=rule.scale, keep_prob=1.0, sparse_mode=0,
        )[:3]
        acc = accumulator_dtype(q.dtype)
        return out.to(acc), lse_from_softmax_stats(softmax_max, softmax_sum).to(acc)

    def backward(self, q, k, v, grad_out, out, lse, delta, q_pos, k_pos, rule: ScoreRule, mask=None,
                 needs_causal_mask=True):
        """(dq, dk, dv) of one block from the final ``out`` and ``lse`` of its rows (the kernel forms
        ``delta`` itself from ``out``), in the accumulator dtype."""
        q, k, v = (t.contiguous() for t in (q, k, v))
        softmax_max, softmax_sum = softmax_stats_from_lse(lse)
        pse, hidden = pse_and_mask(q, q_pos, k_pos, rule, mask, needs_causal_mask)
        grad_q, grad_k, grad_v = self.fusion_attention_grad(
            q, k, v, grad_out.to(q.dtype).contiguous(), q.size(1), "BNSD", pse=pse, atten_mask=hidden,
            softmax_max=softmax_max, softmax_sum=softmax_sum, attention_in=out.to(q.dtype).contiguous(),
            scale_value=rule.scale, keep_prob=1.0, sparse_mode=0,
        )[:3]
        acc = accumulator_dtype(q.dtype)
        return grad_q.to(acc), grad_k.to(acc), grad_v.to(acc)


def _torch_npu_kernels() -> Optional[FusedAttentionKernels]:
    """torch_npu's fused attention kernels, or None where torch_npu does not import or lacks them."""
    try:
        torch_npu = importlib.import_module("torch_npu")
    except ImportError:
        return None
    forward = getattr(torch_npu, "npu_fusion_attention", None)
    backward = getattr(torch_npu, "npu_fusion_attention_grad", None)
    if forward is None or backward is None:
        return None
    return FusedAttentionKernels(forward, backward)


_NPU_KERNELS: Optional[FusedAttentionKernels] = None
_NPU_KERNELS_LOOKED_UP = False


def kernels_for(q: torch.Tensor, with_dropout: bool = False):
    """The block kernels for ``q``: ascendspeed's flash kernel for CPU tensors (which hands the blocks it
    cannot express to the blockwise code), torch_npu's fused attention for NPU tensors of a dtype it takes
    (when torch_npu provides it), the blockwise torch code otherwise. With attention dropout always the
    blockwise code: its masks are drawn by position (``dropout.py``), which neither kernel does (torch_npu's
    ``keep_prob`` draws by its own tiling), so they would change with the context-parallel layout and could
    not be rebuilt for a reference."""
    global _NPU_KERNELS, _NPU_KERNELS_LOOKED_UP
    if with_dropout:
        return BlockwiseKernels
    if q.device.type == "cpu":
        return FlashBlockKernels
    if q.device.type != "npu" or q.dtype not in NPU_FUSED_DTYPES:
        return BlockwiseKernels
    if not _NPU_KERNELS_LOOKED_UP:
        _NPU_KERNELS, _NPU_KERNELS_LOOKED_UP = _torch_npu_kernels(), True
    return _NPU_KERNELS if _NPU_KERNELS is not None else BlockwiseKernels
