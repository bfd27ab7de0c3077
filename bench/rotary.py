"""Benchmark of the fused rotary-embedding operator on the CPU (not a test).

    python bench/rotary.py [--json bench/results/rotary.json] [--reps 21] [--threads 2]

One run measures, on ``--threads`` threads (2 by default), t of a 7B model's query shape
[4096, 1, 32, 128] (seq, batch, heads, head_dim) with Megatron's freqs [4096, 1, 1, 128] (fp32), t in
float32 and bfloat16, both pair layouts, forward and backward (medians of ``--reps`` rounds):

* ``ours``: ``ascendspeed.ops.rotary_embedding`` under autograd;
* ``eager``: megatron-core's unfused ``_apply_rotary_pos_emb_bshd`` (what ``apply_rotary_pos_emb`` runs
  with apply_rope_fusion off): the same math in eager torch ops;
* the memory-bandwidth floor of the same run: a copy of t into a preallocated buffer gives the
  bandwidth B; the floor is the bytes an ideal kernel moves / B: forward reads t and writes the output
  (2N elements), backward reads grad_out and writes grad_t (2N); freqs are negligible. Every
  implementation returns fresh memory, which the OS zeroes when it is first touched: the "fresh floor"
  counts that write too (3N forward, 3N backward).

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
SHAPE = (4096, 1, 32, 128)
QUICK_SHAPE = (256, 1, 4, 128)  # --quick: a smoke run of the script itself
DTYPES = ["float32", "bfloat16"]
LAYOUTS = [False, True]  # interleaved


def _import():
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
    sys.path.insert(0, ROOT)
    import torch
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from ascendspeed.ops.rotary import rotary_embedding

    impls = {
        "ours": lambda t, freqs, interleaved: rotary_embedding(t, freqs, interleaved),
        "eager": lambda t, freqs, interleaved: _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved),
    }
    return torch, impls


def megatron_freqs(torch, seq: int, dim: int, interleaved: bool):
    """The angles megatron-core's RotaryEmbedding makes (base 10000, fp32), [seq, 1, 1, dim]."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), -1)
    return emb[:, None, None, :]


def _step(fn, t, freqs, interleaved, grad):
    """One forward and one backward under autograd: their times in seconds."""
    t.grad = None
    start = time.perf_counter()
    out = fn(t, freqs, interleaved)
    middle = time.perf_counter()
    out.backward(grad)
    end = time.perf_counter()
    t.grad = None
    return middle - start, end - middle


def saved_bytes(torch, fn, t, freqs, interleaved) -> int:
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(t, freqs, interleaved)
    return sum(storages.values())


def measure(torch, impls, shape, dtype, interleaved, reps):
    t = torch.randn(shape, dtype=dtype).requires_grad_()
    freqs = megatron_freqs(torch, shape[0], shape[-1], interleaved)
    grad = torch.randn(shape, dtype=dtype)
    src = torch.randn(shape, dtype=dtype)
    dst = torch.empty_like(src)
    samples = {name: ([], []) for name in impls}
    copies = []
    for fn in impls.values():
        _step(fn, t, freqs, interleaved, grad)  # warm up
    copies_before = {name: [] for name in impls}
    for _ in range(reps):
        for name, fn in impls.items():
            start = time.perf_counter()
            dst.copy_(src)
            copies_before[name].append(time.perf_counter() - start)
            copies.append(copies_before[name][-1])
            fwd, bwd = _step(fn, t, freqs, interleaved, grad)
            samples[name][0].append(fwd)
            samples[name][1].append(bwd)

    n, element = t.numel(), t.element_size()
    bandwidth = 2 * n * element / statistics.median(copies)
    row = {
        "dtype": str(dtype).replace("torch.", ""),
        "shape": list(shape),
        "interleaved": interleaved,
        "reps": reps,
        "copy_bandwidth_gbs": bandwidth / 1e9,
        "floor_ms": {"fwd": 1e3 * 2 * n * element / bandwidth, "bwd": 1e3 * 2 * n * element / bandwidth},
        "fresh_floor_ms": {"fwd": 1e3 * 3 * n * element / bandwidth, "bwd": 1e3 * 3 * n * element / bandwidth},
    }
    for key in ("floor_ms", "fresh_floor_ms"):
        row[key]["total"] = row[key]["fwd"] + row[key]["bwd"]
    for name, (fwd, bwd) in samples.items():
        row[name] = {
            "fwd_ms": 1e3 * statistics.median(fwd),
            "bwd_ms": 1e3 * statistics.median(bwd),
            "total_ms": 1e3 * statistics.median(f + b for f, b in zip(fwd, bwd)),
            "saved_over_t": saved_bytes(torch, impls[name], t, freqs, interleaved) / (n * element),
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
        "Medians of the rounds, ms. floor = bytes moved (2N fwd + 2N bwd) / copy bandwidth; "
        "fresh floor adds the first-touch zeroing of the output and grad_t.",
        "",
        "| dtype | layout | shape | copy GB/s | ours fwd | ours bwd | ours f+b | eager f+b | vs eager "
        "| f+b / floor | same, paired rounds | f+b / fresh floor | saved/t ours, eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['dtype']} | {'interleaved' if row['interleaved'] else 'half'} "
            f"| {'x'.join(map(str, row['shape']))} | {row['copy_bandwidth_gbs']:.1f} "
            f"| {row['ours']['fwd_ms']:.1f} | {row['ours']['bwd_ms']:.1f} | {row['ours']['total_ms']:.1f} "
            f"| {row['eager']['total_ms']:.1f} | {row['speedup_vs_eager']:.2f}x "
            f"| {row['ours_over_floor']:.2f} | {row['ours_over_floor_paired']:.2f} "
            f"| {row['ours_over_fresh_floor']:.2f} "
            f"| {row['ours']['saved_over_t']:.2f}, {row['eager']['saved_over_t']:.2f} |"
        )
    lines += [
        "",
        "Best rounds (the minimum of each, the least disturbed by other jobs), ms:",
        "",
        "| dtype | layout | copy GB/s | ours f+b | eager f+b | vs eager | f+b / floor |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        best = row["best"]
        lines.append(
            f"| {row['dtype']} | {'interleaved' if row['interleaved'] else 'half'} "
            f"| {best['copy_bandwidth_gbs']:.1f} | {best['ours']:.1f} | {best['eager']:.1f} "
            f"| {best['eager'] / best['ours']:.2f}x | {best['ours_over_floor']:.2f} |"
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
    shape = QUICK_SHAPE if args.quick else SHAPE
    rows = [
        measure(torch, impls, shape, getattr(torch, d), interleaved, args.reps) for d in DTYPES for interleaved in LAYOUTS
    ]
    result = {
        "benchmark": "rotary_embedding forward+backward",
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "kernel": torch.ops.ascendspeed._rotary_embedding_cpu_kernel(),
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
