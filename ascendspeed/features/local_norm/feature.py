"""``--use-fused-rmsnorm`` and ``--sequence-parallel`` with the local layer spec: flags and validation."""
from __future__ import annotations

import argparse

from ascendspeed.accelerator.te_fallback import serves_local_modules
from ascendspeed.features.base import Feature, FeatureArgumentError
from ascendspeed.features.local_norm.norm import LocalNormSettings


class LocalNormFeature(Feature[LocalNormSettings]):
    name = "local_norm"
    example_flags = ("--normalization", "RMSNorm", "--use-fused-rmsnorm")
    megatron_arguments = {
        "normalization": "LayerNorm",
        "sequence_parallel": False,
        "transformer_impl": "local",
        "apply_layernorm_1p": False,
    }

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("ascendspeed norms")
        group.add_argument(
            "--use-fused-rmsnorm", action="store_true",
            help="With --normalization RMSNorm, compute every RMSNorm of the local layer spec with ascendspeed's "
            "fused operator (npu_rms_norm on NPU). Independently of this flag, the local spec's norms support "
            "--sequence-parallel and --apply-layernorm-1p whenever ascendspeed is installed.",
        )

    def is_enabled(self, args: argparse.Namespace) -> bool:
        # Transformer Engine's TENorm is megatron-core's local norm where TE is absent (accelerator.te_fallback).
        local = serves_local_modules(args)
        needs_local_norm = getattr(args, "sequence_parallel", False) or getattr(args, "apply_layernorm_1p", False)
        return bool(getattr(args, "use_fused_rmsnorm", False) or (local and needs_local_norm))

    def validate(self, args: argparse.Namespace) -> None:
        if not getattr(args, "use_fused_rmsnorm", False):
            return
        if getattr(args, "normalization", "LayerNorm") != "RMSNorm":
            raise FeatureArgumentError(
                "--use-fused-rmsnorm needs --normalization RMSNorm (it fuses RMSNorm; this model normalises with "
                f"{getattr(args, 'normalization', 'LayerNorm')}): add --normalization RMSNorm or drop the flag"
            )
        if not serves_local_modules(args):
            raise FeatureArgumentError(
                "--use-fused-rmsnorm replaces the norms of the local layer spec; with --transformer-impl "
                f"{args.transformer_impl} and Transformer Engine installed, TE's norms run instead: use "
                "--transformer-impl local"
            )

    def settings(self, args: argparse.Namespace) -> LocalNormSettings:
        return LocalNormSettings(fused_rmsnorm=bool(getattr(args, "use_fused_rmsnorm", False)))

    def patches(self, settings: LocalNormSettings, state=None):
        from ascendspeed.features.local_norm import norm

        return norm.patches(settings)
