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

from ascendspeed.features.timing import OverlapReport, OverlapTotals, covered_seconds


@dataclasses.dataclass(frozen=True)
class RingOverlap(OverlapTotals):
    """Totals of one or more measurement windows; windows add up (``+``), their hops being disjoint in time."""

    hops: int = 0
    sent_bytes: int = 0
    compute_s: float = 0.0
    communication_s: float = 0.0
    exposed_s: float = 0.0

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


class RingOverlapReport(OverlapReport):
    """``--log-cp-ring-overlap`` in the pretraining entry: how much of the ring's communication the block
    computation hid, per logging interval and over the run, summed over every rank of the job; the run's
    totals are returned as a ``RingOverlap``."""

    key = "cp_ring"
    tag = "cp-ring"
    subject = "context-parallel ring"

    def __init__(self, telemetry: RingTelemetry):
        super().__init__(telemetry, RingOverlap())
        self.telemetry = telemetry

    def run_result(self, total: RingOverlap) -> RingOverlap:
        return total
