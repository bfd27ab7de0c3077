"""Multi-latent attention (``--multi-latent-attention``) on megatron-core's local attention.

megatron-core's ``MLASelfAttention`` builds its core attention with separate key and value head sizes
(``k_channels``: the no-position plus the decoupled-RoPE part, ``v_channels``); its local
``DotProductAttention`` takes neither, so ``--transformer-impl local --multi-latent-attention`` fails while the
model is built. This feature (on for MLA with the local spec) lets it take them. With ``--transformer-impl
transformer_engine`` where TE is absent, ``accelerator.te_fallback``'s attention takes them itself.
See ``docs/features/te-fallback.md``.
"""
from ascendspeed.features.local_mla.feature import LocalMlaFeature

FEATURE = LocalMlaFeature()

__all__ = ["FEATURE", "LocalMlaFeature"]
