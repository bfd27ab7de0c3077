"""Megatron-LM's own ``pretrain_gpt.py`` with ``import ascendspeed.megatron_adaptor`` against the pretraining
entry, on the same model with Megatron's defaults.

    python bench/megatron_lm_step.py [--megatron-lm ../shared/megatron-lm/core_v0.19.0] [--rounds 3]
        [--megatron-lm-args "--num-workers 2"] [--output bench/results/megatron_lm_step.json]

Both run under ``torchrun --nproc-per-node 2`` on the CPU over gloo, one thread per rank, alternating round by
round so machine noise hits both alike: the entry's default model (GPT 4 layers, hidden 128, 4 heads, GeLU
MLP 512, sequence 128, micro-batch 8, 2 data-parallel ranks, fp32) with Megatron's defaults
(``--position-embedding-type learned_absolute --no-swiglu --no-overlap-grad-reduce``), and Megatron-LM with the
same shape on its mock data (``--mock-data --tokenizer-type NullTokenizer``, vocabulary 256 as the entry's
bytes) and the entry's dropout (0; Megatron-LM's default 0.1 costs more than the rest of the difference: its
attention dropout keeps Megatron's materialised attention, see docs/features/fused-attention.md). Throughput: the entry's tokens/s reports, Megatron-LM's ``elapsed time per iteration`` as tokens/s, the
first logging interval left out, the median per run, then the median over rounds; and the paired ratio, the
median over rounds of each round's Megatron-LM / entry (a machine whose speed drifts moves a round's two alike).
Megatron-LM's data loader runs in its training process: ``--num-workers 0`` is the CPU default the adaptor sets
(docs/megatron-lm-on-cpu.md); ``--megatron-lm-args "--num-workers 2"`` measures Megatron-LM's GPU default.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from harness import load_average, machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQUENCE, MICRO_BATCH, GLOBAL_BATCH = 128, 8, 16
ENTRY_FLAGS = ["--position-embedding-type", "learned_absolute", "--no-swiglu", "--no-overlap-grad-reduce"]
MEGATRON_LM_FLAGS = [
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--ffn-hidden-size", "512",
    "--seq-length", str(SEQUENCE), "--max-position-embeddings", str(SEQUENCE),
    "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH),
    "--lr", "5e-3", "--min-lr", "5e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "10",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--init-method-std", "0.02",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
    "--eval-iters", "0", "--eval-interval", "100000", "--seed", "1234",
    "--hidden-dropout", "0", "--attention-dropout", "0",  # the entry's defaults (Megatron-LM's: 0.1)
]
LAUNCHER = """import os, runpy, sys
import ascendspeed.megatron_adaptor  # noqa: F401
sys.path.append(os.environ["MEGATRON_LM_PATH"])
sys.argv[0] = os.path.join(os.environ["MEGATRON_LM_PATH"], "pretrain_gpt.py")
runpy.run_path(sys.argv[0], run_name="__main__")
"""
ENTRY_TOKENS_PER_SECOND = re.compile(r"\|\s*([\d,]+) tokens/s")
MEGATRON_LM_ITERATION_MS = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+)")


def torchrun(args, command: list[str]) -> str:
    environment = dict(os.environ, OMP_NUM_THREADS="1", ASCENDSPEED_DEVICE="cpu", MEGATRON_LM_PATH=args.megatron_lm,
                       PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             *command], env=environment, cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{command[0]} failed:\n{(result.stdout + result.stderr)[-4000:]}")
    return result.stdout + result.stderr


def entry(args) -> float:
    output = torchrun(args, ["-m", "ascendspeed.training.pretrain_gpt", *ENTRY_FLAGS,
                             "--train-iters", str(args.train_iters), "--log-interval", str(args.log_interval),
                             "--eval-interval", "0", "--eval-iters", "1", "--eval-seq-lengths", str(SEQUENCE)])
    reports = [float(value.replace(",", "")) for value in ENTRY_TOKENS_PER_SECOND.findall(output)]
    return statistics.median(reports[1:])


def megatron_lm(args, launcher: str) -> float:
    output = torchrun(args, [launcher, *MEGATRON_LM_FLAGS, *args.megatron_lm_args.split(),
                             "--train-iters", str(args.train_iters), "--log-interval", str(args.log_interval)])
    milliseconds = [float(value) for value in MEGATRON_LM_ITERATION_MS.findall(output)]
    return statistics.median(GLOBAL_BATCH * SEQUENCE / (ms / 1e3) for ms in milliseconds[1:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron-lm", default=os.environ.get(
        "MEGATRON_LM_PATH", os.path.join(REPO, "..", "shared", "megatron-lm", "core_v0.19.0")))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--train-iters", type=int, default=60)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--megatron-lm-args", default="",
                        help="more Megatron-LM flags, e.g. '--num-workers 2' (Megatron-LM's GPU default)")
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args(argv)
    args.megatron_lm = os.path.abspath(args.megatron_lm)
    runs = {"entry": [], "megatron_lm": []}
    with tempfile.TemporaryDirectory() as directory:
        launcher = os.path.join(directory, "pretrain_gpt_with_ascendspeed.py")
        with open(launcher, "w") as handle:
            handle.write(LAUNCHER)
        for round_index in range(args.rounds):
            order = ("entry", "megatron_lm") if round_index % 2 == 0 else ("megatron_lm", "entry")
            for name in order:
                runs[name].append(entry(args) if name == "entry" else megatron_lm(args, launcher))
                print(f"round {round_index + 1}/{args.rounds} {name:<12}{runs[name][-1]:>10,.0f} tokens/s "
                      f"(load {load_average():.2f})", flush=True)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    ratio = medians["megatron_lm"] / medians["entry"]
    paired = statistics.median(ours / entry_rate for ours, entry_rate in zip(runs["megatron_lm"], runs["entry"]))
    print(f"Megatron-LM pretrain_gpt.py {medians['megatron_lm']:,.0f} tokens/s, the entry {medians['entry']:,.0f}: "
          f"{ratio:.3f}x (paired by round: {paired:.3f}x)")
    if args.output:
        import torch

        with open(args.output, "w") as handle:
            json.dump({"machine": machine(torch), "megatron_lm": args.megatron_lm, "runs": runs, "medians": medians,
                       "megatron_lm_over_entry": ratio,
                       "megatron_lm_over_entry_paired": paired, "options": vars(args)}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
