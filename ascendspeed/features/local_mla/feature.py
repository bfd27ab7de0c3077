"""``--multi-latent-attention`` with ``--transformer-impl local``: when it is on. Context parallelism takes MLA's
head sizes itself (``context_parallel.megatron_attention``)."""
from __future__ import annotations

import argparse
import dataclasses

from ascendspeed.features.base import Feature


@dataclasses.dataclass(frozen=True)
class LocalMlaSettings:
    """No options: every local attention takes MLA's head sizes."""


class LocalMlaFeature(Feature[LocalMlaSettings]):
    name = "local_mla"
    example_flags = ("--multi-latent-attention", "--transformer-impl", "local")
    megatron_arguments = {"multi_latent_attention": False, "transformer_impl": "local"}

    def is_enabled(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, "multi_latent_attention", False)) and \
            getattr(args, "transformer_impl", "local") == "local"

    def settings(self, args: argparse.Namespace) -> LocalMlaSettings:
        return LocalMlaSettings()

    def patches(self, settings: LocalMlaSettings, state=None):
        from ascendspeed.features.local_mla import attention

        return attention.patches()
