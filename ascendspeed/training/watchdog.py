"""What each rank is doing, and a watchdog that stops the job when a rank stops making progress.

A frozen rank (SIGSTOP, a hung device, a swapped-out host) leaves the others blocked in their next
collective for the whole ``--distributed-timeout-minutes``, and then gloo's error names no rank. Here
every rank runs one heartbeat thread that writes its progress (phase, iteration, a beat counter) into the
job's own ``torch.distributed`` store (torchrun's TCPStore, or the FileStore of ``init_method=file://``)
and watches the next rank's beats (a ring: each rank reads one key, so the store's load stays linear in
the world size). When a peer's counter has not moved for ``--rank-stall-timeout-seconds`` the watcher
publishes one message naming that rank, its host and pid and the last phase it reported; every rank
prints it as its one error line and exits with status 1. A frozen peer on the same host is killed
(SIGKILL: a stopped process acts on nothing gentler) so the launcher is not left waiting for it.

Threads run while the main thread waits in a collective (torch releases the GIL there). A phase that
holds the GIL longer than the timeout would look like a stall: the default (120 s) leaves a wide margin.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional

import torch.distributed as dist

#: Run counter: keys of an earlier run in the same process group are never read by a later one.
_RUNS = itertools.count()


class Progress:
    """The phase and iteration the main thread last reported (plain attribute writes: cheap anywhere)."""

    def __init__(self):
        self.phase = "start-up"
        self.iteration = 0
        self.since = time.time()

    def report(self, phase: str, iteration: Optional[int] = None) -> None:
        self.phase = phase
        if iteration is not None:
            self.iteration = iteration
        self.since = time.time()

    def describe(self) -> str:
        return self.phase if "iteration" in self.phase else f"{self.phase} at iteration {self.iteration}"


PROGRESS = Progress()


def report(phase: str, iteration: Optional[int] = None) -> None:
    """Record what this rank does now; the heartbeat carries it to the others."""
    PROGRESS.report(phase, iteration)


def reporting(function: Callable, phase: str) -> Callable:
    """``function`` reporting ``phase`` while it runs (for hooks megatron-core's schedules call)."""

    def call(*args, **kwargs):
        report(phase)
        return function(*args, **kwargs)

    return call


def _error_line(message: str) -> str:
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None else ""
    return f"{prefix}pretrain_gpt: error: {message}\n"


class Watchdog:
    """One heartbeat thread (store traffic) and one guard thread (no store: notices a store that stopped
    answering, e.g. because the rank hosting it is frozen)."""

    def __init__(self, store, rank: int, world_size: int, timeout: float, on_abort: Callable[[], None]):
        run = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.{next(_RUNS)}"
        self.store = dist.PrefixStore(f"ascendspeed/watchdog/{run}/", store)
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.interval = max(0.05, min(timeout / 8, 5.0))
        self.on_abort = on_abort
        self.peer = (rank + 1) % world_size
        self.beats = 0
        self.peer_seen = (None, time.monotonic())  # (last beat counter, when it last changed)
        self.answered = time.monotonic()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._beat, name="ascendspeed-heartbeat", daemon=True),
                        threading.Thread(target=self._guard, name="ascendspeed-watchdog", daemon=True)]

    def start(self) -> "Watchdog":
        self._publish(done=False)
        for thread in self.threads:
            thread.start()
        return self

    def stop(self, error: Optional[BaseException] = None) -> None:
        """End the watch; the last beat says whether this rank finished or left with ``error`` (a peer
        still waiting for it then names that error). Bounded: a store that stopped answering (the job
        is going down) never holds up the exit."""
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=self.interval + 1.0)
        last = threading.Thread(target=self._last_beat, args=(error,), daemon=True)
        last.start()
        last.join(timeout=2.0)

    def _last_beat(self, error: Optional[BaseException]) -> None:
        try:
            self._publish(done=True, error=None if error is None else f"{type(error).__name__}: {error}")
        except Exception:  # noqa: BLE001 - the run is over; a store that went away does not matter now
            pass

    def peers_that_left(self) -> list[str]:
        """After a collective failed: the ranks whose last beat says they left the run with an error."""
        left = []
        for rank in range(self.world_size):
            key = f"beat/{rank}"
            try:
                beat = json.loads(self.store.get(key)) if rank != self.rank and self.store.check([key]) else None
            except Exception:  # noqa: BLE001 - the store may be gone with the job
                return left
            if beat is not None and beat["done"] and beat["error"]:
                left.append(f"rank {rank} (host {beat['host']}, pid {beat['pid']}) left the run with {beat['error']}")
        return left

    def _publish(self, done: bool, error: Optional[str] = None) -> None:
        self.beats += 1
        self.store.set(f"beat/{self.rank}", json.dumps({
            "beat": self.beats, "done": done, "error": error, "phase": PROGRESS.phase,
            "iteration": PROGRESS.iteration, "since": PROGRESS.since, "time": time.time(),
            "host": socket.gethostname(), "pid": os.getpid(),
        }))

    def _beat(self) -> None:
        while not self.stopping.wait(self.interval):
            try:
                self._publish(done=False)
                if self.store.check(["stalled"]):
                    self._abort(self.store.get("stalled").decode(), publish=False)
                self._watch_peer()
            except Exception:  # noqa: BLE001 - a store error: the guard reports the silence, if it lasts
                continue
            self.answered = time.monotonic()

    def _watch_peer(self) -> None:
        key = f"beat/{self.peer}"
        beat = json.loads(self.store.get(key)) if self.store.check([key]) else None
        count, changed = self.peer_seen
        now = time.monotonic()
        if beat is not None and beat["beat"] != count:
            self.peer_seen = (beat["beat"], now)
            return
        if now - changed < self.timeout or (beat is not None and beat["done"] and not beat["error"]):
            return
        if beat is None:
            self._abort(f"rank {self.peer} never reported progress within --rank-stall-timeout-seconds "
                        f"{self.timeout:g} of the job's start; it may have frozen or crashed before training")
        where = f"host {beat['host']}, pid {beat['pid']}"
        if beat["done"]:
            self._abort(f"rank {self.peer} ({where}) left the run {now - changed:.0f} s ago with {beat['error']} "
                        f"during {beat['phase']} at iteration {beat['iteration']}, while this rank still waits for "
                        f"it. Stopping this rank")
        silence = now - changed
        ran = max(0.0, beat["time"] - beat["since"])
        message = (f"rank {self.peer} ({where}) stopped making progress: no heartbeat for {silence:.0f} s "
                   f"(--rank-stall-timeout-seconds {self.timeout:g}); it last reported {beat['phase']} at iteration "
                   f"{beat['iteration']} ({ran:.1f} s into it). Stopping every rank")
        if beat["host"] == socket.gethostname() and beat["pid"] != os.getpid():
            try:
                os.kill(beat["pid"], signal.SIGKILL)
                message += f"; killed the frozen process {beat['pid']}"
            except OSError:
                pass
        self._abort(message + ". Find out why that rank froze (its host's memory, device, file system), then "
                              "resume from the latest checkpoint")

    def _guard(self) -> None:
        while not self.stopping.wait(self.interval):
            silent = time.monotonic() - self.answered
            if silent > self.timeout:
                self._abort(f"the job's torch.distributed store has not answered for {silent:.0f} s "
                            f"(--rank-stall-timeout-seconds {self.timeout:g}): the process that hosts it (torchrun's "
                            f"agent, or rank 0) may be frozen. Stopping this rank", publish=False)

    def _abort(self, message: str, publish: bool = True) -> None:
        """Print ``message`` as this rank's error line and exit 1 now, from this thread (the main thread
        may be blocked in a collective that will never complete)."""
        if publish:
            try:
                if not self.store.check(["stalled"]):
                    self.store.set("stalled", message)
            except Exception:  # noqa: BLE001 - exiting anyway; the other ranks' watchdogs see the silence
                pass
        try:
            self.on_abort()
        finally:
            sys.stdout.flush()
            sys.stderr.write(_error_line(message))
            sys.stderr.flush()
            os._exit(1)


def start(args: argparse.Namespace, on_abort: Callable[[], None]) -> Optional[Watchdog]:
    """The watchdog of a run (None with ``--rank-stall-timeout-seconds 0`` or a single rank)."""
    timeout = args.rank_stall_timeout_seconds
    if not timeout or dist.get_world_size() < 2:
        return None
    store = dist.distributed_c10d._get_default_store()
    return Watchdog(store, dist.get_rank(), dist.get_world_size(), timeout, on_abort).start()
