"""Benchmark of the MoE token permutation operators on the CPU (not a test).

    python bench/moe_permute.py [--json bench/results/moe_permute.json] [--reps 11] [--threads 2]

One run measures, on ``--threads`` threads (2 by default), a dispatcher's round trip, forward and backward:
the tokens permuted into expert order with their routing probabilities (fp32, Megatron's router dtype), then
unpermuted back (what megatron-core's alltoall and allgather dispatchers run around the experts, less the
communication), at scaled-down shapes of three MoE models (random top-k routing), tokens in float32 and
bfloat16 (medians of ``--reps`` rounds):

* ``ours``: ``ascendspeed.ops.permute_tokens`` + ``unpermute_tokens`` under autograd (what
  ``--moe-permute-fusion`` runs without Transformer Engine);
* ``unfused``: megatron-core's ``moe_utils.permute`` + ``unpermute`` with ``fused=False`` (argsort,
  ``index_select``, ``scatter_add``): what runs without the flag, and what the flag ran into without TE;
* the memory-bandwidth floor (bench/operator_floor.py): with top-k, forward reads the tokens (N bytes) and
  writes k rows each (kN), then reads those and writes the tokens back: 2(1 + k)N; backward the same. The
  fresh floor adds the first touch of the fresh outputs, (1 + k)N per phase.

Every timed phase starts from cold caches; rounds interleave the implementations; medians of the rounds are
reported. Memory: bytes saved for backward relative to the bytes of the tokens.
"""
from __future__ import annotations

import os
import sys
import warnings

from operator_floor import Phases, main, measure
from operator_floor import report as operator_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: name: (tokens, hidden, experts, top-k). Mixtral 8x7B: hidden 4096, 8 experts, top 2; DeepSeek-V3: hidden
#: 7168, 256 routed experts, top 8; Qwen3-30B-A3B: hidden 2048, 128 experts, top 8. Hidden sizes and expert
#: counts scaled down to fit a 2-core machine's memory and time.
MODELS = {
    "Mixtral-like": (8192, 1024, 8, 2),
    "DeepSeek-V3-like": (4096, 1024, 64, 8),
    "Qwen3-MoE-like": (16384, 512, 32, 4),
}
QUICK_MODELS = {"quick": (256, 64, 8, 2)}  # --quick: a smoke run of the script itself
DTYPES = ["float32", "bfloat16"]


def _import():
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
    sys.path.insert(0, ROOT)
    import torch
    from megatron.core.transformer.moe import moe_utils

    from ascendspeed.ops.moe_permute import permute_tokens, unpermute_tokens

    def ours(tokens, routing_map, probs, routed):
        permuted, _, row_id_map = permute_tokens(tokens, routing_map, probs, routed)
        return unpermute_tokens(permuted, row_id_map, tokens.size(0))

    def unfused(tokens, routing_map, probs, routed):
        permuted, _, sorted_indices = moe_utils.permute(tokens, routing_map, probs=probs, num_out_tokens=routed)[:3]
        return moe_utils.unpermute(permuted, sorted_indices, tokens.shape, routing_map=routing_map)

    return torch, {"ours": ours, "unfused": unfused}


def measure_model(torch, impls, name, shape, dtype, reps):
    tokens, hidden, experts, topk = shape
    x = torch.randn(tokens, hidden, dtype=dtype).requires_grad_()
    scores = torch.rand(tokens, experts)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, scores.topk(topk, -1).indices, True)
    probs = torch.softmax(scores, -1)
    routed = tokens * topk
    grad = torch.randn_like(x)
    closures = {label: (lambda fn=fn: fn(x, routing_map, probs, routed)) for label, fn in impls.items()}
    phases = Phases(forward=2 * (1 + topk), backward=2 * (1 + topk), fresh_forward=3 * (1 + topk),
                    fresh_backward=3 * (1 + topk))
    return {"model": name, "experts": experts, "topk": topk, **measure(closures, [x], grad, phases, reps)}


def report(result) -> str:
    return operator_report(result, floor="2(1+k)N fwd + 2(1+k)N bwd", fresh="the permuted rows and the output",
                           tensor="tokens", baselines={"unfused": "unfused"},
                           columns=[("model", lambda row: row["model"]),
                                    ("experts, top-k", lambda row: f"{row['experts']}, {row['topk']}")])


def measure_rows(torch, impls, quick: bool, reps: int) -> list[dict]:
    models = QUICK_MODELS if quick else MODELS
    return [measure_model(torch, impls, name, shape, getattr(torch, d), reps)
            for d in DTYPES for name, shape in models.items()]


if __name__ == "__main__":
    main(__doc__, "MoE permute + unpermute forward+backward", "_moe_permute_cpu_kernel", _import, measure_rows,
         report)
