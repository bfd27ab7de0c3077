"""``--use-fused-swiglu``: its flag, its validation and its (empty) settings."""
from __future__ import annotations

import argparse
import dataclasses

from ascendspeed.features.base import Feature, FeatureArgumentError, defaults_of, refuse_unsupported
from ascendspeed.features.fused_swiglu.config import UNSUPPORTED


@dataclasses.dataclass(frozen=True)
class FusedSwigluSettings:
    """The fused operator has no options: every gated SiLU MLP uses it."""


class FusedSwigluFeature(Feature[FusedSwigluSettings]):
    name = "fused_swiglu"
    example_flags = ("--swiglu", "--use-fused-swiglu")
    megatron_arguments = {"swiglu": False, **defaults_of(UNSUPPORTED)}

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("ascendspeed fused SwiGLU")
        group.add_argument(
            "--use-fused-swiglu", action="store_true",
            help="With --swiglu, compute the MLP's SwiGLU with ascendspeed's fused operator (one pass forward, "
            "one backward, only the input saved) on both of megatron-core's paths, with or without "
            "--no-bias-swiglu-fusion.",
        )

    def is_enabled(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, "use_fused_swiglu", False))

    def validate(self, args: argparse.Namespace) -> None:
        if not self.is_enabled(args):
            return
        if not getattr(args, "swiglu", False):
            raise FeatureArgumentError(
                "--use-fused-swiglu needs --swiglu: it replaces the SwiGLU activation of gated MLPs, and without "
                "--swiglu the MLP has none. Add --swiglu or drop --use-fused-swiglu."
            )
        refuse_unsupported(args, UNSUPPORTED, "--use-fused-swiglu")

    def settings(self, args: argparse.Namespace) -> FusedSwigluSettings:
        return FusedSwigluSettings()

    def patches(self, settings: FusedSwigluSettings, state=None):
        from ascendspeed.features.fused_swiglu import mlp  # loads the C++ operator only when enabled

        return mlp.patches()
