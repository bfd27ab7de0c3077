"""Throughput of the main job with ascendspeed's features against the same job without them.

    python bench/main_job_features.py [--rounds 3 --train-iters 60 --nproc 2] [--output FILE.json]

Runs ``torchrun --nproc-per-node 2 -m ascendspeed.training.pretrain_gpt`` (the README's first command,
see docs/training.md) in four configurations, interleaved round by round so that machine noise hits all
alike:

* ``megatron_defaults``: Megatron's defaults on the same model (learned absolute position embeddings,
  GeLU MLP, gradients reduced after backward): ``--position-embedding-type learned_absolute --no-swiglu
  --no-overlap-grad-reduce``;
* ``alibi``: the same with ALiBi instead of learned positions on Megatron's local attention path
  (``--attention-backend unfused``);
* ``alibi_fused``: the same on the fused ALiBi attention kernel (``--alibi-fused-attention``; Megatron's
  default ``--attention-backend auto`` picks it too);
* ``default_job``: the entry's defaults, no flags: ALiBi, SwiGLU on the fused operator,
  ``--overlap-grad-reduce``.

Throughput is the median of the job's own tokens/s reports (every ``--log-interval`` iterations, the
first interval left out as warm-up) per run, then the median over rounds; ratios are against
``megatron_defaults``. Periodic validation is off (one batch at iteration 0, the final evaluation at the
training length only), so only training is timed. The JSON records the CPU and its vector flags.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys

from harness import load_average, machine, timed

MEGATRON_DEFAULTS = ["--position-embedding-type", "learned_absolute", "--no-swiglu", "--no-overlap-grad-reduce"]
CONFIGS = {
    "megatron_defaults": MEGATRON_DEFAULTS,
    "alibi": ["--position-embedding-type", "alibi", "--attention-backend", "unfused", "--no-swiglu",
              "--no-overlap-grad-reduce"],
    "alibi_fused": ["--position-embedding-type", "alibi", "--alibi-fused-attention", "--no-swiglu",
                    "--no-overlap-grad-reduce"],
    "default_job": [],
}
BASELINE = "megatron_defaults"
TOKENS_PER_SECOND = re.compile(r"\|\s*([\d,]+) tokens/s")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--train-iters", type=int, default=60)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--output", help="write the results as JSON here")
    return parser.parse_args(argv)


def run_job(args, extra_flags) -> list[float]:
    """One training run; its tokens/s reports after the first interval."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
        "-m", "ascendspeed.training.pretrain_gpt",
        "--train-iters", str(args.train_iters), "--log-interval", str(args.log_interval),
        "--eval-interval", str(10 * args.train_iters), "--eval-iters", "1", "--eval-seq-lengths", "128",
        *extra_flags,
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    reports = [float(m.group(1).replace(",", "")) for m in TOKENS_PER_SECOND.finditer(result.stdout)]
    if len(reports) < 2:
        raise RuntimeError(f"expected tokens/s reports in the job's output, got:\n{result.stdout[-3000:]}")
    return reports[1:]


def main(argv=None):
    args = parse_args(argv)
    host = machine()
    runs = {name: [] for name in CONFIGS}
    for round_index in range(args.rounds):
        for name, flags in CONFIGS.items():
            reports, seconds = timed(run_job, args, flags)
            runs[name].append(statistics.median(reports))
            print(f"round {round_index + 1}/{args.rounds} {name:<18}{runs[name][-1]:>10,.0f} tokens/s "
                  f"({seconds:.0f} s)", flush=True)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    print(f"{host['cpu_model']}, {args.nproc} ranks, {args.train_iters} iterations, median of {args.rounds} rounds")
    results = {}
    for name, value in medians.items():
        ratio = value / medians[BASELINE]
        results[name] = {"flags": " ".join(CONFIGS[name]), "tokens_per_s": round(value), "per_round": runs[name],
                         f"vs_{BASELINE}": round(ratio, 3)}
        print(f"  {name:<18}{value:>10,.0f} tokens/s  {ratio:.3f}x {BASELINE}")
    host["load_average_1min_end"] = load_average()
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"machine": host, "nproc": args.nproc, "train_iters": args.train_iters, "rounds": args.rounds,
                       "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
