"""Benchmark of the fused rotary-embedding operator on the CPU (not a test).

    python bench/rotary.py [--json bench/results/rotary.json] [--reps 21] [--threads 2]

One run measures, on ``--threads`` threads (2 by default), t of a 7B model's query shape
[4096, 1, 32, 128] (seq, batch, heads, head_dim) with Megatron's freqs [4096, 1, 1, 128] (fp32), t in
float32 and bfloat16, both pair layouts, forward and backward (medians of ``--reps`` rounds):

* ``ours``: ``ascendspeed.ops.rotary_embedding`` under autograd;
* ``eager``: megatron-core's unfused ``_apply_rotary_pos_emb_bshd`` (what ``apply_rotary_pos_emb`` runs
  with apply_rope_fusion off): the same math in eager torch ops;
* the memory-bandwidth floor (bench/operator_floor.py): forward reads t and writes the output (2N bytes
  of t), backward reads grad_out and writes grad_t (2N); freqs are negligible. The "fresh floor" adds
  the first touch of each fresh output (3N forward, 3N backward).

Every timed phase starts from cold caches; rounds interleave the implementations; medians of the
rounds are reported. Memory: bytes saved for backward relative to the bytes of t.
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
SHAPE = (4096, 1, 32, 128)
QUICK_SHAPE = (256, 1, 4, 128)  # --quick: a smoke run of the script itself
DTYPES = ["float32", "bfloat16"]
LAYOUTS = [False, True]  # interleaved
PHASES = Phases(forward=2, backward=2, fresh_forward=3, fresh_backward=3)


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


def measure_layout(torch, impls, shape, dtype, interleaved, reps):
    t = torch.randn(shape, dtype=dtype).requires_grad_()
    freqs = megatron_freqs(torch, shape[0], shape[-1], interleaved)
    grad = torch.randn(shape, dtype=dtype)
    closures = {name: (lambda fn=fn: fn(t, freqs, interleaved)) for name, fn in impls.items()}
    return {"interleaved": interleaved, **measure(closures, [t], grad, PHASES, reps)}


def report(result) -> str:
    lines = [
        describe_run(result),
        "",
        "Medians of the rounds, ms. floor = bytes moved (2N fwd + 2N bwd) / copy bandwidth; "
        "first touch = ms a fresh buffer of that size costs beyond writing it; fresh floor adds the first-touch zeroing of the output and grad_t.",
        "",
        "| dtype | layout | shape | copy GB/s | first touch | ours fwd | ours bwd | ours f+b | eager f+b | vs eager "
        "| f+b / floor | same, paired rounds | f+b / fresh floor | saved/t ours, eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['dtype']} | {'interleaved' if row['interleaved'] else 'half'} "
            f"| {'x'.join(map(str, row['shape']))} | {row['copy_bandwidth_gbs']:.1f} | {row['first_touch_ms']:.1f} "
            f"| {row['ours']['fwd_ms']:.1f} | {row['ours']['bwd_ms']:.1f} | {row['ours']['total_ms']:.1f} "
            f"| {row['eager']['total_ms']:.1f} | {row['speedup_vs']['eager']:.2f}x "
            f"| {row['ours_over_floor']:.2f} | {row['ours_over_floor_paired']:.2f} "
            f"| {row['ours_over_fresh_floor']:.2f} "
            f"| {row['ours']['saved_over_input']:.2f}, {row['eager']['saved_over_input']:.2f} |"
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
        [
            [measure_layout(torch, impls, shape, getattr(torch, d), layout, args.reps) for d in DTYPES for layout in LAYOUTS]
            for _ in range(args.runs)
        ]
    )
    result = {
        "benchmark": "rotary_embedding forward+backward",
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "kernel": torch.ops.ascendspeed._rotary_embedding_cpu_kernel(),
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
