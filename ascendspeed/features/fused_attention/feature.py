"""Megatron's ``--attention-backend`` on the local attention path: the flag and what it enables."""
from __future__ import annotations

import argparse

from ascendspeed.features.base import Feature
from ascendspeed.features.fused_attention.attention import FusedAttentionSettings
from ascendspeed.features.megatron_flags import FUSED_ATTENTION_BACKENDS, attention_backend_name


class FusedAttentionFeature(Feature[FusedAttentionSettings]):
    name = "fused_attention"
    example_flags = ("--attention-backend", "auto")
    megatron_arguments = {"attention_backend": "auto"}

    def is_enabled(self, args: argparse.Namespace) -> bool:
        return attention_backend_name(getattr(args, "attention_backend", "auto")) in FUSED_ATTENTION_BACKENDS

    def settings(self, args: argparse.Namespace) -> FusedAttentionSettings:
        from ascendspeed.accelerator.cpu_half_gemm import widened_dtypes

        return FusedAttentionSettings(cpu_fp32_gemm_dtypes=widened_dtypes())

    def patches(self, settings: FusedAttentionSettings, state=None):
        from ascendspeed.features.fused_attention import attention

        return attention.patches(settings)
