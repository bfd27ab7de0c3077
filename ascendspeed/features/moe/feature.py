"""``--num-experts``: the MoE feature's validation and (empty) settings; the flag is Megatron-LM's own."""
from __future__ import annotations

import argparse
import dataclasses

from ascendspeed.features.base import Feature


@dataclasses.dataclass(frozen=True)
class MoeSettings:
    """Nothing to choose: every expert MLP that megatron-core cannot scale by its routing probabilities is
    scaled after its second linear instead."""


class MoeFeature(Feature[MoeSettings]):
    name = "moe"
    example_flags = ("--num-experts", "4")
    megatron_arguments = {"num_experts": None}

    def is_enabled(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, "num_experts", None))

    def settings(self, args: argparse.Namespace) -> MoeSettings:
        return MoeSettings()

    def patches(self, settings: MoeSettings, state=None):
        from ascendspeed.features.moe import mlp, router

        return mlp.patches() + router.patches()
