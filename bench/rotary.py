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

import os
import sys
import warnings

from operator_floor import Phases, main, measure
from operator_floor import report as operator_report

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


def layout(row) -> str:
    return "interleaved" if row["interleaved"] else "half"


def report(result) -> str:
    return operator_report(result, floor="2N fwd + 2N bwd", fresh="the output and grad_t", tensor="t",
                           baselines={"eager": "eager"}, columns=[("layout", layout)])


def measure_rows(torch, impls, quick: bool, reps: int) -> list[dict]:
    shape = QUICK_SHAPE if quick else SHAPE
    return [measure_layout(torch, impls, shape, getattr(torch, d), layout, reps) for d in DTYPES for layout in LAYOUTS]


if __name__ == "__main__":
    main(__doc__, "rotary_embedding forward+backward", "_rotary_embedding_cpu_kernel", _import, measure_rows, report)
