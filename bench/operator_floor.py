"""Timing a fused operator against eager baselines and the memory-bandwidth floor, and the command line
of such a benchmark (bench/rms_norm.py, bench/rotary.py).

A round times, for every implementation in turn, a copy of a tensor of the input's size into a
preallocated buffer, then the implementation's forward and its backward under autograd. Every one of
those timed phases starts with cold caches: a buffer several times the size of the last-level cache is
written just before it. The inputs of a 7B layer are about the size of a server's L3 (16.8 M elements,
32 MiB in bf16), so without this the copy and each implementation would be helped, each by a different
amount, by whatever the previous phase left in the cache; with it the floor is the DRAM bandwidth
that a training step, whose activations were written long before, actually has.

The copy gives the bandwidth B (2 bytes of traffic per byte of the tensor); the floor of a phase is the
bytes an ideal kernel moves, over B. Every implementation returns fresh memory, which the OS zeroes
when it is first touched unless the allocator keeps freed memory (--warm-allocator): the "fresh floor"
counts that zeroing as one more write of each output, and each round also measures what a fresh
buffer of the input's size really costs beyond the write (`first_touch_ms`: page faults and zeroing). Rounds interleave the implementations, so a change of machine load hits all of
them alike; medians of the rounds are reported, beside the best round and the median over rounds of the
step against the copy timed just before it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from allocator import rerun_with_warm_allocator, warm_allocator_active
from harness import cpu, last_level_cache_bytes, load_average, timed
from saved_memory import saved_bytes

# At least this much is written to push the caches out before each timed phase.
MIN_EVICTION_BYTES = 256 << 20
WARM_UP_ROUNDS = 3


class CacheEvictor:
    """Writes a buffer of 8x the last-level cache (at least MIN_EVICTION_BYTES): no earlier data stays cached."""

    def __init__(self) -> None:
        self.buffer = torch.zeros(max(MIN_EVICTION_BYTES, 8 * last_level_cache_bytes()), dtype=torch.uint8)

    def __call__(self) -> None:
        self.buffer.add_(1)


@dataclass
class Phases:
    """The bytes an ideal kernel moves, in multiples of the input's bytes N, per phase."""

    forward: int
    backward: int
    # plus the first touch of each fresh output (y in forward; grad of the input in backward)
    fresh_forward: int
    fresh_backward: int


def measure(
    impls: dict[str, Callable[[], torch.Tensor]],
    leaves: list[torch.Tensor],
    grad: torch.Tensor,
    phases: Phases,
    reps: int,
    ours: str = "ours",
) -> dict:
    """Forward+backward of each implementation (a closure over its inputs; `leaves` are the tensors that
    require grad) against the copy floor; the floor, medians, best rounds and ratios in ms."""
    evict = CacheEvictor()
    source = torch.randn_like(grad)
    target = torch.empty_like(source)

    def step(forward):
        for leaf in leaves:
            leaf.grad = None
        evict()
        out, fwd = timed(forward)
        evict()
        _, bwd = timed(out.backward, grad)
        for leaf in leaves:
            leaf.grad = None
        return fwd, bwd

    def copy():
        evict()
        return timed(target.copy_, source)[1]

    def fill(fresh: bool):
        evict()
        return timed(lambda: (torch.empty_like(source) if fresh else target).fill_(1))[1]

    samples = {name: ([], [], []) for name in impls}  # forward, backward, the copy timed before them
    first_touch = []  # a fresh buffer of the input's size filled, less the same fill of a reused one
    # The first rounds are not recorded: with --warm-allocator the heap grows to its peak in them.
    for round_ in range(-WARM_UP_ROUNDS, reps):
        touch = fill(fresh=True) - fill(fresh=False)
        timings = {name: (copy(), *step(forward)) for name, forward in impls.items()}
        if round_ < 0:
            continue
        first_touch.append(touch)
        for name, (before, fwd, bwd) in timings.items():
            samples[name][0].append(fwd)
            samples[name][1].append(bwd)
            samples[name][2].append(before)

    nbytes = grad.numel() * grad.element_size()
    copies = [seconds for _, _, before in samples.values() for seconds in before]
    bandwidth = 2 * nbytes / statistics.median(copies)
    floor_bytes = (phases.forward + phases.backward) * nbytes
    fresh_bytes = (phases.fresh_forward + phases.fresh_backward) * nbytes
    row = {
        "shape": list(grad.shape),
        "dtype": str(grad.dtype).replace("torch.", ""),
        "reps": reps,
        "copy_bandwidth_gbs": bandwidth / 1e9,
        "floor_ms": {
            "fwd": 1e3 * phases.forward * nbytes / bandwidth,
            "bwd": 1e3 * phases.backward * nbytes / bandwidth,
            "total": 1e3 * floor_bytes / bandwidth,
        },
        # What a fresh output of the input's size costs beyond writing it (page faults and the OS's zeroing;
        # about 0 with --warm-allocator): every out-of-place implementation pays it per output.
        "first_touch_ms": 1e3 * statistics.median(first_touch),
        "fresh_floor_ms": {
            "fwd": 1e3 * phases.fresh_forward * nbytes / bandwidth,
            "bwd": 1e3 * phases.fresh_backward * nbytes / bandwidth,
            "total": 1e3 * fresh_bytes / bandwidth,
        },
    }
    for name, (fwd, bwd, _) in samples.items():
        row[name] = {
            "fwd_ms": 1e3 * statistics.median(fwd),
            "bwd_ms": 1e3 * statistics.median(bwd),
            "total_ms": 1e3 * statistics.median(f + b for f, b in zip(fwd, bwd)),
            "saved_over_input": saved_bytes(impls[name]) / nbytes,
        }
    fwd, bwd, before = samples[ours]
    # copy seconds * floor_bytes / (2 nbytes) is the floor at the bandwidth of that round's copy
    row["ours_over_floor_paired"] = statistics.median(
        (f + b) / (copy * floor_bytes / (2 * nbytes)) for f, b, copy in zip(fwd, bwd, before)
    )
    best_bandwidth = 2 * nbytes / min(copies)
    row["best"] = {
        "copy_bandwidth_gbs": best_bandwidth / 1e9,
        **{name: 1e3 * min(f + b for f, b, _ in zip(*samples[name])) for name in impls},
    }
    row["best"]["ours_over_floor"] = row["best"][ours] * 1e-3 / (floor_bytes / best_bandwidth)
    total = row[ours]["total_ms"]
    row["speedup_vs"] = {name: row[name]["total_ms"] / total for name in impls if name != ours}
    row["ours_over_floor"] = total / row["floor_ms"]["total"]
    row["ours_over_fresh_floor"] = total / row["fresh_floor_ms"]["total"]
    return row


