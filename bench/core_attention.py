"""Causal core attention without a bias on this CPU, forward + backward, by kernel (not a test).

    python bench/core_attention.py [--dtypes float32 bfloat16] [--repeats 7] [--threads 1]
                                   [--output bench/results/core_attention.json]

Variants, [b, heads, s, d] inputs, causal, no dropout:

* ``materialised``: Megatron's local path as a plain composition (``baddbmm`` scores, ``masked_fill`` with
  -10000, softmax, ``bmm``) in the input dtype;
* ``torch_flash``: torch's ``scaled_dot_product_attention`` (its CPU flash kernel) in the input dtype;
* ``torch_flash_fp32``: the same kernel on fp32 copies, the output rounded to the input dtype (half precision
  only): what the fused-attention feature runs for masked calls on CPUs without a fast half-precision GEMM;
* ``ascendspeed_flash``: ``ascendspeed.ops.alibi_flash_attention`` with every slope 0, in the input dtype:
  what it runs there for plain causal calls.

Medians of ``--repeats`` after a warm-up, the variants of one (shape, dtype) interleaved; ratios against
``materialised``. The JSON records the CPU model and vector flags, torch's CPU capability, whether torch has a
fast bf16 GEMM here, the thread count and the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from harness import machine, timed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: (b, heads, s, d): the small and large peer-bench models' attention, and a longer sequence.
SHAPES = [(8, 4, 128, 32), (4, 8, 256, 64), (1, 16, 1024, 64)]


def variants(torch):
    import torch.nn.functional as F

    from ascendspeed.ops.alibi_flash_attention import alibi_flash_attention

    def materialised(q, k, v):
        b, h, s, d = q.shape
        scores = torch.baddbmm(torch.empty(b * h, s, s, dtype=q.dtype), q.reshape(b * h, s, d),
                               k.reshape(b * h, s, d).transpose(1, 2), beta=0.0, alpha=d ** -0.5)
        masked = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(masked, -10000.0).softmax(-1)
        return torch.bmm(probs, v.reshape(b * h, s, d)).view(b, h, s, d)

    def torch_flash(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def torch_flash_fp32(q, k, v):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(q.dtype)

    def ascendspeed_flash(q, k, v):
        return alibi_flash_attention(q, k, v, torch.zeros(q.shape[1]))

    return {"materialised": materialised, "torch_flash": torch_flash, "torch_flash_fp32": torch_flash_fp32,
            "ascendspeed_flash": ascendspeed_flash}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16", "float16"),
                        default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    import torch

    from ascendspeed.accelerator.cpu_features import has_fast_bf16_gemm

    torch.set_num_threads(args.threads)
    functions = variants(torch)
    rows = []
    for shape in SHAPES:
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            names = [name for name in functions if not (name == "torch_flash_fp32" and dtype == torch.float32)]
            q, k, v, grad = (torch.randn(shape).to(dtype) for _ in range(4))

            def step(name):
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                functions[name](*leaves).backward(grad)

            times = {name: [] for name in names}
            for name in names:
                step(name)
            for _ in range(args.repeats):
                for name in names:
                    times[name].append(timed(step, name)[1])
            medians = {name: 1e3 * statistics.median(values) for name, values in times.items()}
            row = {"shape": list(shape), "dtype": dtype_name, "ms": medians,
                   "over_materialised": {name: t / medians["materialised"] for name, t in medians.items()}}
            rows.append(row)
            print(f"{str(shape):18} {dtype_name:9} " + "  ".join(f"{name} {t:8.2f} ms" for name, t in medians.items()),
                  flush=True)
    result = {"machine": machine(torch), "fast_bf16_gemm": has_fast_bf16_gemm(), "threads": args.threads,
              "repeats": args.repeats, "rows": rows}
    if args.output:
        with open(args.output, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
