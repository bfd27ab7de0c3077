"""``--use-fused-rotary-pos-emb``: megatron-core's rotary embedding on ``ascendspeed.ops.rotary_embedding``.

Every unfused rotary path of megatron-core (``apply_rotary_pos_emb`` for [s, b, h, d] inputs, and per
sequence for packed ones) ends in ``rope_utils._apply_rotary_pos_emb_bshd``; wrapping that one function
covers them all. Calls the operator does not cover (multi-latent attention's de-interleaving, an
``mscale`` other than 1) run megatron-core's own code.
"""
from __future__ import annotations

import dataclasses
import functools

from ascendspeed.patching import Patch, wrap


@dataclasses.dataclass(frozen=True)
class FusedRopeSettings:
    """The fused rotary operator has no options."""


def wrap_apply_rotary_pos_emb_bshd(original):
    """megatron-core 0.15-0.18: ``(t, freqs, rotary_interleaved, multi_latent_attention, mscale)``."""
    from ascendspeed.ops.rotary import rotary_embedding

    @functools.wraps(original)
    def _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
        if multi_latent_attention or mscale != 1.0 or t.dim() != 4:
            return original(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        return rotary_embedding(t, freqs, interleaved=rotary_interleaved)

    return _apply_rotary_pos_emb_bshd


def wrap_apply_rotary_pos_emb_bshd_0_19(original):
    """megatron-core 0.19 renamed the MLA switch ``mla_rotary_interleaved`` (keeping the old one, deprecated)."""
    from ascendspeed.ops.rotary import rotary_embedding

    @functools.wraps(original)
    def _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0,
                                   multi_latent_attention=None):
        if mla_rotary_interleaved or multi_latent_attention or mscale != 1.0 or t.dim() != 4:
            return original(t, freqs, rotary_interleaved, mla_rotary_interleaved, mscale, multi_latent_attention)
        return rotary_embedding(t, freqs, interleaved=rotary_interleaved)

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
