"""torch's bf16 matrix multiply against fp32 on this CPU (not a test).

    python bench/bf16_gemm.py [--json FILE] [--reps 5] [--threads 2]

torch multiplies bf16 matrices with oneDNN only on CPUs with AVX-512; elsewhere (AVX2-only CPUs: AMD Zen 2/3,
Intel client cores since Alder Lake) its bf16 matmul is a scalar fallback loop, which is what every bf16 linear
layer of Megatron runs there. Times ``a @ b`` and ``a @ b.t()`` (a linear layer's forward) at a square size
and at the linear layers of the small and large peer-bench models, fp32 and bf16, medians of ``--reps``;
reports GFLOP/s and the bf16 / fp32 time ratio, and whether ascendspeed considers bf16 GEMMs fast here.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from harness import machine, timed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: (name, m, k, n): a square product and the fc1 of the peer bench's models (tokens x hidden @ hidden x 4 hidden).
SHAPES = [("square", 1024, 1024, 1024), ("small fc1", 1024, 128, 512), ("large fc1", 1024, 512, 2048)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch

    from ascendspeed.accelerator.cpu_features import has_fast_bf16_gemm

    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'shape':10} {'layout':8} {'fp32 ms':>8} {'bf16 ms':>9} {'bf16/fp32':>9} {'fp32 GF/s':>9} {'bf16 GF/s':>9}")
    for name, m, k, n in SHAPES:
        for layout in ("a @ b", "a @ b.t"):
            times = {}
            for dtype in (torch.float32, torch.bfloat16):
                a = torch.randn(m, k).to(dtype)
                b = torch.randn(k, n).to(dtype) if layout == "a @ b" else torch.randn(n, k).to(dtype)

                def product(a=a, b=b):
                    return a @ (b if layout == "a @ b" else b.t())

                product()
                times[dtype] = statistics.median(timed(product)[1] for _ in range(args.reps))
            flops = 2 * m * k * n
            row = {"shape": name, "m": m, "k": k, "n": n, "layout": layout, "fp32_ms": 1e3 * times[torch.float32],
                   "bf16_ms": 1e3 * times[torch.bfloat16],
                   "bf16_over_fp32": times[torch.bfloat16] / times[torch.float32],
                   "fp32_gflops": flops / times[torch.float32] / 1e9, "bf16_gflops": flops / times[torch.bfloat16] / 1e9}
            rows.append(row)
            print(f"{name:10} {layout:8} {row['fp32_ms']:8.2f} {row['bf16_ms']:9.2f} {row['bf16_over_fp32']:9.1f} "
                  f"{row['fp32_gflops']:9.1f} {row['bf16_gflops']:9.1f}", flush=True)
    result = {"machine": machine(torch), "fast_bf16_gemm": has_fast_bf16_gemm(), "reps": args.reps, "rows": rows}
    print(f"ascendspeed considers bf16 GEMMs fast here: {result['fast_bf16_gemm']}; {result['machine']['cpu_model']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
