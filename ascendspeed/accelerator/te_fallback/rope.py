"""megatron-core's RoPE fusion (``apply_rope_fusion``) without Transformer Engine.

``megatron.core.models.common.embeddings.rope_utils`` imports ``fused_apply_rotary_pos_emb`` and
``fused_apply_rotary_pos_emb_thd`` from Transformer Engine and sets them to None where it is absent; a
``TransformerConfig(apply_rope_fusion=True)`` then raises "apply_rope_fusion is not available. Please install
TE >= 1.4" (megatron-core 0.15-0.19), so Megatron's own attention tests with rope fusion, and any megatron-core
user who turns it on, stop on a CPU or an NPU. The stand-ins keep TE's contracts and run ascendspeed's rotary
operator (``ascendspeed.ops.rotary``: one kernel forward and one backward, torch_npu's ``npu_rotary_mul`` on an
NPU): the rotation of TE's fused kernel, computed in fp32 and rounded once.

Multi-latent attention's rope fusion (YaRN, ``apply_rope_fusion`` with ``rope_type="yarn"``) calls megatron-core's
own triton kernels instead (``fusions.fused_mla_yarn_rope_apply.fused_apply_mla_rope_for_q`` / ``_kv``), which
need CUDA; off CUDA they run as the torch functions ``mla_rope_for_q`` / ``mla_rope_for_kv`` here, with the
kernels' contracts (``sbhd`` and ``thd`` with context-parallel ranks).
"""
from __future__ import annotations

import torch

from ascendspeed.accelerator.triton_guard import triton_on_cuda_only
from ascendspeed.patching import EXISTS, replace, wrap


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


def _mla_cos_sin(cos: torch.Tensor, sin: torch.Tensor, rows: int, cu_seqlens, cp_rank: int, cp_size: int):
    """The YaRN cos / sin rows ([max_s, ..., emb] caches) of every row of an MLA tensor: row ``s`` of an ``sbhd``
    tensor, or each packed token's position in its sequence (``thd_positions``), as the triton kernels index
    them."""
    cos, sin = cos.reshape(cos.size(0), -1), sin.reshape(sin.size(0), -1)
    if cu_seqlens is None:
        return cos[:rows, None, None], sin[:rows, None, None]
    positions = thd_positions(cu_seqlens, cp_size, cp_rank).to(cos.device)
    if positions.numel() != rows:
        raise ValueError(f"MLA rope fusion: the pack holds {rows} tokens on this rank, and cu_seqlens "
                         f"{cu_seqlens.tolist()} over {cp_size} context-parallel rank(s) gives {positions.numel()}")
    return cos[positions, None], sin[positions, None]


def _mla_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """MLA's decoupled RoPE: the interleaved pairs of ``x`` ([..., emb]) de-interleaved into halves and rotated,
    ``[x1 cos - x2 sin, x2 cos + x1 sin]`` (megatron-core's unfused ``mla_rotary_interleaved``); in fp32
    (float64 for float64), rounded once."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    pairs = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1).to(acc)
    half = pairs.size(-1) // 2
    turned = torch.cat([-pairs[..., half:], pairs[..., :half]], dim=-1)
    return (pairs * cos.to(acc) + turned * sin.to(acc)).to(x.dtype)


def mla_rope_for_q(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qk_head_dim: int, emb_dim: int,
                   cu_seqlens_q=None, cp_rank: int = 0, cp_size: int = 1, rotary_interleaved: bool = False):
    """``fused_apply_mla_rope_for_q``: ``t`` [s, b, heads, qk_head_dim + emb_dim] (or [t, heads, ...] with
    ``cu_seqlens_q``), its last ``emb_dim`` features rotated by the YaRN ``cos`` / ``sin`` caches."""
    if rotary_interleaved:
        raise ValueError("MLA rope fusion: rotary_interleaved is not supported (megatron-core's kernel asserts it)")
    nope, rope = t.split([qk_head_dim, emb_dim], dim=-1)
    cos, sin = _mla_cos_sin(cos, sin, t.size(0), cu_seqlens_q, cp_rank, cp_size)
    return torch.cat([nope, _mla_rotate(rope, cos, sin)], dim=-1)


def mla_rope_for_kv(kv: torch.Tensor, k_pos_emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, emb_dim: int,
                    k_dim: int, v_dim: int, cu_seqlens_kv=None, cp_rank: int = 0, cp_size: int = 1,
                    rotary_interleaved: bool = False):
    """``fused_apply_mla_rope_for_kv``: ``kv`` [s, b, heads, k_dim + v_dim] split into key and value, the
    rotated ``k_pos_emb`` ([s, b, 1, emb_dim], shared by the heads) appended to every head's key."""
    if rotary_interleaved:
        raise ValueError("MLA rope fusion: rotary_interleaved is not supported (megatron-core's kernel asserts it)")
    key, value = kv.split([k_dim, v_dim], dim=-1)
    cos, sin = _mla_cos_sin(cos, sin, kv.size(0), cu_seqlens_kv, cp_rank, cp_size)
    rope = _mla_rotate(k_pos_emb, cos, sin).expand(*key.shape[:-1], emb_dim)
    return torch.cat([key, rope], dim=-1), value.contiguous()


def patches():
    return [
        wrap("megatron.core.fusions.fused_mla_yarn_rope_apply:fused_apply_mla_rope_for_q",
             triton_on_cuda_only(mla_rope_for_q),
             expect="(t, cos, sin, qk_head_dim, emb_dim, cu_seqlens_q=None, cp_rank=0, cp_size=1, "
                    "rotary_interleaved=False)",
             name="TE fallback: wrap fused_apply_mla_rope_for_q (triton), off CUDA MLA's YaRN rope fusion in torch"),
        wrap("megatron.core.fusions.fused_mla_yarn_rope_apply:fused_apply_mla_rope_for_kv",
             triton_on_cuda_only(mla_rope_for_kv),
             expect="(kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu_seqlens_kv=None, cp_rank=0, cp_size=1, "
                    "rotary_interleaved=False)",
             name="TE fallback: wrap fused_apply_mla_rope_for_kv (triton), off CUDA MLA's YaRN rope fusion in torch"),
        replace("megatron.core.models.common.embeddings.rope_utils:fused_apply_rotary_pos_emb",
                fused_apply_rotary_pos_emb, expect=EXISTS, sweep=False,
                name="TE fallback: replace rope_utils.fused_apply_rotary_pos_emb (None without TE), "
                     "apply_rope_fusion on ascendspeed's rotary operator"),
        replace("megatron.core.models.common.embeddings.rope_utils:fused_apply_rotary_pos_emb_thd",
                fused_apply_rotary_pos_emb_thd, expect=EXISTS, sweep=False,
                name="TE fallback: replace rope_utils.fused_apply_rotary_pos_emb_thd (None without TE), "
                     "packed apply_rope_fusion on ascendspeed's rotary operator"),
    ]
