"""Context-parallel attention: activation memory per rank vs cp, longest sequence in a memory budget, and
how much of the ring's communication the block computation hides.

    python bench/context_parallel.py --json bench/results/context_parallel.json

Memory is what autograd saves for backward in one attention layer (unique storages seen by
``saved_tensors_hooks``), per rank, fp32, batch 1. The reference is single-process attention written as
Megatron's local path computes it (scores, softmax, probabilities @ v: the [heads, S, S] probabilities are
saved). Ring, Ulysses and hybrid save q, k, v, the output and an fp32 log-sum-exp per rank, O(S / cp).
The ring's hidden fraction comes from its telemetry (hop in-flight time vs time blocked waiting), medians
over repetitions, gloo over loopback on a shared machine: treat absolute times as noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from harness import cpu, timed
from saved_memory import saved_bytes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def megatron_local_attention(q, k, v):
    """Megatron's local path: scaled scores, masked softmax, probabilities @ v (saves the probabilities)."""
    import torch

    seq = q.size(2)
    scores = torch.baddbmm(torch.empty(q.size(1), seq, seq), q[0], k[0].transpose(1, 2), beta=0.0,
                           alpha=q.size(-1) ** -0.5)
    hidden = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    return torch.bmm(scores.masked_fill(hidden, -10000.0).softmax(-1), v[0])


def _inputs(heads, local, head_dim, seed=0):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, local, head_dim, generator=generator).requires_grad_() for _ in range(3)]


def _attention(algorithm, group, positions, cp_group_ranks=None, hybrid=None):
    from ascendspeed.features.context_parallel import hybrid_attention, local_core_attention, ring_attention
    from ascendspeed.features.context_parallel import ulysses_attention

    def run(q, k, v, telemetry=None):
        if algorithm == "ring":
            return ring_attention(q, k, v, positions, group=group, telemetry=telemetry)
        if algorithm == "ulysses":
            return ulysses_attention(q, k, v, positions, group=group, core=local_core_attention())
        return hybrid_attention(q, k, v, positions, hybrid, telemetry=telemetry)

    return run


def _worker(rank, world_size, settings):
    import torch
    import torch.distributed as dist

    from ascendspeed.features.context_parallel import RingTelemetry, build_hybrid_groups, layout

    torch.set_num_threads(settings["threads"])
    heads, head_dim = settings["heads"], settings["head_dim"]
    group = dist.group.WORLD
    hybrid = build_hybrid_groups(list(range(world_size)), 2) if world_size >= 4 else None
    memory = {}
    for algorithm in ("ring", "ulysses") + (("hybrid",) if hybrid else ()):
        for seq in settings["seq_lengths"]:
            positions = [layout.positions_on_rank(seq, r, world_size) for r in range(world_size)]
            q, k, v = _inputs(heads, seq // world_size, head_dim)
            attention = _attention(algorithm, group, positions, hybrid=hybrid)
            memory[f"{algorithm} S={seq}"] = saved_bytes(lambda: attention(q, k, v))
    # the ring's overlap: forward + backward at the longest length, repeated
    seq = settings["overlap_seq"]
    positions = [layout.positions_on_rank(seq, r, world_size) for r in range(world_size)]
    q, k, v = _inputs(heads, seq // world_size, head_dim)
    attention = _attention("ring", group, positions)
    runs = []
    for repetition in range(settings["reps"] + 1):
        telemetry = RingTelemetry()
        dist.barrier()
        _, elapsed = timed(lambda: attention(q, k, v, telemetry).sum().backward())
        if repetition:  # the first run warms up
            runs.append({**telemetry.summary(), "step_s": elapsed})
    overlap = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    return {"memory": memory, "overlap": overlap}


def single_process_memory(settings):
    from ascendspeed.features.context_parallel import ring_attention

    import torch

    result = {}
    for seq in settings["seq_lengths"]:
        q, k, v = _inputs(settings["heads"], seq, settings["head_dim"])
        result[f"megatron-local S={seq}"] = saved_bytes(lambda: megatron_local_attention(q, k, v))
        result[f"blockwise S={seq}"] = saved_bytes(lambda: ring_attention(q, k, v, [torch.arange(seq)]))
    return result


def longest_fitting(per_seq: dict, budget: int, cp: int, quadratic: bool) -> int:
    """Longest S (a multiple of 2 cp) whose saved bytes fit ``budget``, from a fit through the measurements."""
    import numpy as np

    lengths = np.array(sorted(per_seq), dtype=float)
    values = np.array([per_seq[s] for s in sorted(per_seq)], dtype=float)
    degree = 2 if quadratic else 1
    coefficients = np.polyfit(lengths, values, degree)
    roots = np.roots(coefficients - np.array([0] * degree + [budget]))
    best = max(r.real for r in roots if abs(r.imag) < 1e-9 and r.real > 0)
    return int(best // (2 * cp) * (2 * cp))


def cpu_description() -> dict:
    host = cpu()
    return {"model": host.model, "flags": " ".join(host.vector_flags), "cores": host.logical_cpus}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--overlap-seq", type=int, default=4096)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--budget-mib", type=float, default=64.0, help="saved attention activations per rank")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch

    from tests.helpers.distributed import run_distributed

    settings = dict(heads=args.heads, head_dim=args.head_dim, seq_lengths=args.seq_lengths,
                    overlap_seq=args.overlap_seq, reps=args.reps, threads=args.threads)
    results = {"settings": settings, "cpu": cpu_description(), "torch": torch.__version__,
               "note": "shared machine (other jobs running); gloo over loopback; medians of repetitions",
               "memory_bytes_per_rank": {"cp=1": single_process_memory(settings)}, "overlap": {}}
    for cp in args.cp:
        per_rank = run_distributed(_worker, cp, settings, timeout=1800)
        results["memory_bytes_per_rank"][f"cp={cp}"] = per_rank[0]["memory"]
        results["overlap"][f"cp={cp} S={args.overlap_seq}"] = {
            "rank0": per_rank[0]["overlap"],
            "hidden_fraction_min_over_ranks": min(r["overlap"]["hidden_fraction"] for r in per_rank),
        }

    budget = int(args.budget_mib * 2**20)
    fits = {}
    for cp_key, table in results["memory_bytes_per_rank"].items():
        cp = int(cp_key.split("=")[1])
        for method in sorted({key.split(" S=")[0] for key in table}):
            per_seq = {int(key.split("S=")[1]): value for key, value in table.items() if key.startswith(method + " ")}
            fits[f"{method} {cp_key}"] = longest_fitting(per_seq, budget, cp, quadratic=method == "megatron-local")
    results["longest_sequence_in_budget"] = {"budget_MiB": args.budget_mib, "fits": fits}

    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
