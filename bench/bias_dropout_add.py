"""Megatron's fused bias-dropout-add on the CPU: the compiled function against the eager one it compiles.

    python bench/bias_dropout_add.py [--shapes 128,8,128 256,4,512] [--dropout 0.0 0.1] [--blocks 15]
                                     [--output bench/results/bias_dropout_add.json]

``bias_dropout_fusion`` (Megatron's default) calls ``fused_bias_dropout.bias_dropout_add_fused_train``, Megatron's
eager ``_bias_dropout_add_func`` compiled by ``jit_fuser`` (``torch.compile``), twice per transformer layer. The
adaptor runs the eager function for CPU tensors (``ascendspeed/accelerator/cpu_fusions.py``); the compiled one is
still reachable as the wrapper's ``__wrapped__``. One process, one thread, forward and backward of
``residual + dropout(x + bias)`` with all three requiring gradients (as in the layer), on the shapes of
bench/peer_step.py's two models (sequence, micro-batch, hidden). The two alternate in blocks of 20 calls, in a
shuffled order per block; reported: the median block's time per call, and compiled / eager.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import finish_results, machine, shuffled_block_medians  # noqa: E402

CALLS_PER_BLOCK = 20


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["128,8,128", "256,4,512"])
    parser.add_argument("--dropout", nargs="+", type=float, default=[0.0, 0.1])
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--output", help="write the results as JSON here")
    options = parser.parse_args(argv)
    os.environ.setdefault("ASCENDSPEED_DEVICE", "cpu")
    import torch

    import ascendspeed.megatron_adaptor  # noqa: F401
    from megatron.core.fusions import fused_bias_dropout

    torch.set_num_threads(1)
    functions = {
        "compiled": fused_bias_dropout.bias_dropout_add_fused_train.__wrapped__,
        "eager": lambda x_with_bias, residual, prob: fused_bias_dropout._bias_dropout_add_func(
            x_with_bias, residual, prob, True),
    }
    results = {"machine": machine(torch), "threads": 1, "rows": []}
    for text in options.shapes:
        shape = tuple(int(size) for size in text.split(","))
        x, residual, grad = (torch.randn(shape) for _ in range(3))
        bias = torch.randn(shape[-1])

        def call(function, prob):
            leaves = [tensor.clone().requires_grad_() for tensor in (x, bias, residual)]
            function((leaves[0], leaves[1]), leaves[2], prob).backward(grad)

        for prob in options.dropout:
            for function in functions.values():
                for _ in range(3):  # compile, first-call paths
                    call(function, prob)
            ms = shuffled_block_medians({name: functools.partial(call, function, prob)
                                         for name, function in functions.items()}, options.blocks, CALLS_PER_BLOCK)
            row = {"shape": list(shape), "dropout": prob, "ms": ms}
            row["compiled_over_eager"] = row["ms"]["compiled"] / row["ms"]["eager"]
            results["rows"].append(row)
            print(f"shape {text:>10}  dropout {prob:.2f}  compiled {row['ms']['compiled']:7.3f} ms  "
                  f"eager {row['ms']['eager']:7.3f} ms  compiled / eager {row['compiled_over_eager']:.2f}",
                  flush=True)
    return finish_results(results, options.output)


if __name__ == "__main__":
    main()
