"""Benchmark of the fused RMSNorm operator on the CPU (not a test).

    python bench/rms_norm.py [--json bench/results/rms_norm.json] [--reps 21] [--threads 2]

One run measures, on ``--threads`` threads (2 by default), x of a 7B model's shape [4096, 4096] (rows x
hidden) in float32 and bfloat16, forward and backward (medians of ``--reps`` rounds):

* ``ours``: ``ascendspeed.ops.rms_norm`` under autograd;
* ``eager``: the same math in eager torch ops (``rms_norm_reference``: fp32 math, rounded once);
* ``torch``: ``torch.nn.functional.rms_norm`` (what megatron-core's torch RMSNorm runs);
* the memory-bandwidth floor of the same run: a copy of x into a preallocated buffer gives the
  bandwidth B; the floor is the bytes an ideal kernel moves / B: forward reads x and writes y (2N
  elements), backward reads grad_y and x and writes grad_x (3N). Every implementation returns fresh
  memory, which the OS zeroes when it is first touched: the "fresh floor" counts that write too
  (3N forward, 5N backward).

Each round times the copy and every implementation once, in turn, so a change of machine load hits all
of them alike; the medians of the rounds are reported. Memory: bytes saved for backward
(saved_tensors_hooks, distinct storages) relative to the bytes of x.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings

from allocator import rerun_with_warm_allocator, warm_allocator_active

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (4096, 4096)
QUICK_SHAPE = (256, 1024)  # --quick: a smoke run of the script itself
DTYPES = ["float32", "bfloat16"]
EPS = 1e-5


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


def _step(fn, x, w, grad):
    """One forward and one backward under autograd: their times in seconds."""
    x.grad = w.grad = None
    start = time.perf_counter()
    y = fn(x, w)
    middle = time.perf_counter()
    y.backward(grad)
    end = time.perf_counter()
    x.grad = w.grad = None
    return middle - start, end - middle


def saved_bytes(torch, fn, x, w) -> int:
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(x, w)
    return sum(storages.values())


def measure(torch, impls, shape, dtype, reps):
    x = torch.randn(shape, dtype=dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1])).to(dtype).requires_grad_()
    grad = torch.randn(shape, dtype=dtype)
    src = torch.randn(shape, dtype=dtype)
    dst = torch.empty_like(src)
    samples = {name: ([], []) for name in impls}
    copies = []
    for fn in impls.values():
        _step(fn, x, w, grad)  # warm up
    copies_before = {name: [] for name in impls}
    for _ in range(reps):
        for name, fn in impls.items():
            start = time.perf_counter()
            dst.copy_(src)
            copies_before[name].append(time.perf_counter() - start)
            copies.append(copies_before[name][-1])
            fwd, bwd = _step(fn, x, w, grad)
            samples[name][0].append(fwd)
            samples[name][1].append(bwd)

    n, element = x.numel(), x.element_size()
    bandwidth = 2 * n * element / statistics.median(copies)
    row = {
        "dtype": str(dtype).replace("torch.", ""),
        "shape": list(shape),
        "reps": reps,
        "copy_bandwidth_gbs": bandwidth / 1e9,
        "floor_ms": {"fwd": 1e3 * 2 * n * element / bandwidth, "bwd": 1e3 * 3 * n * element / bandwidth},
        "fresh_floor_ms": {"fwd": 1e3 * 3 * n * element / bandwidth, "bwd": 1e3 * 5 * n * element / bandwidth},
    }
    for key in ("floor_ms", "fresh_floor_ms"):
        row[key]["total"] = row[key]["fwd"] + row[key]["bwd"]
    for name, (fwd, bwd) in samples.items():
        row[name] = {
            "fwd_ms": 1e3 * statistics.median(fwd),
            "bwd_ms": 1e3 * statistics.median(bwd),
            "total_ms": 1e3 * statistics.median(f + b for f, b in zip(fwd, bwd)),
            "saved_over_x": saved_bytes(torch, impls[name], x, w) / (n * element),
        }
    # The load of a shared machine changes from second to second: each step is also compared with the
    # copy timed just before it, and the median of those per-step ratios is reported beside the ratio
    # of the medians.
    floor_elements = row["floor_ms"]["total"] * 1e-3 * bandwidth / element
    fwd, bwd = samples["ours"]
    row["ours_over_floor_paired"] = statistics.median(
        (f + b) / (floor_elements * copy / (2 * n)) for f, b, copy in zip(fwd, bwd, copies_before["ours"])
    )
    # The least disturbed round of each: on a machine shared with other jobs the minimum estimates
    # the unloaded time best, reported beside the medians.
    best_bandwidth = 2 * n * element / min(copies)
    row["best"] = {
        "copy_bandwidth_gbs": best_bandwidth / 1e9,
        **{impl: 1e3 * min(f + b for f, b in zip(*samples[impl])) for impl in impls},
    }
    row["best"]["ours_over_floor"] = row["best"]["ours"] * 1e-3 / (floor_elements * element / best_bandwidth)
    ours = row["ours"]["total_ms"]
    row["speedup_vs_eager"] = row["eager"]["total_ms"] / ours
    row["speedup_vs_torch"] = row["torch"]["total_ms"] / ours
    row["ours_over_floor"] = ours / row["floor_ms"]["total"]
    row["ours_over_fresh_floor"] = ours / row["fresh_floor_ms"]["total"]
    return row


def cpu_info() -> dict:
    info = {"model": platform.processor() or "unknown", "flags": [], "cores": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    info["model"] = value.strip()
                elif key.strip() == "flags":
                    info["flags"] = value.split()
                    break
    except OSError:
        pass
    return info


def report(result) -> str:
    lines = [
        f"CPU: {result['cpu']['model']} ({result['cpu']['cores']} cores, shared with other work); "
        f"torch {result['torch']}; kernels: {result['kernel']}; {result['threads']} threads; "
        f"1-minute load average {result['load_before']:.1f} before, {result['load_after']:.1f} after"
        + ("; warm allocator (freed memory reused)" if result["warm_allocator"] else "; glibc's default allocator"),
        "",
        "Medians of the rounds, ms. floor = bytes moved (2N fwd + 3N bwd) / copy bandwidth; "
        "fresh floor adds the first-touch zeroing of y and grad_x.",
        "",
        "| dtype | shape | copy GB/s | ours fwd | ours bwd | ours f+b | eager f+b | F.rms_norm f+b | vs eager "
        "| vs F.rms_norm | f+b / floor | same, paired rounds | f+b / fresh floor | saved/x ours, eager, F.rms_norm |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['dtype']} | {'x'.join(map(str, row['shape']))} | {row['copy_bandwidth_gbs']:.1f} "
            f"| {row['ours']['fwd_ms']:.1f} | {row['ours']['bwd_ms']:.1f} | {row['ours']['total_ms']:.1f} "
            f"| {row['eager']['total_ms']:.1f} | {row['torch']['total_ms']:.1f} | {row['speedup_vs_eager']:.2f}x "
            f"| {row['speedup_vs_torch']:.2f}x | {row['ours_over_floor']:.2f} | {row['ours_over_floor_paired']:.2f} "
            f"| {row['ours_over_fresh_floor']:.2f} "
            f"| {row['ours']['saved_over_x']:.2f}, {row['eager']['saved_over_x']:.2f}, "
            f"{row['torch']['saved_over_x']:.2f} |"
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
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=21, help="timed rounds per dtype")
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
    rows = [measure(torch, impls, QUICK_SHAPE if args.quick else SHAPE, getattr(torch, d), args.reps) for d in DTYPES]
    result = {
        "benchmark": "rms_norm forward+backward",
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "kernel": torch.ops.ascendspeed._rms_norm_cpu_kernel(),
        "threads": args.threads,
        "warm_allocator": warm_allocator_active(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "note": "medians of interleaved rounds on a machine shared with other jobs",
        "seconds": time.perf_counter() - started,
        "rows": rows,
    }
    print(report(result))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
