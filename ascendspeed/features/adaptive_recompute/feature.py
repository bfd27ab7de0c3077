"""``--adaptive-recompute-device-size MB`` / ``--adaptive-recompute-profiling-step N`` (the Ascend plugin's names)
and ``--memory-fragmentation``: when they are on and what they refuse."""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Optional

from ascendspeed.accelerator import te_fallback
from ascendspeed.features.base import Feature, FeatureArgumentError

DEFAULT_PROFILING_STEPS = 10
#: The five profiled options in turn, then no recompute again: the first step (no recompute) warms up.
MIN_PROFILING_STEPS = 6


@dataclasses.dataclass(frozen=True)
class AdaptiveRecomputeSettings:
    """``budget_mib``: the memory a rank may use (None: no planning); ``profiling_steps``: the steps that
    measure before the plan; ``expandable_segments``: ``--memory-fragmentation``."""

    budget_mib: Optional[int] = None
    profiling_steps: int = DEFAULT_PROFILING_STEPS
    expandable_segments: bool = False


class AdaptiveRecomputeFeature(Feature[AdaptiveRecomputeSettings]):
    name = "adaptive_recompute"
    example_flags = ("--adaptive-recompute-device-size", "4096")
    megatron_arguments = {
        "recompute_granularity": None,
        "recompute_method": None,
        "transformer_impl": "local",
    }

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("ascendspeed adaptive recompute")
        group.add_argument(
            "--adaptive-recompute-device-size", type=int, default=None, metavar="MB",
            help="The memory (MiB) a rank may use: the first --adaptive-recompute-profiling-step steps measure "
            "each layer's activations and recompute cost, then each layer gets no recompute, selective "
            "(the norms; core attention; core attention and MLP; each of these with the norms) or full recompute, "
            "the cheapest plan that fits.",
        )
        group.add_argument(
            "--adaptive-recompute-profiling-step", type=int, default=DEFAULT_PROFILING_STEPS, metavar="N",
            help=f"With --adaptive-recompute-device-size, the profiling steps (at least {MIN_PROFILING_STEPS}; "
            f"default {DEFAULT_PROFILING_STEPS}).",
        )
        group.add_argument(
            "--memory-fragmentation", action="store_true",
            help="On CUDA and NPU, switch the caching allocator to expandable segments before the first "
            "allocation, against fragmentation.",
        )

    def is_enabled(self, args: argparse.Namespace) -> bool:
        return getattr(args, "adaptive_recompute_device_size", None) is not None or \
            bool(getattr(args, "memory_fragmentation", False))

    def validate(self, args: argparse.Namespace) -> None:
        if getattr(args, "memory_fragmentation", False):
            _validate_memory_fragmentation()
        budget = getattr(args, "adaptive_recompute_device_size", None)
        if budget is None:
            return
        if budget <= 0:
            raise FeatureArgumentError(f"--adaptive-recompute-device-size is a memory size in MiB, got {budget}")
        steps = getattr(args, "adaptive_recompute_profiling_step", DEFAULT_PROFILING_STEPS)
        if steps < MIN_PROFILING_STEPS:
            raise FeatureArgumentError(
                f"--adaptive-recompute-profiling-step {steps} is too few: five recompute options are measured in "
                f"turn and no recompute twice, the first step warming up; use {MIN_PROFILING_STEPS} or more")
        granularity = getattr(args, "recompute_granularity", None)
        if granularity is not None:
            raise FeatureArgumentError(
                f"--adaptive-recompute-device-size chooses the recompute of every layer itself, and "
                f"--recompute-granularity {granularity} chooses it by hand: drop one of them")
        if not te_fallback.serves_local_modules(args):
            raise FeatureArgumentError(
                "--adaptive-recompute-device-size sets megatron-core's recompute per layer, which Transformer "
                "Engine's layers do not take: use --transformer-impl local")

    def settings(self, args: argparse.Namespace) -> AdaptiveRecomputeSettings:
        return AdaptiveRecomputeSettings(
            budget_mib=getattr(args, "adaptive_recompute_device_size", None),
            profiling_steps=getattr(args, "adaptive_recompute_profiling_step", DEFAULT_PROFILING_STEPS),
            expandable_segments=bool(getattr(args, "memory_fragmentation", False)),
        )

    def new_state(self, settings: AdaptiveRecomputeSettings):
        from ascendspeed.features.adaptive_recompute.controller import AdaptiveRecompute

        if settings.expandable_segments:
            _enable_expandable_segments()
        if settings.budget_mib is None:
            return None
        return AdaptiveRecompute(settings.budget_mib, settings.profiling_steps)

    def patches(self, settings: AdaptiveRecomputeSettings, state=None):
        from ascendspeed.features.adaptive_recompute import patches

        if settings.budget_mib is None:
            return ()
        return patches.patches(state if state is not None else self.new_state(settings))


def _validate_memory_fragmentation() -> None:
    from ascendspeed.accelerator import device_type
    from ascendspeed.features.adaptive_recompute.controller import device_allocator

    kind, module = device_type(), device_allocator()
    if module is None:
        raise FeatureArgumentError(
            "--memory-fragmentation sets the caching allocator of CUDA and NPU devices, and this run is on the CPU, "
            "which has none: drop the flag")
    if module.memory_allocated() > 0:
        raise FeatureArgumentError(
            f"--memory-fragmentation must take effect before the first {kind} allocation, and "
            f"{module.memory_allocated()} bytes are already allocated: pass it before anything touches the device "
            f"(or set {_allocator_variable(kind)}=expandable_segments:True in the environment)")


def _allocator_variable(kind: str) -> str:
    return "PYTORCH_NPU_ALLOC_CONF" if kind == "npu" else "PYTORCH_CUDA_ALLOC_CONF"


def _enable_expandable_segments() -> None:
    from ascendspeed.accelerator import device_type
    from ascendspeed.features.adaptive_recompute.controller import device_allocator

    kind, module = device_type(), device_allocator()
    variable = _allocator_variable(kind)
    settings = [part for part in os.environ.get(variable, "").split(",") if part and
                not part.startswith("expandable_segments")]
    os.environ[variable] = ",".join(settings + ["expandable_segments:True"])
    memory = getattr(module, "memory", None)
    setter = getattr(memory, "_set_allocator_settings", None)
    if setter is not None:
        setter("expandable_segments:True")
