"""How much of the tensor-parallel communication the chunked GEMMs hid (``--log-tp-comm-overlap``).

Every collective a chunked linear issues is recorded from the moment it is issued until it completes, and
every wait for one adds the time the rank was blocked (the exposed part). ``hidden_fraction = 1 - exposed /
communication``, where communication is the wall time during which at least one collective was in flight.
Completion comes from the collective's future where the backend gives one (gloo's all-gather and
all-reduce do, and complete it on gloo's thread), else from the end of the wait. Host clocks only: on a
device (HCCL, NCCL) a collective completes at enqueue time, so there the numbers describe the host.
"""
from __future__ import annotations

import dataclasses
import threading
import time

from ascendspeed.features.timing import OverlapReport, OverlapTotals, covered_seconds


@dataclasses.dataclass(frozen=True)
class TpCommOverlap(OverlapTotals):
    """Totals of one or more measurement windows (windows add up with ``+``)."""

    collectives: int = 0
    communicated_bytes: int = 0
    communication_s: float = 0.0
    exposed_s: float = 0.0

    def format(self) -> str:
        return (f"collectives {self.collectives} | {self.communicated_bytes / 2**20:.1f} MiB | "
                f"tp comm {self.communication_s * 1e3:.2f} ms | exposed {self.exposed_s * 1e3:.2f} ms | "
                f"hidden {self.hidden_fraction * 100:.1f} %")

    def summary(self) -> dict:
        return {
            "collectives": self.collectives,
            "communicated_MB": self.communicated_bytes / 2**20,
            "communication_s": self.communication_s,
            "exposed_s": self.exposed_s,
            "hidden_fraction": self.hidden_fraction,
        }


class TpCommRecorder:
    """The collectives of the chunked linears since the last ``take``: in-flight intervals, blocked time."""

    def __init__(self):
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._intervals = []
        self._blocked = []
        self._bytes = 0

    def issued(self, work, nbytes: int) -> list:
        """Start timing ``work``; the returned slot gets its completion time (future callback or wait)."""
        slot = [time.perf_counter(), None]
        with self._lock:
            self._intervals.append(slot)
            self._bytes += nbytes
        future = work.get_future() if hasattr(work, "get_future") else None
        if future is not None:
            try:
                future.add_done_callback(lambda _: slot.__setitem__(1, slot[1] or time.perf_counter()))
            except RuntimeError:  # a backend whose work has no future
                pass
        return slot

    def waited(self, slot: list, started: float) -> None:
        finished = time.perf_counter()
        with self._lock:
            self._blocked.append((started, finished))
            if slot[1] is None:
                slot[1] = finished

    def timeline(self) -> tuple[list, list]:
        """The window so far as ``perf_counter`` intervals: collectives in flight, waits that blocked."""
        with self._lock:
            return self._window()

    def take(self) -> TpCommOverlap:
        """The totals of the window that ends now; a new window starts."""
        with self._lock:
            in_flight, blocked = self._window()
            exposed = sum(end - start for start, end in blocked)
            totals = TpCommOverlap(len(in_flight), self._bytes, covered_seconds(in_flight), exposed)
            self._reset()
        return totals

    def _window(self) -> tuple[list, list]:
        return [(start, end) for start, end in self._intervals if end is not None], list(self._blocked)


class TpCommOverlapReport(OverlapReport):
    """``--log-tp-comm-overlap`` in the pretraining entry: the chunked linears' communication time, its
    exposed part and the hidden fraction per logging interval and over the run, summed over all ranks."""

    key = "tp_comm"
    tag = "tp-comm"
    subject = "tensor-parallel communication"

    def __init__(self, recorder: TpCommRecorder):
        super().__init__(recorder, TpCommOverlap())
