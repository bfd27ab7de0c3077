"""Benchmark of the fused RMSNorm operator on the CPU (not a test).

    python bench/rms_norm.py [--json bench/results/rms_norm.json] [--reps 21] [--threads 2]

One run measures, on ``--threads`` threads (2 by default), x of a 7B model's shape [4096, 4096] (rows x
hidden) in float32 and bfloat16, forward and backward (medians of ``--reps`` rounds):

* ``ours``: ``ascendspeed.ops.rms_norm`` under autograd;
* ``eager``: the same math in eager torch ops (``rms_norm_reference``: fp32 math, rounded once);
* ``torch``: ``torch.nn.functional.rms_norm`` (what megatron-core's torch RMSNorm runs);
* the memory-bandwidth floor (bench/operator_floor.py): forward reads x and writes y (2N bytes of x),
  backward reads grad_y and x and writes grad_x (3N); the "fresh floor" adds the first touch of y and
  grad_x (3N forward, 5N backward).

Every timed phase starts from cold caches; rounds interleave the implementations; medians of the
rounds are reported. Memory: bytes saved for backward relative to the bytes of x.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

from allocator import rerun_with_warm_allocator, warm_allocator_active
from operator_floor import Phases, combine_runs, cpu_info, describe_run, describe_runs, measure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (4096, 4096)
QUICK_SHAPE = (256, 1024)  # --quick: a smoke run of the script itself
DTYPES = ["float32", "bfloat16"]
EPS = 1e-5


PHASES = Phases(forward=2, backward=3, fresh_forward=3, fresh_backward=5)


def _import():
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
    sys.path.insert(0, ROOT)
    import torch
    import torch.nn.functional as F

    from ascendspeed.ops.rms_norm import rms_norm, rms_norm_reference

    impls = {
        "ours": lambda x, w: rms_norm(x, w, EPS),
        "eager": lambda x, w: rms_norm_reference(x, w, EPS),
        "torch": lambda x, w: F.rms_norm(x, (x.size(-1),), w, EPS),
    }
    return torch, impls


def measure_dtype(torch, impls, shape, dtype, reps):
    x = torch.randn(shape, dtype=dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1])).to(dtype).requires_grad_()
    grad = torch.randn(shape, dtype=dtype)
    closures = {name: (lambda fn=fn: fn(x, w)) for name, fn in impls.items()}
    return measure(closures, [x, w], grad, PHASES, reps)


def report(result) -> str:
    lines = [
        describe_run(result),
        "",
        "Medians of the rounds, ms. floor = bytes moved (2N fwd + 3N bwd) / copy bandwidth; "
        "first touch = ms a fresh buffer of that size costs beyond writing it; fresh floor adds the first-touch zeroing of y and grad_x.",
        "",
        "| dtype | shape | copy GB/s | first touch | ours fwd | ours bwd | ours f+b | eager f+b | F.rms_norm f+b | vs eager "
        "| vs F.rms_norm | f+b / floor | same, paired rounds | f+b / fresh floor | saved/x ours, eager, F.rms_norm |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['dtype']} | {'x'.join(map(str, row['shape']))} | {row['copy_bandwidth_gbs']:.1f} | {row['first_touch_ms']:.1f} "
            f"| {row['ours']['fwd_ms']:.1f} | {row['ours']['bwd_ms']:.1f} | {row['ours']['total_ms']:.1f} "
            f"| {row['eager']['total_ms']:.1f} | {row['torch']['total_ms']:.1f} | {row['speedup_vs']['eager']:.2f}x "
            f"| {row['speedup_vs']['torch']:.2f}x | {row['ours_over_floor']:.2f} | {row['ours_over_floor_paired']:.2f} "
            f"| {row['ours_over_fresh_floor']:.2f} "
            f"| {row['ours']['saved_over_input']:.2f}, {row['eager']['saved_over_input']:.2f}, "
            f"{row['torch']['saved_over_input']:.2f} |"
        )
    lines += [
        "",
        "Best rounds (the minimum of each, the least disturbed by other jobs), ms:",
        "",
        "| dtype | copy GB/s | ours f+b | eager f+b | F.rms_norm f+b | vs eager | vs F.rms_norm | f+b / floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        best = row["best"]
        lines.append(
            f"| {row['dtype']} | {best['copy_bandwidth_gbs']:.1f} | {best['ours']:.1f} | {best['eager']:.1f} "
            f"| {best['torch']:.1f} | {best['eager'] / best['ours']:.2f}x | {best['torch'] / best['ours']:.2f}x "
            f"| {best['ours_over_floor']:.2f} |"
        )
    return "\n".join(lines + describe_runs(result["rows"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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

    torch, impls = _import()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    shape = QUICK_SHAPE if args.quick else SHAPE
    rows = combine_runs(
        [[measure_dtype(torch, impls, shape, getattr(torch, d), args.reps) for d in DTYPES] for _ in range(args.runs)]
    )
    result = {
        "benchmark": "rms_norm forward+backward",
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "kernel": torch.ops.ascendspeed._rms_norm_cpu_kernel(),
        "threads": args.threads,
        "warm_allocator": warm_allocator_active(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "note": "medians of interleaved rounds, every timed phase from cold caches",
        "seconds": time.perf_counter() - started,
        "rows": rows,
    }
    print(report(result))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
