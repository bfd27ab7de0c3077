"""megatron-core's RoPE fusion (``apply_rope_fusion``) without Transformer Engine.

``megatron.core.models.common.embeddings.rope_utils`` imports ``fused_apply_rotary_pos_emb`` and
``fused_apply_rotary_pos_emb_thd`` from Transformer Engine and sets them to None where it is absent; a
``TransformerConfig(apply_rope_fusion=True)`` then raises "apply_rope_fusion is not available. Please install
TE >= 1.4" (megatron-core 0.15-0.19), so Megatron's own attention tests with rope fusion, and any megatron-core
user who turns it on, stop on a CPU or an NPU. The stand-ins keep TE's contracts and run ascendspeed's rotary
operator (``ascendspeed.ops.rotary``: one kernel forward and one backward, torch_npu's ``npu_rotary_mul`` on an
NPU): the rotation of TE's fused kernel, computed in fp32 and rounded once.
"""
from __future__ import annotations

import torch

from ascendspeed.patching import EXISTS, replace


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
                               interleaved: bool = False) -> torch.Tensor:
    """TE's ``sbhd`` fused RoPE: ``t`` [s, b, h, d], ``freqs`` [s, 1, 1, d_rot] (the first ``d_rot`` features
    rotate); ``transpose_output_memory`` is a layout hint TE ignores too."""
    from ascendspeed.ops.rotary import rotary_embedding

    return rotary_embedding(t, freqs.detach(), interleaved=interleaved)


def thd_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The position in its sequence of every token a context-parallel rank holds of a packed (``thd``) batch.

    ``cu_seqlens`` bounds the whole sequences, split over ``cp_size`` ranks by the load-balanced layout of a
    pack (``context_parallel.layout.packed_positions_on_rank``).
    """
    from ascendspeed.features.context_parallel import layout

    cu_seqlens = cu_seqlens.to("cpu", torch.int64)
    in_pack = layout.packed_positions_on_rank(cu_seqlens, cp_rank, cp_size)
    return in_pack - cu_seqlens[layout.segment_ids(in_pack, cu_seqlens)]


def fused_apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int = 1,
                                   cp_rank: int = 0, interleaved: bool = False) -> torch.Tensor:
    """TE's packed fused RoPE: ``t`` [tokens of this rank, h, d], every sequence's positions from 0 (``freqs``
    [max_s, 1, 1, d_rot]), context-parallel ranks holding the chunks of ``thd_positions``."""
    from ascendspeed.ops.rotary import rotary_embedding

    positions = thd_positions(cu_seqlens, cp_size, cp_rank).to(freqs.device)
    if positions.numel() != t.size(0):
        raise ValueError(f"fused_apply_rotary_pos_emb_thd: t holds {t.size(0)} tokens, and cu_seqlens "
                         f"{cu_seqlens.tolist()} over {cp_size} context-parallel rank(s) gives {positions.numel()}")
    return rotary_embedding(t.unsqueeze(1), freqs.detach()[positions], interleaved=interleaved).squeeze(1)


def patches():
    return [
        replace("megatron.core.models.common.embeddings.rope_utils:fused_apply_rotary_pos_emb",
                fused_apply_rotary_pos_emb, expect=EXISTS, sweep=False,
                name="TE fallback: replace rope_utils.fused_apply_rotary_pos_emb (None without TE), "
                     "apply_rope_fusion on ascendspeed's rotary operator"),
        replace("megatron.core.models.common.embeddings.rope_utils:fused_apply_rotary_pos_emb_thd",
                fused_apply_rotary_pos_emb_thd, expect=EXISTS, sweep=False,
                name="TE fallback: replace rope_utils.fused_apply_rotary_pos_emb_thd (None without TE), "
                     "packed apply_rope_fusion on ascendspeed's rotary operator"),
    ]
