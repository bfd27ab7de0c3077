"""Fused core attention: megatron-core's local ``DotProductAttention`` computes softmax(QK^T s + mask) V
with torch's ``scaled_dot_product_attention`` (flash attention on CPU and CUDA, ``npu_fusion_attention``
on NPU) instead of materialising the scores, whenever that is the same function: no bias, no dropout
drawn, no sliding window or softmax offset. Megatron's ``--attention-backend`` chooses: ``auto`` (its
default), ``flash`` and ``fused`` take the fused kernel; ``unfused`` and ``local`` keep Megatron's own.
See ``docs/features/fused-attention.md``.
"""
from ascendspeed.features.fused_attention.attention import FusedAttentionSettings
from ascendspeed.features.fused_attention.feature import FusedAttentionFeature

FEATURE = FusedAttentionFeature()

__all__ = ["FEATURE", "FusedAttentionFeature", "FusedAttentionSettings"]
