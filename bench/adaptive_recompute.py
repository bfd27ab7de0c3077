"""Adaptive recompute against full recompute: tokens/s of the pretraining entry's GPT (12 layers by default) at
budgets between the full-recompute and the no-recompute peaks.

One process (the budget is per rank). A first run with an unbounded budget profiles the model and reports
both peaks (the minimum a budget may be: full recompute of every layer; and no recompute). Then, for each
budget, a run profiles, plans and measures its plan's peak. Full recompute is Megatron's
``--recompute-granularity full --recompute-method block`` of every layer, one layer per checkpoint. Last, one model times every plan and every hand-chosen setting, one step each in
turn in a random order (``--steps`` rounds, medians), switching between them through the same switches the
planner sets.

    python bench/adaptive_recompute.py --json bench/results/adaptive_recompute.json \\
        --plot sources/images/adaptive_recompute.png

Reported: per budget the plan, the predicted and measured peak (MiB), median step time and tokens/s, and the
ratio to full recompute; and against hand-chosen recompute: Megatron's ``--recompute-granularity full
--recompute-method block --recompute-num-layers k`` for every k (set on the model's config, as the flags do;
k = 0 is no recompute), each run's peak measured the same way (static memory + the saved-tensor account's
peak), and per budget the fastest k that fits it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import machine  # noqa: E402

MIB = 2**20


def model_flags(options, adaptive: bool = True) -> list:
    profiling = ["--adaptive-recompute-profiling-step", str(options.profiling_steps)] if adaptive else []
    return ["--num-layers", str(options.num_layers), "--hidden-size", str(options.hidden_size),
            "--num-attention-heads", str(options.heads), "--seq-length", str(options.seq_length),
            "--micro-batch-size", str(options.micro_batch_size), "--global-batch-size", str(options.micro_batch_size),
            "--train-iters", "100000", "--lr-warmup-iters", "1", "--eval-iters", "1",
            "--eval-seq-lengths", str(options.seq_length), *profiling]


def run(options, budget_mib: int) -> dict:
    """Profile and plan at ``budget_mib``, then the measured step with the plan."""
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
    finally:
        teardown(state)
        disable_features()
    return {"budget_MiB": budget_mib, "plan": controller.plan.describe(), "options": list(controller.plan.options),
            "predicted_MiB": controller.predicted_peak / MIB, "measured_MiB": controller.measured_peak / MIB,
            "minimum_MiB": controller.minimum_bytes / MIB, "no_recompute_MiB": controller.none_peak_bytes / MIB}


def timed_settings(options, settings: dict) -> dict:
    """Per setting (name -> per-layer options) its peak (static + the saved-tensor account's peak over one step)
    and its median step time, all in one model, one step of each setting in turn, in a new random order every
    round, so load from other work, and what the step before leaves behind (the allocator's mapped pages),
    hit them alike."""
    from ascendspeed.features import apply_features, disable_features
    from ascendspeed.features.adaptive_recompute.controller import apply_options, transformer_blocks
    from ascendspeed.training.activations import SavedTensorAccount, model_state_tensors
    from ascendspeed.training.arguments import parse_args
    from ascendspeed.training.initialize import initialize_parallel, teardown
    from ascendspeed.training.memory import account
    from ascendspeed.training.trainer import Trainer

    args = parse_args(model_flags(options, adaptive=False), world_size=1)
    apply_features(args)
    state = initialize_parallel(args)
    names = list(settings)
    peaks, times = {}, {name: [] for name in names}
    try:
        trainer = Trainer(args, state.device)
        (block,) = transformer_blocks(trainer.model)
        trainer.train_step()  # the optimizer state exists from here on
        for name in names:
            apply_options([block], [settings[name]])
            activations = SavedTensorAccount(model_state_tensors(trainer.model))
            with activations.recording():
                trainer.train_step()
            peaks[name] = account(trainer.model, trainer.optimizer).total + activations.peak
        order = random.Random(0)
        for _ in range(options.steps):
            for name in order.sample(names, len(names)):
                apply_options([block], [settings[name]])
                start = time.perf_counter()
                trainer.train_step()
                times[name].append(time.perf_counter() - start)
    finally:
        teardown(state)
        disable_features()
    tokens = options.micro_batch_size * options.seq_length
    return {name: {"measured_MiB": peaks[name] / MIB, "step_s": statistics.median(times[name]),
                   "tokens_per_s": tokens / statistics.median(times[name])} for name in names}


def best_hand_chosen(hand_chosen: list, budget_mib: float) -> dict | None:
    """The fastest hand-chosen run whose measured peak fits ``budget_mib``."""
    fitting = [run for run in hand_chosen if run["measured_MiB"] <= budget_mib]
    return max(fitting, key=lambda run: run["tokens_per_s"]) if fitting else None


def worker(options) -> dict:
    import torch

    torch.set_num_threads(options.threads)
    from ascendspeed.adaptor import install
    from ascendspeed.features.adaptive_recompute.solver import FULL, NONE

    install()
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{options.port}", rank=0, world_size=1)
    probe = run(options, 10**7)
    low, high = probe["minimum_MiB"], probe["no_recompute_MiB"]
    budgets = [int(low) + 1] + [int(low + fraction * (high - low)) for fraction in options.fractions]
    results = [run(options, budget) for budget in budgets]
    results.append(probe)  # unbounded: no recompute
    layers = options.num_layers
    settings = {f"budget {result['budget_MiB']}": result["options"] for result in results}
    settings.update({f"k={k}": [FULL] * k + [NONE] * (layers - k) for k in range(layers + 1)})
    timed = timed_settings(options, settings)
    hand_chosen = [{"full_layers": k, **timed[f"k={k}"]} for k in range(layers + 1)]
    for result in results:
        own = timed[f"budget {result['budget_MiB']}"]
        result.update(step_s=own["step_s"], tokens_per_s=own["tokens_per_s"])
    compare(results, hand_chosen)
    return {"minimum_MiB": low, "no_recompute_MiB": high, "results": results, "hand_chosen": hand_chosen}


def compare(results: list, hand_chosen: list) -> None:
    """Each plan's tokens/s against Megatron's full recompute of every layer (the last hand-chosen run) and
    against the fastest hand-chosen run that fits its budget."""
    full = hand_chosen[-1]
    for result in results:
        result["vs_full_recompute"] = result["tokens_per_s"] / full["tokens_per_s"]
        best = best_hand_chosen(hand_chosen, result["budget_MiB"])
        result["best_hand_chosen"] = best and best["full_layers"]
        result["vs_best_hand_chosen"] = best and result["tokens_per_s"] / best["tokens_per_s"]


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
    speed.plot(budgets, [r["vs_full_recompute"] for r in results], marker="o", label="adaptive, at its budget")
    hand = measured.get("hand_chosen", [])
    full = hand[-1]["tokens_per_s"]
    speed.scatter([r["measured_MiB"] for r in hand], [r["tokens_per_s"] / full for r in hand], marker="x",
                  color="#55a868", label="hand-chosen k, at its peak")
    for r in hand:
        speed.annotate(str(r["full_layers"]), (r["measured_MiB"], r["tokens_per_s"] / full), fontsize=6,
                       xytext=(2, 2), textcoords="offset points")
    speed.axhline(measured["results"][-1]["vs_full_recompute"], color="#c44e52", linewidth=1, label="no recompute")
    speed.set_xlabel("budget / peak (MiB)")
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
    parser.add_argument("--profiling-steps", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--port", type=int, default=29741)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--from-json", default=None,
                        help="do not measure: recompute the comparisons (and --json, --plot) from a saved run")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    options = parse(argv)
    os.environ.setdefault("ASCENDSPEED_DEVICE", "cpu")
    if options.from_json:
        with open(options.from_json) as handle:
            saved = json.load(handle)
        measured = {key: saved[key] for key in ("minimum_MiB", "no_recompute_MiB", "results", "hand_chosen")}
        compare(measured["results"], measured["hand_chosen"])
        options = argparse.Namespace(**{**saved["options"], "json": options.json, "plot": options.plot})
    else:
        measured = worker(options)
    print(f"budgets between full recompute ({measured['minimum_MiB']:.1f} MiB) and none "
          f"({measured['no_recompute_MiB']:.1f} MiB)")
    for r in measured["hand_chosen"]:
        print(f"hand-chosen --recompute-num-layers {r['full_layers']:>2} | measured {r['measured_MiB']:7.1f} MiB | "
              f"{r['tokens_per_s']:8.0f} tokens/s")
    for r in measured["results"]:
        best = ("no hand-chosen k fits" if r["best_hand_chosen"] is None else
                f"{r['vs_best_hand_chosen']:.2f}x the best hand-chosen (k={r['best_hand_chosen']})")
        print(f"budget {r['budget_MiB']:>8} MiB | {r['plan']:<40} | predicted {r['predicted_MiB']:7.1f} MiB, measured "
              f"{r['measured_MiB']:7.1f} MiB | {r['tokens_per_s']:8.0f} tokens/s ({r['vs_full_recompute']:.2f}x full "
              f"recompute, {best})")
    if options.json:
        import torch

        with open(options.json, "w") as handle:
            json.dump({"machine": machine(torch), "options": vars(options), **measured}, handle, indent=1)
    if options.plot:
        plot(measured, options.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
