"""What the overlap telemetries of several features share: interval arithmetic, totals that add up over
windows and ranks, and the pretraining entry's report of them."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Sequence

import torch
import torch.distributed as dist

from ascendspeed.features.base import FeatureTelemetry


def covered_seconds(intervals) -> float:
    """Seconds covered by the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def sum_over_ranks(values: Sequence[float]) -> list[float]:
    """``values`` summed over every rank of the job (a collective: every rank calls it); as is without one."""
    return _reduced_over_ranks(values, dist.ReduceOp.SUM)


def max_over_ranks(values: Sequence[float], groups: Sequence = (None,)) -> list[float]:
    """The largest of each of ``values`` over every rank of the job, or over the ranks the process ``groups``
    span together (reduced over each in turn); a collective; as is without one."""
    return _reduced_over_ranks(values, dist.ReduceOp.MAX, groups)


def _reduced_over_ranks(values: Sequence[float], op, groups: Sequence = (None,)) -> list[float]:
    if not dist.is_initialized():
        return [float(value) for value in values]
    from ascendspeed.accelerator import current_device

    packed = torch.tensor([float(value) for value in values], dtype=torch.float64, device=current_device())
    for group in groups:
        dist.all_reduce(packed, op=op, group=group)
    return packed.tolist()


def print_on_rank_0(line: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


class OverlapTotals:
    """Base of the frozen dataclasses of counters and seconds (``communication_s``, ``exposed_s`` among them)
    that a feature's overlap telemetry adds up over measurement windows (``+``) and over ranks."""

    @property
    def hidden_fraction(self) -> float:
        """The part of the time communication was in flight that the rank did not spend waiting for it."""
        if self.communication_s <= 0:
            return 0.0
        return max(0.0, 1.0 - self.exposed_s / self.communication_s)

    def __add__(self, other):
        return type(self)(*(getattr(self, field.name) + getattr(other, field.name)
                            for field in dataclasses.fields(self)))

    def over_ranks(self):
        """The totals summed over every rank of the job (a collective)."""
        values = [getattr(self, field.name) for field in dataclasses.fields(self)]
        return type(self)(*(type(value)(total) for value, total in zip(values, sum_over_ranks(values))))


class OverlapReport(FeatureTelemetry):
    """A recorder's totals (its ``take()``) per training step, summed per logging interval and over the run and
    every rank, printed on rank 0 as ``[tag] iteration N | ...`` and ``<subject> over the run's training steps``.

    Only training steps count (``step_started`` drops what validation recorded). Closing an interval is a
    collective, so every rank calls ``close_interval`` and ``close_run``.
    """

    tag: ClassVar[str] = ""
    subject: ClassVar[str] = ""

    def __init__(self, recorder, empty: OverlapTotals):
        self.recorder = recorder
        self.empty = empty
        self.interval = empty
        self.total = empty

    def step_started(self) -> None:
        self.recorder.take()

    def step_finished(self) -> None:
        self.interval = self.interval + self.recorder.take()

    def close_interval(self, iteration: int) -> dict:
        local, self.interval = self.interval, self.empty
        self.total = self.total + local
        interval = local.over_ranks()
        print_on_rank_0(f"[{self.tag}] iteration {iteration} | {interval.format()}")
        return interval.summary()

    def close_run(self) -> Any:
        self.total, self.interval = self.total + self.interval, self.empty
        total = self.total.over_ranks()
        world = dist.get_world_size() if dist.is_initialized() else 1
        print_on_rank_0(f"{self.subject} over the run's training steps, all {world} ranks: {total.format()}")
        return self.run_result(total)

    def run_result(self, total: OverlapTotals) -> Any:
        return total.summary()
