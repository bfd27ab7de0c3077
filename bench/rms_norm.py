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

import os
import sys
import warnings

from operator_floor import Phases, main, measure
from operator_floor import report as operator_report

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
    return operator_report(result, floor="2N fwd + 3N bwd", fresh="y and grad_x", tensor="x",
                           baselines={"eager": "eager", "torch": "F.rms_norm"})


def measure_rows(torch, impls, quick: bool, reps: int) -> list[dict]:
    shape = QUICK_SHAPE if quick else SHAPE
    return [measure_dtype(torch, impls, shape, getattr(torch, d), reps) for d in DTYPES]


if __name__ == "__main__":
    main(__doc__, "rms_norm forward+backward", "_rms_norm_cpu_kernel", _import, measure_rows, report)
