"""Benchmark of the experts' weighted SwiGLU on the CPU (not a test).

    python bench/weighted_swiglu.py [--json results.json] [--reps 7] [--threads 2]

An expert's activation is ``swiglu(x) * p`` with one routing probability ``p`` per token row
(megatron-core's ``weighted_bias_swiglu_impl``). At the expert activation shapes of the MoE benches
(all local experts' rows at once, as grouped experts run it), float32 and bfloat16 inputs with float32
probabilities, forward + backward under autograd, medians of interleaved rounds:

* ``fused``: ``ascendspeed.ops.weighted_swiglu``, one pass each way (what ``--use-fused-swiglu`` runs);
* ``separate``: ``ascendspeed.ops.swiglu`` then ``* p`` and the cast back (the path before the
  weighted operator: three passes forward, four backward);
* ``megatron``: megatron-core's own ``WeightedSwiGLUFunction`` (its jit-fused composition);
* the memory-bandwidth floor: a large copy gives the bandwidth B; forward moves 3N elements of x's dtype
  (read x, write y), backward 5N (read grad_y and x, write grad_x), N = output elements.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings

from harness import load_average, machine, timed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: (name, rows = tokens x top-k, expert ffn): the grouped-experts bench's shapes (docs/features/moe.md).
SHAPES = [("Mixtral-like", 4096 * 2, 1792), ("DeepSeek-V3-like", 4096 * 8, 256), ("Qwen3-MoE-like", 4096 * 8, 192)]
QUICK_SHAPES = [("quick", 256, 64)]
DTYPES = ["float32", "bfloat16"]


def _implementations(torch):
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
    from megatron.core.fusions.fused_bias_swiglu import WeightedSwiGLUFunction

    from ascendspeed.ops.swiglu import swiglu, weighted_swiglu

    def separate(x, p):
        return (swiglu(x) * p).to(x.dtype)

    return {
        "fused": weighted_swiglu,
        "separate": separate,
        "megatron": lambda x, p: WeightedSwiGLUFunction.apply(x, p, False),
    }


def _step(fn, x, p, grad):
    x.grad = p.grad = None
    y, forward = timed(fn, x, p)
    _, backward = timed(y.backward, grad)
    return forward, backward


def measure(torch, impls, rows, ffn, dtype, reps):
    x = torch.randn(rows, 2 * ffn, dtype=dtype).requires_grad_()
    p = torch.rand(rows, 1).requires_grad_()
    grad = torch.randn(rows, ffn, dtype=dtype)
    src = torch.randn(x.numel(), dtype=dtype)
    dst = torch.empty_like(src)
    for fn in impls.values():
        _step(fn, x, p, grad)  # warm up: megatron's function compiles here
    samples = {name: [] for name in impls}
    copies = []
    for _ in range(reps):
        copies.append(timed(dst.copy_, src)[1])
        for name, fn in impls.items():
            samples[name].append(_step(fn, x, p, grad))
    n, element = grad.numel(), grad.element_size()
    bandwidth = 2 * src.numel() * element / statistics.median(copies)
    row = {"dtype": str(dtype).replace("torch.", ""), "rows": rows, "ffn": ffn, "bandwidth_gbs": bandwidth / 1e9,
           "floor_ms": 1e3 * 8 * n * element / bandwidth}
    for name, pairs in samples.items():
        row[name] = {"fwd_ms": 1e3 * statistics.median(f for f, _ in pairs),
                     "bwd_ms": 1e3 * statistics.median(b for _, b in pairs),
                     "total_ms": 1e3 * statistics.median(f + b for f, b in pairs)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="a small shape: check the script, not the speed")
    args = parser.parse_args()

    sys.path.insert(0, ROOT)
    import torch

    torch.set_num_threads(args.threads)
    impls = _implementations(torch)
    rows = []
    print(f"{'shape':18} {'dtype':9} {'fused ms':>9} {'separate':>9} {'megatron':>9} {'floor':>7} "
          f"{'sep/fused':>9} {'meg/fused':>9} {'fused/floor':>11}")
    for name, tokens, ffn in QUICK_SHAPES if args.quick else SHAPES:
        for dtype in DTYPES:
            row = measure(torch, impls, tokens, ffn, getattr(torch, dtype), args.reps)
            row["shape"] = name
            rows.append(row)
            fused = row["fused"]["total_ms"]
            print(f"{name:18} {dtype:9} {fused:9.2f} {row['separate']['total_ms']:9.2f} "
                  f"{row['megatron']['total_ms']:9.2f} {row['floor_ms']:7.2f} "
                  f"{row['separate']['total_ms'] / fused:9.2f} {row['megatron']['total_ms'] / fused:9.2f} "
                  f"{fused / row['floor_ms']:11.2f}", flush=True)
    result = {"machine": machine(torch), "load_average_end": load_average(), "reps": args.reps,
              "kernel": torch.ops.ascendspeed._swiglu_cpu_kernel(), "rows": rows}
    print(f"load average at the end: {result['load_average_end']:.2f}; {result['machine']['cpu_model']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
