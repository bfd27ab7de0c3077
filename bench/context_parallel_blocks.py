"""Context-parallel attention blocks on the CPU: ascendspeed's flash kernel against the blockwise torch code.

    python bench/context_parallel_blocks.py [--json bench/results/context_parallel_blocks.json] [--reps 5]

The ring computes, on each rank, its queries against the keys of every rank, block by block, and merges the
blocks by log-sum-exp (``ascendspeed/features/context_parallel``). This times what rank 0 of a cp-2 ring
computes in one attention layer, the balanced layout (chunks 0 and 3 of 4): its queries against its own keys
and against rank 1's, forward and backward (given the final output and log-sum-exp, as the ring calls them),
through ``FlashBlockKernels`` (``ascendspeed::alibi_flash_attention`` per contiguous piece, what CPU ranks
run now) and ``BlockwiseKernels`` (materialised fp32 scores per block, what ran before and still runs with
masks, packs or dropout). Causal, with ALiBi and without, fp32 and bf16, medians of interleaved rounds, on
``--threads`` threads. Also reported: the largest transient of the blockwise code, the fp32 scores (and
probabilities) of a block, which the flash kernel never materialises.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from harness import load_average, machine, timed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _layer(kernels, q, k_all, v_all, grad, q_pos, key_positions, rule):
    """Rank 0's blocks of one layer through ``kernels``: forward over every key block, merged, then backward."""
    import torch

    from ascendspeed.features.context_parallel.blockwise import merge_block_

    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full(q.shape[:-1], float("-inf"))
    for k, v, k_pos in zip(k_all, v_all, key_positions):
        merge_block_(out, lse, *kernels.forward(q, k, v, q_pos, k_pos, rule))
    final = out.to(q.dtype)
    delta = (grad.float() * final.float()).sum(-1)
    for k, v, k_pos in zip(k_all, v_all, key_positions):
        kernels.backward(q, k, v, grad, final, lse, delta, q_pos, k_pos, rule)


def measure(seq, heads, head_dim, dtype_name, alibi, reps):
    import torch

    from ascendspeed.features.context_parallel import layout
    from ascendspeed.features.context_parallel.block_kernels import BlockwiseKernels, FlashBlockKernels
    from ascendspeed.features.context_parallel.blockwise import ScoreRule
    from ascendspeed.ops.alibi import alibi_slopes

    dtype = getattr(torch, dtype_name)
    positions = [layout.positions_on_rank(seq, rank, 2) for rank in range(2)]
    local = positions[0].numel()
    q, grad = (torch.randn(1, heads, local, head_dim).to(dtype) for _ in range(2))
    keys = [torch.randn(1, heads, local, head_dim).to(dtype) for _ in range(2)]
    values = [torch.randn(1, heads, local, head_dim).to(dtype) for _ in range(2)]
    rule = ScoreRule(scale=head_dim ** -0.5, causal=True, slopes=alibi_slopes(heads) if alibi else None)
    kernels = {"flash": FlashBlockKernels, "blockwise": BlockwiseKernels}
    times = {name: [] for name in kernels}
    for name, kernel in kernels.items():  # warm-up
        _layer(kernel, q, keys, values, grad, positions[0], positions, rule)
    for _ in range(reps):
        for name, kernel in kernels.items():
            times[name].append(timed(_layer, kernel, q, keys, values, grad, positions[0], positions, rule)[1])
    flash, blockwise = (1e3 * statistics.median(times[name]) for name in kernels)
    return {"seq": seq, "heads": heads, "head_dim": head_dim, "dtype": dtype_name, "alibi": alibi,
            "flash_ms": flash, "blockwise_ms": blockwise, "blockwise_over_flash": blockwise / flash,
            "blockwise_scores_mib": 2 * heads * local * local * 4 / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'seq':>6} {'dtype':9} {'alibi':6} {'flash ms':>9} {'blockwise':>10} {'ratio':>6} {'scores MiB':>10}")
    for seq in args.seq_lengths:
        for dtype in ("float32", "bfloat16"):
            for alibi in (False, True):
                row = measure(seq, args.heads, args.head_dim, dtype, alibi, args.reps)
                rows.append(row)
                print(f"{seq:6d} {dtype:9} {str(alibi):6} {row['flash_ms']:9.1f} {row['blockwise_ms']:10.1f} "
                      f"{row['blockwise_over_flash']:6.2f} {row['blockwise_scores_mib']:10.0f}", flush=True)
    result = {"machine": machine(torch), "load_average_end": load_average(), "reps": args.reps, "rows": rows}
    print(f"load average at the end: {result['load_average_end']:.2f}; {result['machine']['cpu_model']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
