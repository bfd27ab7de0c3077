"""``--use-fused-rotary-pos-emb``: megatron-core's rotary embedding on ``ascendspeed.ops.rotary_embedding``.

Every unfused rotary path of megatron-core (``apply_rotary_pos_emb`` for [s, b, h, d] inputs, per sequence
for packed ones, and multi-latent attention's decoupled RoPE) ends in ``rope_utils._apply_rotary_pos_emb_bshd``;
wrapping that one function covers them all. Multi-latent attention first de-interleaves the rotated features
(even ones, then odd ones: one gather, as Megatron does) and scales the rotation by YaRN's ``mscale``
(``(t cos + rotate_half(t) sin) * mscale`` on the rotated features only: the operator's output times
``mscale``, since the rotation is linear). The operator computes in fp32 and rounds once; Megatron's eager
code rounds ``cos * mscale`` to the input dtype first, so in bf16 the two differ by up to a rounding step.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ascendspeed.patching import Patch, wrap


@dataclasses.dataclass(frozen=True)
class FusedRopeSettings:
    """The fused rotary operator has no options."""


def fused_rotary_pos_emb_bshd(t, freqs, rotary_interleaved: bool, mla_rotary_interleaved: bool, mscale: float):
    """megatron-core's ``_apply_rotary_pos_emb_bshd`` on the fused operator ([s, b, h, d] ``t``)."""
    from ascendspeed.ops.rotary import rotary_embedding

    rotated = freqs.size(-1)
    if mla_rotary_interleaved:
        t = torch.cat((t[..., 0:rotated:2], t[..., 1:rotated:2], t[..., rotated:]), dim=-1)
    out = rotary_embedding(t, freqs, interleaved=rotary_interleaved)
    if mscale == 1.0:
        return out
    if out.size(-1) == rotated:
        return out * mscale
    return torch.cat((out[..., :rotated] * mscale, out[..., rotated:]), dim=-1)


def wrap_apply_rotary_pos_emb_bshd(original):
    """megatron-core 0.15-0.18: ``(t, freqs, rotary_interleaved, multi_latent_attention, mscale)``."""

    @functools.wraps(original)
    def _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
        if t.dim() != 4:
            return original(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        return fused_rotary_pos_emb_bshd(t, freqs, rotary_interleaved, bool(multi_latent_attention), mscale)

    return _apply_rotary_pos_emb_bshd


def wrap_apply_rotary_pos_emb_bshd_0_19(original):
    """megatron-core 0.19 renamed the MLA switch ``mla_rotary_interleaved`` (keeping the old one, deprecated)."""

    @functools.wraps(original)
    def _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0,
                                   multi_latent_attention=None):
        if t.dim() != 4:
            return original(t, freqs, rotary_interleaved, mla_rotary_interleaved, mscale, multi_latent_attention)
        if multi_latent_attention is not None:
            mla_rotary_interleaved = multi_latent_attention
        return fused_rotary_pos_emb_bshd(t, freqs, rotary_interleaved, bool(mla_rotary_interleaved), mscale)

    return _apply_rotary_pos_emb_bshd


def patches(settings: FusedRopeSettings) -> list[Patch]:
    return [
        wrap("megatron.core.models.common.embeddings.rope_utils:_apply_rotary_pos_emb_bshd",
             wrap_apply_rotary_pos_emb_bshd,
             expect="(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0)",
             megatron="<0.19", name="fused rotary embedding: every unfused RoPE path on the fused operator"),
        wrap("megatron.core.models.common.embeddings.rope_utils:_apply_rotary_pos_emb_bshd",
             wrap_apply_rotary_pos_emb_bshd_0_19,
             expect="(t, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0, "
                    "multi_latent_attention=None)",
             megatron=">=0.19", name="fused rotary embedding: every unfused RoPE path on the fused operator"),
    ]
