"""``--reuse-fp32-param``: its flag, its validation and the patches on megatron-core's bf16 optimizers."""
from __future__ import annotations

import argparse
import dataclasses

from ascendspeed.features.base import Feature, FeatureArgumentError


@dataclasses.dataclass(frozen=True)
class ReuseFp32ParamSettings:
    """What the patches need: which of megatron-core's optimizers get the shared layout."""

    distributed_optimizer: bool


#: Megatron-LM settings the shared layout cannot honour: (dest, flag, default, why).
_UNSUPPORTED = (
    ("fp16", "--fp16", False, "fp16 weights are not the upper half of fp32 ones; use --bf16"),
    ("overlap_param_gather", "--overlap-param-gather", False,
     "between the step and the deferred all-gather the other ranks' part of the parameter buffer holds "
     "the laid-out fp32 main weights"),
    ("use_precision_aware_optimizer", "--use-precision-aware-optimizer", False,
     "Transformer Engine's FusedAdam then keeps the main weights (see its --store-param-remainders)"),
    ("fp8", "--fp8-format", None, "fp8 parameters have no bf16 upper half"),
    ("fp8_param_gather", "--fp8-param-gather", False, "fp8 parameters have no bf16 upper half"),
    ("use_megatron_fsdp", "--use-megatron-fsdp", False, "Megatron FSDP keeps its own main weights"),
    ("use_torch_fsdp2", "--use-torch-fsdp2", False, "FSDP2 keeps its own main weights"),
    ("optimizer_cpu_offload", "--optimizer-cpu-offload", False, "offloaded main weights live on the host"),
    ("num_distributed_optimizer_instances", "--num-distributed-optimizer-instances", 1,
     "the layout assumes one distributed-optimizer instance"),
    ("log_params_norm", "--log-params-norm", False,
     "it reads the main weights between steps, when they are stored as bf16 weights + remainders"),
)


class ReuseFp32ParamFeature(Feature[ReuseFp32ParamSettings]):
    name = "reuse_fp32_param"
    example_flags = ("--bf16", "--reuse-fp32-param", "--use-distributed-optimizer")
    megatron_arguments = {
        "bf16": False,
        "optimizer": "adam",
        "use_distributed_optimizer": False,
        "data_parallel_size": None,
        **{dest: default for dest, _, default, _ in _UNSUPPORTED},
    }

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("ascendspeed parameter-copy reuse")
        group.add_argument(
            "--reuse-fp32-param", action="store_true",
            help="With --bf16, keep each fp32 main weight in the memory of its bf16 weight plus a 16-bit "
            "remainder instead of a separate fp32 copy: 2 bytes per parameter less (2/DP with "
            "--use-distributed-optimizer), bit-identical training.",
        )

    def is_enabled(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, "reuse_fp32_param", False))

    def validate(self, args: argparse.Namespace) -> None:
        if not self.is_enabled(args):
            return
        if not getattr(args, "bf16", False):
            raise FeatureArgumentError(
                "--reuse-fp32-param needs --bf16: it stores the fp32 main weight as the bf16 weight plus a "
                "remainder. Add --bf16 or drop --reuse-fp32-param."
            )
        for dest, flag, default, why in _UNSUPPORTED:
            value = getattr(args, dest, default)
            if value != default and value is not None:
                raise FeatureArgumentError(
                    f"--reuse-fp32-param cannot run with {flag} {'' if value is True else value}".rstrip()
                    + f": {why}. Drop one of the two flags."
                )
        dp = getattr(args, "data_parallel_size", None)
        if getattr(args, "use_distributed_optimizer", False) and dp is not None and dp < 2:
            raise FeatureArgumentError(
                "--reuse-fp32-param with --use-distributed-optimizer needs a data-parallel size of at least 2 "
                f"(got {dp}): the shard's fp32 main weights are laid out in the other ranks' part of the "
                "parameter buffer during the step. With one data-parallel rank drop --use-distributed-optimizer "
                "(it shards nothing) and keep --reuse-fp32-param."
            )

    def settings(self, args: argparse.Namespace) -> ReuseFp32ParamSettings:
        return ReuseFp32ParamSettings(distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)))

    def patches(self, settings: ReuseFp32ParamSettings, state=None):
        from ascendspeed.features.reuse_fp32_param import distributed_optimizer, float16_optimizer

        patches = float16_optimizer.patches()
        if settings.distributed_optimizer:
            patches += distributed_optimizer.patches()
        return patches
