"""Adaptive recompute against full recompute: tokens/s of the pretraining entry's GPT (12 layers by default) at
budgets between the full-recompute and the no-recompute peaks.

One process (the budget is per rank). A first run with an unbounded budget profiles the model and reports
both peaks (the minimum a budget may be: full recompute of every layer; and no recompute). Then, for each
budget, the run trains the profiling steps and measures the following ones; full recompute is the run at the
minimum budget (the planner can only recompute every layer there), which is Megatron's
``--recompute-granularity full`` with one layer per checkpoint.

    python bench/adaptive_recompute.py --json bench/results/adaptive_recompute.json \\
        --plot sources/images/adaptive_recompute.png

Reported: per budget the plan, the predicted and measured peak (MiB), median step time and tokens/s, and the
ratio to full recompute.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import machine  # noqa: E402

MIB = 2**20


def model_flags(options) -> list:
    return ["--num-layers", str(options.num_layers), "--hidden-size", str(options.hidden_size),
            "--num-attention-heads", str(options.heads), "--seq-length", str(options.seq_length),
            "--micro-batch-size", str(options.micro_batch_size), "--global-batch-size", str(options.micro_batch_size),
            "--train-iters", "100000", "--lr-warmup-iters", "1", "--eval-iters", "1",
            "--eval-seq-lengths", str(options.seq_length), "--adaptive-recompute-profiling-step",
            str(options.profiling_steps)]


def run(options, budget_mib: int) -> dict:
    """Profile, plan, then time ``options.steps`` steps at ``budget_mib``."""
    from ascendspeed.features import apply_features, disable_features
    from ascendspeed.training.arguments import parse_args
    from ascendspeed.training.initialize import initialize_parallel, teardown
    from ascendspeed.training.trainer import Trainer

    args = parse_args(model_flags(options) + ["--adaptive-recompute-device-size", str(budget_mib)], world_size=1)
    (controller,) = [feature.state for feature in apply_features(args) if feature.name == "adaptive_recompute"]
    state = initialize_parallel(args)
    try:
        trainer = Trainer(args, state.device)
        for _ in range(options.profiling_steps + 1):  # profiling, then the measured step with the plan
            trainer.train_step()
        times = []
        for _ in range(options.steps):
            start = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - start)
    finally:
        teardown(state)
        disable_features()
    step = statistics.median(times)
    return {"budget_MiB": budget_mib, "plan": controller.plan.describe(),
            "predicted_MiB": controller.predicted_peak / MIB, "measured_MiB": controller.measured_peak / MIB,
            "minimum_MiB": controller.minimum_bytes / MIB, "no_recompute_MiB": controller.none_peak_bytes / MIB,
            "step_s": step, "tokens_per_s": options.micro_batch_size * options.seq_length / step}


def worker(options) -> dict:
    import torch

    torch.set_num_threads(options.threads)
    from ascendspeed.adaptor import install

    install()
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{options.port}", rank=0, world_size=1)
    probe = run(options, 10**7)
    low, high = probe["minimum_MiB"], probe["no_recompute_MiB"]
    budgets = [int(low) + 1] + [int(low + fraction * (high - low)) for fraction in options.fractions]
    results = [run(options, budget) for budget in budgets]
    results.append(probe)  # unbounded: no recompute
    full = results[0]
    for result in results:
        result["vs_full_recompute"] = result["tokens_per_s"] / full["tokens_per_s"]
    return {"minimum_MiB": low, "no_recompute_MiB": high, "results": results}


def plot(measured: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = measured["results"][:-1]
    budgets = [r["budget_MiB"] for r in results]
    figure, (memory, speed) = plt.subplots(1, 2, figsize=(10, 3.6))
    memory.plot(budgets, budgets, color="#8c8c8c", linestyle="--", label="budget")
    memory.plot(budgets, [r["predicted_MiB"] for r in results], marker="o", label="predicted peak")
    memory.plot(budgets, [r["measured_MiB"] for r in results], marker="s", label="measured peak")
    memory.axhline(measured["no_recompute_MiB"], color="#c44e52", linewidth=1, label="no recompute")
    memory.set_xlabel("budget (MiB)")
    memory.set_ylabel("MiB")
    memory.legend(fontsize=8)
    speed.plot(budgets, [r["vs_full_recompute"] for r in results], marker="o")
    speed.axhline(measured["results"][-1]["vs_full_recompute"], color="#c44e52", linewidth=1, label="no recompute")
    speed.set_xlabel("budget (MiB)")
    speed.set_ylabel("tokens/s vs full recompute")
    speed.legend(fontsize=8)
    figure.suptitle("Adaptive recompute: peak memory and throughput against the budget (one rank)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--profiling-steps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--port", type=int, default=29741)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    options = parse(argv)
    os.environ.setdefault("ASCENDSPEED_DEVICE", "cpu")
    measured = worker(options)
    print(f"budgets between full recompute ({measured['minimum_MiB']:.1f} MiB) and none "
          f"({measured['no_recompute_MiB']:.1f} MiB)")
    for r in measured["results"]:
        print(f"budget {r['budget_MiB']:>8} MiB | {r['plan']:<40} | predicted {r['predicted_MiB']:7.1f} MiB, measured "
              f"{r['measured_MiB']:7.1f} MiB | {r['tokens_per_s']:8.0f} tokens/s ({r['vs_full_recompute']:.2f}x full "
              f"recompute)")
    if options.json:
        import torch

        with open(options.json, "w") as handle:
            json.dump({"machine": machine(torch), "options": vars(options), **measured}, handle, indent=1)
    if options.plot:
        plot(measured, options.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
