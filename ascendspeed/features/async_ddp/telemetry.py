"""Per-bucket timing of the data-parallel gradient collectives, and per-iteration totals.

Each bucket group records when its gradients were ready, when its collective was dispatched and when
the collective completed. Completion comes from a callback on the collective's future, so it is the
moment the communication finished, not the later moment somebody happened to ``wait()`` on it.

On CPU (gloo) the future completes in the communication thread and host clocks are exact. On
devices (HCCL, NCCL) a future completes at enqueue time and its callbacks run on a stream that waits
for the collective, so device events recorded there mark completion; they are resolved to host
seconds when the iteration closes (which synchronises, so only enable telemetry when measuring).
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable, Optional

import torch

from ascendspeed.features.base import FeatureTelemetry


def merged_intervals(intervals):
    """Union of ``(start, end)`` intervals as a sorted list of disjoint intervals."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]


def covered_time(intervals, after: float = float("-inf")) -> float:
    """Seconds covered by the union of ``intervals``, counting only the part after ``after``."""
    return sum(max(0.0, end - max(start, after)) for start, end in merged_intervals(intervals))


@dataclasses.dataclass
class BucketRecord:
    """One collective of one bucket group in one iteration (times in ``time.perf_counter`` seconds)."""

    label: str
    numel: int
    ready: float
    start: float
    end: Optional[float] = None
    kind: str = "reduce"  # "reduce", or "late" for a correction of gradients that arrived late


@dataclasses.dataclass
class IterationRecord:
    index: int
    start: float
    backward_start: Optional[float] = None  # first gradient hook of the last microbatch
    compute_end: Optional[float] = None  # first finish_grad_sync call: backward is over
    end: Optional[float] = None
    buckets: list = dataclasses.field(default_factory=list)

    @property
    def comm_time(self) -> float:
        """Wall time during which at least one gradient collective was in flight."""
        return covered_time(self._intervals())

    @property
    def exposed_time(self) -> float:
        """Communication time after backward ended, i.e. time the step waited for gradients."""
        if self.compute_end is None:
            return self.comm_time
        return covered_time(self._intervals(), after=self.compute_end)

    @property
    def hidden_fraction(self) -> float:
        comm = self.comm_time
        return 1.0 - self.exposed_time / comm if comm > 0 else 0.0

    def _intervals(self):
        return [(b.start, b.end) for b in self.buckets if b.end is not None]

    def summary(self) -> dict:
        return {
            "iteration": self.index,
            "buckets": len(self.buckets),
            "comm_s": self.comm_time,
            "exposed_s": self.exposed_time,
            "hidden_fraction": self.hidden_fraction,
        }


class _HostStamp:
    """A host timestamp (taken now unless given)."""

    __slots__ = ("value",)

    def __init__(self, value: Optional[float] = None):
        self.value = time.perf_counter() if value is None else value

    def seconds(self, reference) -> float:
        return self.value


class _DeviceStamp:
    """A device event recorded on the current stream; resolved against a reference event."""

    __slots__ = ("event",)

    def __init__(self, device_module):
        self.event = device_module.Event(enable_timing=True)
        self.event.record()

    def seconds(self, reference) -> float:
        host, event = reference
        self.event.synchronize()
        return host + event.elapsed_time(self.event) / 1000.0


