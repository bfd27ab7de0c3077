"""``--use-fused-rotary-pos-emb``: its flag and validation."""
from __future__ import annotations

import argparse

from ascendspeed.features.base import Feature, FeatureArgumentError
from ascendspeed.features.fused_rope.rope import FusedRopeSettings


class FusedRopeFeature(Feature[FusedRopeSettings]):
    name = "fused_rope"
    example_flags = ("--position-embedding-type", "rope", "--use-fused-rotary-pos-emb")
    megatron_arguments = {"position_embedding_type": "learned_absolute", "apply_rope_fusion": False}

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("ascendspeed fused rotary embedding")
        group.add_argument(
            "--use-fused-rotary-pos-emb", action="store_true",
            help="With --position-embedding-type rope, apply rotary embeddings with ascendspeed's fused "
            "operator (forward and backward kernels, npu_rotary_mul on NPU) instead of megatron-core's eager ops.",
        )

    def is_enabled(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, "use_fused_rotary_pos_emb", False))

    def validate(self, args: argparse.Namespace) -> None:
        if not self.is_enabled(args):
            return
        kind = getattr(args, "position_embedding_type", "learned_absolute")
        if kind not in ("rope", "mrope"):
            raise FeatureArgumentError(
                f"--use-fused-rotary-pos-emb needs --position-embedding-type rope (this model uses {kind}, which "
                "has no rotary embedding): add --position-embedding-type rope or drop the flag"
            )
        if getattr(args, "apply_rope_fusion", False):
            raise FeatureArgumentError(
                "--use-fused-rotary-pos-emb and Megatron's rope fusion (Transformer Engine's kernel) both replace "
                "the rotary embedding: pass --no-rope-fusion"
            )

    def settings(self, args: argparse.Namespace) -> FusedRopeSettings:
        return FusedRopeSettings()

    def patches(self, settings: FusedRopeSettings, state=None):
        from ascendspeed.features.fused_rope import rope

        return rope.patches(settings)
