"""Megatron's bias-GeLU on the CPU: the C++ operators against the compiled sigmoid form they replace.

    python bench/bias_gelu.py [--shapes 128,8,512 256,4,2048] [--blocks 15] [--output bench/results/bias_gelu.json]

``bias_gelu_fusion`` (Megatron's default with a biased GeLU MLP) calls ``fused_bias_gelu.bias_gelu`` and, in
backward, ``bias_gelu_back``. On a CPU the adaptor computes them as ``x * sigmoid(2u)``: compiled by Megatron's
``jit_fuser`` (``torch.compile``) before, now the C++ operators ``ascendspeed::bias_gelu`` /
``bias_gelu_backward`` (``ascendspeed/accelerator/cpu_fusions.py``). One process, one thread, the MLP
activations of bench/peer_step.py's two models (sequence, micro-batch, 4 x hidden), fp32 and bf16; each function
in blocks of 20 calls, the four in a shuffled order per block; reported: the median block's time per call and
compiled / operator.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import finish_results, machine, shuffled_block_medians  # noqa: E402

CALLS_PER_BLOCK = 20


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["128,8,512", "256,4,2048"])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--output", help="write the results as JSON here")
    options = parser.parse_args(argv)
    os.environ.setdefault("ASCENDSPEED_DEVICE", "cpu")
    import torch

    import ascendspeed.megatron_adaptor  # noqa: F401
    from ascendspeed.accelerator import cpu_fusions
    from ascendspeed.ops import bias_gelu  # noqa: F401  loads the operators

    torch.set_num_threads(1)
    compiled_forward = cpu_fusions._fused_on_first_call(cpu_fusions.bias_gelu_sigmoid_form)
    compiled_backward = cpu_fusions._fused_on_first_call(cpu_fusions.bias_gelu_back_sigmoid_form)
    results = {"machine": machine(torch), "threads": 1, "rows": []}
    for text in options.shapes:
        shape = tuple(int(size) for size in text.split(","))
        for dtype_name in options.dtypes:
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
            y, grad = (3 * torch.randn(shape)).to(dtype), torch.randn(shape).to(dtype)
            bias = torch.randn(shape[-1]).to(dtype)
            functions = {
                "compiled_forward": lambda: compiled_forward(bias, y),
                "operator_forward": lambda: torch.ops.ascendspeed.bias_gelu(y, bias),
                "compiled_backward": lambda: compiled_backward(grad, bias, y),
                "operator_backward": lambda: torch.ops.ascendspeed.bias_gelu_backward(grad, y, bias),
            }
            for function in functions.values():
                for _ in range(3):  # compile, first-call paths
                    function()
            ms = shuffled_block_medians(functions, options.blocks, CALLS_PER_BLOCK)
            row = {"shape": list(shape), "dtype": dtype_name, "ms": ms,
                   "compiled_over_operator": {
                       "forward": ms["compiled_forward"] / ms["operator_forward"],
                       "backward": ms["compiled_backward"] / ms["operator_backward"]}}
            results["rows"].append(row)
            print(f"shape {text:>11} {dtype_name}  forward {ms['compiled_forward']:7.3f} / "
                  f"{ms['operator_forward']:7.3f} ms ({row['compiled_over_operator']['forward']:.2f}x)  backward "
                  f"{ms['compiled_backward']:7.3f} / {ms['operator_backward']:7.3f} ms "
                  f"({row['compiled_over_operator']['backward']:.2f}x)  (compiled / operator)", flush=True)
    return finish_results(results, options.output)


if __name__ == "__main__":
    main()
