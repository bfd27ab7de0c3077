"""Fused MoE token permutation without Transformer Engine: ``--moe-permute-fusion`` (Megatron's own flag) runs
megatron-core's fused dispatch branch on ascendspeed's permutation operators (``ascendspeed.ops.moe_permute``)
where TE's are missing: the CPU, an NPU, a GPU without TE. Results equal megatron-core's unfused path to the
bit. megatron-core users call ``ascendspeed.features.enable_features(num_experts=N, moe_permute_fusion=True)``.
See ``docs/features/moe-permute-fusion.md``.
"""
from ascendspeed.features.moe_permute_fusion.feature import MoePermuteFusionFeature

FEATURE = MoePermuteFusionFeature()

__all__ = ["FEATURE", "MoePermuteFusionFeature"]
