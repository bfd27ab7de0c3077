"""``--moe-permute-fusion`` where Transformer Engine is missing: when it is on, what it refuses."""
from __future__ import annotations

import argparse
import dataclasses

from ascendspeed.accelerator import te_fallback
from ascendspeed.features.base import Feature, FeatureArgumentError


@dataclasses.dataclass(frozen=True)
class MoePermuteFusionSettings:
    """Nothing to choose: every fused permutation megatron-core asks for runs ascendspeed's operators."""


class MoePermuteFusionFeature(Feature[MoePermuteFusionSettings]):
    name = "moe_permute_fusion"
    example_flags = ("--num-experts", "4", "--moe-permute-fusion")
    megatron_arguments = {"moe_permute_fusion": False, "num_experts": None}

    def is_enabled(self, args: argparse.Namespace) -> bool:
        """On where the flag is and TE, whose fused permutation megatron-core would otherwise call, is not."""
        return bool(getattr(args, "moe_permute_fusion", False)) and te_fallback.needed()

    def validate(self, args: argparse.Namespace) -> None:
        if not self.is_enabled(args):
            return
        if not getattr(args, "num_experts", None):
            raise FeatureArgumentError(
                "--moe-permute-fusion fuses the token permutation of mixture-of-experts layers, and this model has "
                "none: add --num-experts N or drop --moe-permute-fusion"
            )

    def settings(self, args: argparse.Namespace) -> MoePermuteFusionSettings:
        return MoePermuteFusionSettings()

    def patches(self, settings: MoePermuteFusionSettings, state=None):
        from ascendspeed.features.moe_permute_fusion import dispatch

        return dispatch.patches()
