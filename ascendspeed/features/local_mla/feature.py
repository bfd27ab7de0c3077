"""``--multi-latent-attention`` with ``--transformer-impl local``: when it is on, and what it refuses."""
from __future__ import annotations

import argparse
import dataclasses

from ascendspeed.features.base import Feature, FeatureArgumentError


@dataclasses.dataclass(frozen=True)
class LocalMlaSettings:
    """No options: every local attention takes MLA's head sizes."""


class LocalMlaFeature(Feature[LocalMlaSettings]):
    name = "local_mla"
    example_flags = ("--multi-latent-attention", "--transformer-impl", "local")
    megatron_arguments = {"multi_latent_attention": False, "transformer_impl": "local", "context_parallel_size": 1}

    def is_enabled(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, "multi_latent_attention", False)) and \
            getattr(args, "transformer_impl", "local") == "local"

    def validate(self, args: argparse.Namespace) -> None:
        if not self.is_enabled(args):
            return
        if getattr(args, "context_parallel_size", 1) > 1:
            raise FeatureArgumentError(
                f"--multi-latent-attention with --transformer-impl local cannot run with --context-parallel-size "
                f"{args.context_parallel_size}: ascendspeed's context-parallel attention takes one head size for "
                "keys and values; drop --context-parallel-size"
            )

    def settings(self, args: argparse.Namespace) -> LocalMlaSettings:
        return LocalMlaSettings()

    def patches(self, settings: LocalMlaSettings, state=None):
        from ascendspeed.features.local_mla import attention

        return attention.patches()
