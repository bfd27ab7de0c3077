"""Async DDP: ``--overlap-grad-reduce`` with buckets on every pipeline stage, from the first step, measured."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from ascendspeed.features.async_ddp import bucket_groups, ddp, gloo, schedules
from ascendspeed.features.async_ddp.state import AsyncDDPSettings
from ascendspeed.features.async_ddp.telemetry import GradReduceReport, Telemetry, log_on_first_data_parallel_rank
from ascendspeed.features.base import Feature, FeatureArgumentError


class AsyncDDPFeature(Feature[AsyncDDPSettings]):
    name = "async_ddp"
    example_flags = ("--overlap-grad-reduce", "--log-grad-reduce-overlap")
    megatron_arguments = {
        "overlap_grad_reduce": False,
        "use_distributed_optimizer": False,
        "ddp_bucket_size": None,
        "overlap_param_gather_with_optimizer_step": False,
        "num_distributed_optimizer_instances": 1,
    }

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("ascendspeed async DDP")
        group.add_argument(
            "--no-overlap-grad-reduce-all-stages", action="store_false", dest="overlap_grad_reduce_all_stages",
            help="With --overlap-grad-reduce, restore megatron-core's bucketing policy: one bucket on pipeline "
            "stages after the first and on virtual-pipeline chunks after the first, launched after backward "
            "(honouring --no-align-grad-reduce). By default every stage and chunk keeps its buckets and "
            "launches each one from the gradient hooks as it fills (not with "
            "--overlap-param-gather-with-optimizer-step, which needs megatron-core's policy).",
        )
        group.add_argument(
            "--log-grad-reduce-overlap", action="store_true",
            help="Time every gradient bucket collective (ready, started, completed from the collective's future) "
            "and print per-iteration communication time, exposed communication time and hidden fraction.",
        )

    def is_enabled(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, "overlap_grad_reduce", False) or getattr(args, "log_grad_reduce_overlap", False))

    def validate(self, args: argparse.Namespace) -> None:
        if not self.is_enabled(args):
            return
        bucket_size = getattr(args, "ddp_bucket_size", None)
        if bucket_size is not None and bucket_size <= 0:
            raise FeatureArgumentError(f"--ddp-bucket-size must be positive (elements), got {bucket_size}")
        if getattr(args, "overlap_grad_reduce", False) and getattr(args, "num_distributed_optimizer_instances", 1) > 1:
            raise FeatureArgumentError(
                "ascendspeed async DDP does not support --num-distributed-optimizer-instances > 1 with "
                "--overlap-grad-reduce (it needs CUDA side streams); use one instance"
            )

    def settings(self, args: argparse.Namespace) -> AsyncDDPSettings:
        all_stages = (bool(getattr(args, "overlap_grad_reduce_all_stages", True))
                      and not getattr(args, "overlap_param_gather_with_optimizer_step", False))
        return AsyncDDPSettings(all_stages=all_stages, log_overlap=bool(getattr(args, "log_grad_reduce_overlap", False)))

    def new_state(self, settings: AsyncDDPSettings) -> Optional[Telemetry]:
        """The application's collective recorder (printing a line per iteration), or None."""
        return Telemetry(log=log_on_first_data_parallel_rank) if settings.log_overlap else None

    def patches(self, settings: AsyncDDPSettings, state: Optional[Telemetry] = None):
        if settings.log_overlap and state is None:
            state = self.new_state(settings)
        bound = dataclasses.replace(settings, telemetry=state)
        found = ddp.patches(bound) + bucket_groups.patches(bound) + gloo.patches()
        if bound.all_stages or bound.telemetry is not None:
            found += schedules.patches(bound)
        return found

    def telemetry(self, state: Optional[Telemetry]) -> Optional[GradReduceReport]:
        return GradReduceReport(state) if state is not None else None