def combine_runs(runs: list[list[dict]]) -> list[dict]:
    """Rows of several whole runs (same cells, same order) as one: per cell, the run with the median
    ratio to the floor, with the range of that ratio and of the speed-ups over all runs. The bandwidth
    this VM's host gives changes over tens of seconds, more than within one run's interleaved rounds."""
    combined = []
    for cells in zip(*runs):
        ordered = sorted(cells, key=lambda row: row["ours_over_floor"])
        row = dict(ordered[len(ordered) // 2])
        row["runs"] = len(cells)
        row["ours_over_floor_range"] = [ordered[0]["ours_over_floor"], ordered[-1]["ours_over_floor"]]
        row["speedup_range"] = {
            name: [min(cell["speedup_vs"][name] for cell in cells), max(cell["speedup_vs"][name] for cell in cells)]
            for name in row["speedup_vs"]
        }
        combined.append(row)
    return combined


def describe_runs(rows: list[dict]) -> list[str]:
    """Report lines on the spread over runs (empty for a single run)."""
    if rows[0]["runs"] == 1:
        return []
    lines = [
        "",
        f"Each row above is the median of {rows[0]['runs']} whole runs by f+b / floor; over all runs:",
        "",
        "| row | f+b / floor, min-max | " + " | ".join(f"vs {name}, min-max" for name in rows[0]["speedup_range"]) + " |",
        "|---|---|" + "---|" * len(rows[0]["speedup_range"]),
    ]
    for index, row in enumerate(rows, 1):
        low, high = row["ours_over_floor_range"]
        speedups = " | ".join(f"{a:.1f}-{b:.1f}x" for a, b in row["speedup_range"].values())
        lines.append(f"| {index} | {low:.2f}-{high:.2f} | {speedups} |")
    return lines


def cpu_info() -> dict:
    host = cpu()
    return {"model": host.model, "flags": list(host.flags), "cores": host.logical_cpus,
            "last_level_cache_bytes": last_level_cache_bytes()}


def describe_run(result: dict) -> str:
    """The first line of a report: machine, build, load and allocator."""
    cpu = result["cpu"]
    return (
        f"CPU: {cpu['model']} ({cpu['cores']} cores, shared with other work, "
        f"last-level cache {cpu['last_level_cache_bytes'] >> 20} MiB); torch {result['torch']}; "
        f"kernels: {result['kernel']}; {result['threads']} threads; 1-minute load average "
        f"{result['load_before']:.1f} before, {result['load_after']:.1f} after; "
        + ("warm allocator (freed memory reused)" if result["warm_allocator"] else "glibc's default allocator")
        + "; every timed phase from cold caches"
    )


def report(result: dict, floor: str, fresh: str, tensor: str, baselines: dict[str, str], columns=()) -> str:
    """The text of an operator benchmark's result: the medians, then the best rounds, then the spread
    over runs. ``floor``: the bytes of the floor; ``fresh``: the outputs the fresh floor adds; ``tensor``:
    the input saved bytes are relative to; ``baselines``: implementation -> label, in column order;
    ``columns``: (header, row -> text) after the dtype, such as the layout."""
    rows = result["rows"]
    keys = [("dtype", lambda row: row["dtype"]), *columns]
    names = list(baselines)

    def table(headers):
        return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]

    def cells(values):
        return "| " + " | ".join(values) + " |"

    lines = [
        describe_run(result),
        "",
        f"Medians of the rounds, ms. floor = bytes moved ({floor}) / copy bandwidth; "
        f"first touch = ms a fresh buffer of that size costs beyond writing it; fresh floor adds the first-touch "
        f"zeroing of {fresh}.",
        "",
        *table([header for header, _ in keys] + ["shape", "copy GB/s", "first touch", "ours fwd", "ours bwd", "ours f+b"]
               + [f"{baselines[name]} f+b" for name in names] + [f"vs {baselines[name]}" for name in names]
               + ["f+b / floor", "same, paired rounds", "f+b / fresh floor",
                  f"saved/{tensor} " + ", ".join(["ours", *baselines.values()])]),
    ]
    for row in rows:
        lines.append(cells(
            [key(row) for _, key in keys]
            + ["x".join(map(str, row["shape"])), f"{row['copy_bandwidth_gbs']:.1f}", f"{row['first_touch_ms']:.1f}"]
            + [f"{row['ours'][phase]:.1f}" for phase in ("fwd_ms", "bwd_ms", "total_ms")]
            + [f"{row[name]['total_ms']:.1f}" for name in names]
            + [f"{row['speedup_vs'][name]:.2f}x" for name in names]
            + [f"{row['ours_over_floor']:.2f}", f"{row['ours_over_floor_paired']:.2f}", f"{row['ours_over_fresh_floor']:.2f}",
               ", ".join(f"{row[name]['saved_over_input']:.2f}" for name in ["ours", *names])]
        ))
    lines += [
        "",
        "Best rounds (the minimum of each, the least disturbed by other jobs), ms:",
        "",
        *table([header for header, _ in keys] + ["copy GB/s", "ours f+b"] + [f"{baselines[name]} f+b" for name in names]
               + [f"vs {baselines[name]}" for name in names] + ["f+b / floor"]),
    ]
    for row in rows:
        best = row["best"]
        lines.append(cells(
            [key(row) for _, key in keys]
            + [f"{best['copy_bandwidth_gbs']:.1f}", f"{best['ours']:.1f}"]
            + [f"{best[name]:.1f}" for name in names]
            + [f"{best[name] / best['ours']:.2f}x" for name in names]
            + [f"{best['ours_over_floor']:.2f}"]
        ))
    return "\n".join(lines + describe_runs(rows))


def main(doc: str, benchmark: str, kernel: str, import_impls, measure_rows, report) -> None:
    """The command line of an operator benchmark. ``import_impls()`` gives torch and the implementations,
    ``measure_rows(torch, impls, quick, reps)`` the rows of one whole run (``quick``: a small shape),
    ``report(result)`` the text; ``kernel`` names the ``torch.ops.ascendspeed`` query of the CPU kernels."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=21, help="timed rounds per dtype")
    parser.add_argument("--runs", type=int, default=1, help="whole runs; the median run of each row is reported")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the raw results here")
    parser.add_argument("--quick", action="store_true", help="a small shape: check the script, not the kernel")
    parser.add_argument("--warm-allocator", action="store_true",
                        help="keep freed memory for reuse, as caching allocators do (see bench/allocator.py)")
    args = parser.parse_args()
    if args.warm_allocator:
        rerun_with_warm_allocator()

    torch, impls = import_impls()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load_before = load_average()
    rows = combine_runs([measure_rows(torch, impls, args.quick, args.reps) for _ in range(args.runs)])
    result = {
        "benchmark": benchmark,
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "kernel": getattr(torch.ops.ascendspeed, kernel)(),
        "threads": args.threads,
        "warm_allocator": warm_allocator_active(),
        "load_before": load_before,
        "load_after": load_average(),
        "note": "medians of interleaved rounds, every timed phase from cold caches",
        "seconds": time.perf_counter() - started,
        "rows": rows,
    }
    print(report(result))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
