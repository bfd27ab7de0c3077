"""Fused rotary embedding: ``--use-fused-rotary-pos-emb`` (with ``--position-embedding-type rope``) applies
megatron-core's rotary position embeddings with ``ascendspeed.ops.rotary_embedding``, forward and
backward. See ``docs/features/rotary-embedding.md``.
"""
from ascendspeed.features.fused_rope.feature import FusedRopeFeature
from ascendspeed.features.fused_rope.rope import FusedRopeSettings

FEATURE = FusedRopeFeature()

__all__ = ["FEATURE", "FusedRopeFeature", "FusedRopeSettings"]