class Telemetry:
    """Collects ``IterationRecord``s; ``log`` (a print-like callable) receives one line per iteration."""

    def __init__(self, log: Optional[Callable[[str], None]] = None, history: int = 1000):
        self.log = log
        self.history = collections.deque(maxlen=history)
        self._lock = threading.Lock()
        self._current: Optional[IterationRecord] = None
        self._marks = {}  # backward_start / compute_end stamps of the open iteration
        self._pending = []  # (record, stamp holder, future) awaiting resolution
        self._device_module = None
        self._reference = None
        self._count = 0

    # -- clock --------------------------------------------------------------------------------
    def use_device(self, device: torch.device) -> None:
        """Time with device events when the gradient buffers live on an accelerator."""
        if device.type != "cpu":
            self._device_module = getattr(torch, device.type, None)

    def _stamp(self):
        return _HostStamp() if self._device_module is None else _DeviceStamp(self._device_module)

    def _resolve(self, stamp) -> float:
        return stamp.seconds(self._reference)

    # -- events from the hooks ---------------------------------------------------------------------
    def begin_iteration(self) -> None:
        """Start a new iteration unless the open one has not seen any event yet."""
        current = self._current
        if current is not None and not current.buckets and not self._marks:
            return
        if current is not None:
            self.end_iteration()
        self._count += 1
        if self._device_module is not None:
            self._reference = (time.perf_counter(), _DeviceStamp(self._device_module).event)
        self._marks = {}
        self._current = IterationRecord(index=self._count, start=time.perf_counter())

    def _iteration(self) -> IterationRecord:
        if self._current is None:
            self.begin_iteration()
        return self._current

    def on_gradient(self) -> None:
        self._iteration()
        if "backward_start" not in self._marks:
            self._marks["backward_start"] = self._stamp()

    def on_compute_end(self) -> None:
        self._iteration()
        if "compute_end" not in self._marks:
            self._marks["compute_end"] = self._stamp()

    def now(self):
        return self._stamp()

    def on_dispatch(self, label: str, numel: int, ready: Optional[float], start, works, kind: str = "reduce"):
        """Record a dispatched collective; returns a token for ``on_waited``.

        ``ready`` is the host time of the group's last gradient (None: ready when dispatched), ``start``
        a stamp from ``now()`` taken before dispatch, ``works`` the collective's ``Work`` objects (empty
        when it ran synchronously and has completed already).
        """
        record = BucketRecord(label=label, numel=numel, ready=0.0, start=0.0, kind=kind)
        ready_stamp = start if ready is None or self._device_module is not None else _HostStamp(ready)
        stamps = {"ready": ready_stamp, "start": start, "end": [], "waited": None}
        futures = []
        if works:
            done = stamps["end"]

            def completed(future, done=done):
                done.append(self._stamp())

            for work in works:
                try:
                    futures.append(work.get_future().then(completed))
                except RuntimeError:  # a backend without futures for this op: fall back to wait()
                    stamps["end"] = None
                    futures = []
                    break
        else:
            stamps["end"].append(self._stamp())
        with self._lock:
            self._iteration().buckets.append(record)
            self._pending.append((record, stamps, futures))
        return stamps

    def on_waited(self, token) -> None:
        """The collective of ``token`` was waited for: the completion time of last resort."""
        if token is not None and token["waited"] is None:
            token["waited"] = self._stamp()

    def end_iteration(self) -> Optional[IterationRecord]:
        """Close the open iteration: resolve completion times, keep the record and log it."""
        record, self._current = self._current, None
        if record is None:
            return None
        with self._lock:
            pending, self._pending = self._pending, []
        for bucket, stamps, futures in pending:
            for future in futures:
                future.wait()
            bucket.ready = self._resolve(stamps["ready"])
            bucket.start = self._resolve(stamps["start"])
            ends = stamps["end"] or ([stamps["waited"]] if stamps["waited"] is not None else [])
            bucket.end = max(self._resolve(stamp) for stamp in ends) if ends else None
        marks, self._marks = self._marks, {}
        for name, stamp in marks.items():
            setattr(record, name, self._resolve(stamp))
        record.end = time.perf_counter()
        self.history.append(record)
        if self.log is not None and record.buckets:
            self.log(self.format(record))
        return record

    def format(self, record: IterationRecord) -> str:
        return (
            f"[async-ddp] iteration {record.index:6d} | buckets {len(record.buckets):3d} | "
            f"grad-reduce comm {record.comm_time * 1e3:9.2f} ms | exposed {record.exposed_time * 1e3:9.2f} ms"
            f" | hidden {record.hidden_fraction * 100:5.1f} %"
        )

    def records(self) -> list:
        return list(self.history)


def log_on_first_data_parallel_rank(line: str) -> None:
    """Print a telemetry line once per pipeline stage (data- and tensor-parallel rank 0)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            if parallel_state.get_data_parallel_rank() != 0 or parallel_state.get_tensor_model_parallel_rank() != 0:
                return
            if parallel_state.get_pipeline_model_parallel_world_size() > 1:
                line = f"{line} | pp stage {parallel_state.get_pipeline_model_parallel_rank()}"
        elif torch.distributed.get_rank() != 0:
            return
    print(line, flush=True)


class GradReduceReport(FeatureTelemetry):
    """``--log-grad-reduce-overlap`` in the pretraining entry: this rank's gradient-reduction time, exposed
    time and hidden fraction over each logging interval and the run (the recorder prints every iteration)."""

    key = "grad_reduce"

    def __init__(self, telemetry: Telemetry):
        self.telemetry = telemetry
        self.interval: list[IterationRecord] = []
        self.run: list[IterationRecord] = []
        self._last_index = None

    def step_finished(self) -> None:
        """Take the iterations the recorder closed during the step (its history is bounded)."""
        fresh = [record for record in self.telemetry.records()
                 if self._last_index is None or record.index > self._last_index]
        if fresh:
            self._last_index = fresh[-1].index
        self.interval += fresh

    def close_interval(self, iteration: int) -> dict:
        interval, self.interval = self.interval, []
        self.run += interval
        return summarize(interval)

    def close_run(self) -> dict:
        self.run, self.interval = self.run + self.interval, []
        return summarize(self.run)


def summarize(records: list) -> dict:
    """Totals of iteration records: seconds of communication and of it exposed, the part hidden."""
    comm = sum(record.comm_time for record in records)
    exposed = sum(record.exposed_time for record in records)
    return {"iterations": len(records), "comm_s": comm, "exposed_s": exposed,
            "hidden_fraction": max(0.0, 1.0 - exposed / comm) if comm > 0 else 0.0}
