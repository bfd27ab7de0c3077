"""ALiBi: ``--position-embedding-type alibi`` gives a GPT no position embedding and a linear distance bias
in every self-attention layer (Press et al., arXiv 2108.12409), so it extrapolates to longer inputs.

Flags: Megatron-LM's ``--position-embedding-type`` gains the choice ``alibi``; ``--alibi-fused-attention``
selects the fused attention kernel over Megatron's local attention. megatron-core users call
``ascendspeed.features.enable_features(position_embedding_type="alibi")`` and build
``GPTModel(..., position_embedding_type="alibi")``. ``feature.py`` holds the flags and their validation,
``attention.py`` the patches. See ``docs/features/alibi.md``.
"""
from ascendspeed.features.alibi.attention import AlibiLayer, AlibiSettings, mark_config, settings_of
from ascendspeed.features.alibi.feature import AlibiFeature

FEATURE = AlibiFeature()

__all__ = ["FEATURE", "AlibiFeature", "AlibiLayer", "AlibiSettings", "mark_config", "settings_of"]
