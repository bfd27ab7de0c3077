"""What every bench script shares: the description of the machine it ran on, and the timing of phases.

A result is only comparable with the machine beside it, so every script records the same facts, read
the same way: the CPU model, its vector instruction sets (what decides which kernels run), the logical
CPUs, torch's CPU capability and thread count, and the load that other work put on the machine.
Phases are timed with the wall clock (``time.perf_counter``) and reported as medians of repetitions:
on a shared machine the median ignores the rounds another job disturbed.
"""
from __future__ import annotations

import contextlib
import functools
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")

# The /proc/cpuinfo flags of the vector instruction sets and their extensions.
VECTOR_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4")


@dataclass(frozen=True)
class Cpu:
    model: str
    flags: tuple[str, ...]
    logical_cpus: int

    @property
    def vector_flags(self) -> list[str]:
        return sorted(flag for flag in self.flags if flag.startswith(VECTOR_FLAG_PREFIXES))


@functools.lru_cache(maxsize=None)
def cpu() -> Cpu:
    """This machine's CPU, from /proc/cpuinfo where there is one (its first processor: they are alike)."""
    model, flags = platform.processor() or "unknown", ()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = tuple(value.split())
                    break
    except OSError:
        pass
    return Cpu(model=model, flags=flags, logical_cpus=os.cpu_count())


def last_level_cache_bytes() -> int:
    """The largest CPU cache this machine reports (sysfs), 0 when it reports none."""
    largest = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = os.listdir(base)
    except OSError:
        return 0
    for entry in entries:
        try:
            with open(os.path.join(base, entry, "size")) as size_file:
                text = size_file.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        if digits.isdigit():
            largest = max(largest, int(digits) * scale)
    return largest


def load_average() -> float:
    """The 1-minute load average: above the number of logical CPUs, other work competed."""
    return os.getloadavg()[0]


def finish_results(results: dict, output: str | None) -> dict:
    """Stamp the load average at the end of the run on ``results["machine"]`` and write the results as JSON to
    ``output`` (when given)."""
    import json

    results["machine"]["load_average_1min_end"] = load_average()
    if output:
        with open(output, "w") as handle:
            json.dump(results, handle, indent=1)
    return results


def machine(torch=None) -> dict:
    """The machine as the results JSON records it; with ``torch``, also its version, CPU capability and
    thread count (scripts that only launch jobs do not import torch)."""
    info = {"cpu_model": cpu().model, "cpu_vector_flags": cpu().vector_flags, "logical_cpus": cpu().logical_cpus}
    if torch is not None:
        info |= {"torch": torch.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                 "threads": torch.get_num_threads()}
    return info | {"load_average_1min": load_average(), "host_allocator": host_allocator()}


def host_allocator() -> str:
    """How the run's host memory is managed: ascendspeed's policy on CPU ranks (``keep`` freed memory, or
    glibc's ``system`` defaults; ``accelerator/cpu_allocator.py``) and any ``MALLOC_*`` settings."""
    policy = os.environ.get("ASCENDSPEED_CPU_ALLOCATOR", "keep") or "keep"
    settings = " ".join(f"{name}={value}" for name, value in sorted(os.environ.items()) if name.startswith("MALLOC_"))
    return f"{policy} {settings}".strip()


def timed(fn: Callable[..., T], *args) -> tuple[T, float]:
    """``fn(*args)`` and the wall-clock seconds it took."""
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def shuffled_block_medians(functions: dict[str, Callable[[], object]], blocks: int,
                           calls_per_block: int) -> dict[str, float]:
    """Milliseconds per call of each of ``functions``, the median over ``blocks`` blocks of ``calls_per_block``
    calls, the functions in a fresh random order per block (machine noise and cache state hit all alike)."""
    seconds = {name: [] for name in functions}
    for _ in range(blocks):
        names = list(functions)
        random.shuffle(names)
        for name in names:
            start = time.perf_counter()
            for _ in range(calls_per_block):
                functions[name]()
            seconds[name].append((time.perf_counter() - start) / calls_per_block)
    return {name: statistics.median(values) * 1e3 for name, values in seconds.items()}


class PhaseTimes:
    """Seconds of named phases over repetitions, on the wall clock unless ``clock`` is another
    (``time.process_time``: the CPU time of this process); ``medians()`` in the order first timed."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.seconds: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = self.clock()
        yield
        self.seconds.setdefault(phase, []).append(self.clock() - start)

    def medians(self) -> dict[str, float]:
        return {phase: statistics.median(seconds) for phase, seconds in self.seconds.items()}


def _gloo_rank(rank: int, world_size: int, target, args: tuple, store: str, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), ASCENDSPEED_DEVICE="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        queue.put((rank, target(rank, world_size, *args)))
    except BaseException as error:
        queue.put((rank, error))
        raise
    finally:
        dist.destroy_process_group()


def run_on_gloo_ranks(target: Callable, world_size: int, *args, scratch: str = None):
    """``target(rank, world_size, *args)`` in ``world_size`` fresh processes joined by a gloo group (one
    thread each); returns rank 0's result, or raises naming every rank that failed."""
    import tempfile

    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory(dir=scratch) as directory:
        store = os.path.join(directory, "store")
        processes = [context.Process(target=_gloo_rank, args=(rank, world_size, target, args, store, queue))
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        results = dict(queue.get(timeout=3600) for _ in processes)
        for process in processes:
            process.join()
    failures = {rank: result for rank, result in results.items() if isinstance(result, BaseException)}
    if failures:
        raise RuntimeError(f"benchmark rank(s) failed: {failures}")
    return results[0]
