"""How much of the ring's communication the block computation hid.

Each hop records when it was posted, when its send and receive completed and how long the rank was
blocked waiting for it (the exposed part). ``hidden_fraction = 1 - exposed / communication``, where
communication is the wall time during which at least one hop was in flight. Completion is seen by a
watcher thread that waits on the hop (gloo's point-to-point work has no future to call back), so it is the
moment the transfer finished, not the later moment the ring asked for it. Host clocks only: on a device
(HCCL) a hop completes at enqueue time, so the numbers there describe the host, not the link.
"""
from __future__ import annotations

import dataclasses
import threading

import torch.distributed as dist

from ascendspeed.features.base import FeatureTelemetry
from ascendspeed.features.timing import covered_seconds, print_on_rank_0, sum_over_ranks


@dataclasses.dataclass(frozen=True)
class RingOverlap:
    """Totals of one or more measurement windows; windows add up (``+``), their hops being disjoint in time."""

    hops: int = 0
    sent_bytes: int = 0
    compute_s: float = 0.0
    communication_s: float = 0.0
    exposed_s: float = 0.0

    @property
    def hidden_fraction(self) -> float:
        """The part of the time hops were in flight that the rank did not spend waiting for them."""
        if self.communication_s <= 0:
            return 0.0
        return max(0.0, 1.0 - self.exposed_s / self.communication_s)

    def __add__(self, other: "RingOverlap") -> "RingOverlap":
        return RingOverlap(*(getattr(self, field.name) + getattr(other, field.name)
                             for field in dataclasses.fields(self)))

    def format(self) -> str:
        return (f"hops {self.hops} | sent {self.sent_bytes / 2**20:.1f} MiB | "
                f"ring comm {self.communication_s * 1e3:.2f} ms | exposed {self.exposed_s * 1e3:.2f} ms | "
                f"hidden {self.hidden_fraction * 100:.1f} %")

    def summary(self) -> dict:
        return {
            "hops": self.hops,
            "sent_MB": self.sent_bytes / 2**20,
            "compute_s": self.compute_s,
            "communication_s": self.communication_s,
            "exposed_s": self.exposed_s,
            "hidden_fraction": self.hidden_fraction,
        }


@dataclasses.dataclass
class RingTelemetry:
    """Totals since the last ``reset``: block compute, exposed waiting, hop intervals, bytes sent."""

    compute_s: float = 0.0
    exposed_s: float = 0.0
    sent_bytes: int = 0
    hops: list = dataclasses.field(default_factory=list)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def record_hop(self, start: float, end: float, exposed: float) -> None:
        with self._lock:
            self.hops.append((start, end))
            self.exposed_s += exposed

    @property
    def communication_s(self) -> float:
        return covered_seconds(self.hops)

    @property
    def hidden_fraction(self) -> float:
        return self.totals().hidden_fraction

    def totals(self) -> RingOverlap:
        with self._lock:
            return RingOverlap(len(self.hops), self.sent_bytes, self.compute_s, covered_seconds(self.hops),
                               self.exposed_s)

    def summary(self) -> dict:
        return self.totals().summary()

    def take(self) -> RingOverlap:
        """The totals of the window that ends now; a new window starts."""
        totals = self.totals()
        self.reset()
        return totals

    def reset(self) -> None:
        with self._lock:
            self.compute_s = self.exposed_s = 0.0
            self.sent_bytes = 0
            self.hops = []


class RingOverlapReport(FeatureTelemetry):
    """``--log-cp-ring-overlap`` in the pretraining entry: how much of the ring's communication the block
    computation hid, per logging interval and over the run, summed over every rank of the job.

    Only training steps count (``step_started`` drops what validation's forward passes recorded). Closing
    an interval is a collective (a sum over ranks), so every rank calls ``close_interval`` and ``close_run``.
    """

    key = "cp_ring"

    def __init__(self, telemetry: RingTelemetry):
        self.telemetry = telemetry
        self.interval = RingOverlap()
        self.total = RingOverlap()

    def step_started(self) -> None:
        self.telemetry.reset()

    def step_finished(self) -> None:
        self.interval = self.interval + self.telemetry.take()

    def close_interval(self, iteration: int) -> dict:
        """The interval's totals over all ranks, printed as one ``[cp-ring]`` line on rank 0."""
        local, self.interval = self.interval, RingOverlap()
        self.total = self.total + local
        interval = _over_ranks(local)
        print_on_rank_0(f"[cp-ring] iteration {iteration} | {interval.format()}")
        return interval.summary()

    def close_run(self) -> RingOverlap:
        """The run's totals over all ranks (the intervals not closed yet included), printed on rank 0."""
        self.total, self.interval = self.total + self.interval, RingOverlap()
        total = _over_ranks(self.total)
        world = dist.get_world_size() if dist.is_initialized() else 1
        print_on_rank_0(f"context-parallel ring over the run's training steps, all {world} ranks: {total.format()}")
        return total


def _over_ranks(overlap: RingOverlap) -> RingOverlap:
    hops, sent_bytes, compute_s, communication_s, exposed_s = sum_over_ranks(
        [overlap.hops, overlap.sent_bytes, overlap.compute_s, overlap.communication_s, overlap.exposed_s])
    return RingOverlap(int(hops), int(sent_bytes), compute_s, communication_s, exposed_s)
