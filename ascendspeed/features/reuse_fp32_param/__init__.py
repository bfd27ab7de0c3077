"""Parameter-copy reuse: ``--reuse-fp32-param`` (with ``--bf16``) stores each fp32 main weight in the
memory of its bf16 model weight plus a 16-bit remainder, for megatron-core's mixed-precision optimizer
and its distributed optimizer. megatron-core users call
``ascendspeed.features.enable_features(bf16=True, reuse_fp32_param=True)`` before building the
optimizer. See ``docs/features/reuse-fp32-param.md``.
"""
from ascendspeed.features.reuse_fp32_param.feature import ReuseFp32ParamFeature, ReuseFp32ParamSettings

FEATURE = ReuseFp32ParamFeature()

__all__ = ["FEATURE", "ReuseFp32ParamFeature", "ReuseFp32ParamSettings"]
