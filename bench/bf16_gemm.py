"""torch's bf16 matrix multiply against fp32 on this CPU, and Megatron's linear layer with its GEMMs in fp32
(not a test).

    python bench/bf16_gemm.py [--json FILE] [--reps 5] [--threads 2] [--linear-reps 3]

torch multiplies bf16 matrices with oneDNN only on CPUs with AVX-512; elsewhere (AVX2-only CPUs: AMD Zen 2/3,
Intel client cores since Alder Lake) its bf16 matmul is a scalar fallback loop, which is what every bf16 linear
layer of Megatron runs there. Times ``a @ b`` and ``a @ b.t()`` (a linear layer's forward) at a square size
and at the linear layers of the small and large peer-bench models, fp32 and bf16, medians of ``--reps``;
reports GFLOP/s and the bf16 / fp32 time ratio, and whether ascendspeed considers bf16 GEMMs fast here.

Then Megatron's linear function (``linear_with_grad_accumulation_and_async_allreduce``, forward + backward, the
fc1 shapes) in fp32, in bf16 as torch runs it, and in bf16 with ascendspeed's fp32 GEMMs
(``ascendspeed.accelerator.cpu_half_gemm``), medians of ``--linear-reps``: what a bf16 step's linear layers cost
here with and without the feature.
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
    parser.add_argument("--linear-reps", type=int, default=3)
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
    result = {"machine": machine(torch), "fast_bf16_gemm": has_fast_bf16_gemm(), "reps": args.reps, "rows": rows,
              "linear_reps": args.linear_reps, "linear_rows": linear_rows(torch, args.linear_reps)}
    print(f"ascendspeed considers bf16 GEMMs fast here: {result['fast_bf16_gemm']}; {result['machine']['cpu_model']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


def linear_rows(torch, reps: int) -> list:
    """Megatron's linear function forward + backward at the fc1 shapes: fp32, bf16 native, bf16 widened."""
    import tempfile

    with tempfile.TemporaryDirectory() as rendezvous:
        torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}/store", rank=0, world_size=1)
        try:
            import ascendspeed.megatron_adaptor  # noqa: F401  the CPU shims Megatron needs here
            from megatron.core import parallel_state
            from megatron.core.tensor_parallel import layers

            from ascendspeed.accelerator.cpu_half_gemm import wrap_in_fp32_gemm

            parallel_state.initialize_model_parallel()
            original = getattr(layers.linear_with_grad_accumulation_and_async_allreduce, "__wrapped__",
                               layers.linear_with_grad_accumulation_and_async_allreduce)
            widened = wrap_in_fp32_gemm(original, frozenset({torch.bfloat16}))
            rows = []
            print(f"\nMegatron's linear, forward + backward: {'fp32 ms':>8} {'bf16 ms':>9} {'widened ms':>10} "
                  f"{'bf16/widened':>12} {'widened/fp32':>12}")
            for name, m, k, n in SHAPES[1:]:
                times = {}
                for label, function, dtype in (("fp32", original, torch.float32), ("bf16", original, torch.bfloat16),
                                               ("widened", widened, torch.bfloat16)):
                    x = torch.randn(m, 1, k).to(dtype).requires_grad_()
                    w = (torch.randn(n, k) / k ** 0.5).to(dtype).requires_grad_()
                    grad = torch.randn(m, 1, n).to(dtype)

                    def step(function=function, x=x, w=w, grad=grad):
                        function(x, w, None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                                 sequence_parallel=False).backward(grad)

                    step()
                    times[label] = statistics.median(timed(step)[1] for _ in range(reps))
                row = {"shape": name, "m": m, "k": k, "n": n, **{f"{label}_ms": 1e3 * t for label, t in times.items()},
                       "bf16_over_widened": times["bf16"] / times["widened"],
                       "widened_over_fp32": times["widened"] / times["fp32"]}
                rows.append(row)
                print(f"{name:37} {row['fp32_ms']:8.2f} {row['bf16_ms']:9.2f} {row['widened_ms']:10.2f} "
                      f"{row['bf16_over_widened']:12.1f} {row['widened_over_fp32']:12.2f}", flush=True)
            parallel_state.destroy_model_parallel()
            return rows
        finally:
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
