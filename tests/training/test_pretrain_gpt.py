"""The pretraining entry end to end on 2 CPU processes: real megatron-core, real gloo, no mocks."""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.compiled import with_torch_compile
from tests.helpers.distributed import run_distributed

REPO = Path(__file__).resolve().parents[2]

#: A model small enough for a few seconds of training on two CPU cores.
TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--micro-batch-size", "4", "--lr", "5e-3", "--min-lr", "5e-4", "--lr-warmup-iters", "3",
    "--eval-iters", "2",
]

PROGRESS = re.compile(
    r"^iteration +(\d+)/(\d+) \| loss (\d+\.\d+) \| lr (\S+) \| grad norm \S+ \| activations \d+\.\d MiB \| "
    r"([\d,]+) tokens/s \| "
    r"elapsed \d+:\d\d:\d\d \| ETA \d+:\d\d:\d\d$",
    re.MULTILINE,
)


MEGATRON_DEFAULTS = ("--position-embedding-type", "learned_absolute", "--no-swiglu", "--no-overlap-grad-reduce")


@pytest.mark.parametrize("flags", [(), MEGATRON_DEFAULTS], ids=["default_job", "megatron_defaults"])
def test_torchrun_two_processes_train_and_report(flags):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "ascendspeed.training.pretrain_gpt", *TINY, *flags,
        "--train-iters", "30", "--log-interval", "10", "--eval-interval", "15", "--eval-seq-lengths", "64", "128",
    ]
    env = dict(with_torch_compile(), ASCENDSPEED_DEVICE="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout

    lines = PROGRESS.findall(out)
    assert [int(line[0]) for line in lines] == [10, 20, 30], out
    assert all(int(line[1]) == 30 for line in lines)
    losses = [float(line[2]) for line in lines]
    assert losses[-1] < losses[0] < math.log(256)
    assert out.count("iteration 10/30") == 1, "progress is printed by rank 0 only"

    validation = [float(v) for v in re.findall(r"^validation at iteration \d+ \| loss (\d+\.\d+)", out, re.M)]
    assert len(validation) == 3
    assert validation[0] == pytest.approx(math.log(256), abs=0.3)
    assert validation[-1] < validation[0] - 1.5
    assert re.search(r"^ +64 +\d+\.\d+ +\d+\.\d+$", out, re.M), out
    if flags:
        assert "ascendspeed features: fused_attention " in out  # Megatron's default --attention-backend auto
        assert re.search(r"^ +128 +skipped: learned_absolute position embeddings have 64 positions", out, re.M), out
    else:  # the default job: ALiBi, fused SwiGLU, overlapped gradient reduction; ALiBi evaluates past 64 tokens
        assert "ascendspeed features: fused_attention, async_ddp, alibi, fused_swiglu " in out
        assert re.search(r"^ +128 +\d+\.\d+ +\d+\.\d+$", out, re.M), out


def _checkpoint_worker(rank, world_size, directory, extra):
    from ascendspeed.training.arguments import parse_args
    from ascendspeed.training.trainer import train

    def run(*flags):
        args = parse_args([*TINY, *extra, "--log-interval", "100", "--eval-interval", "0",
                           "--eval-seq-lengths", "64", "--split", "998,2", *flags], world_size=world_size)
        return train(args)

    straight = run("--train-iters", "8")
    half = run("--train-iters", "4", "--lr-decay-iters", "8", "--save", directory)
    resumed = run("--train-iters", "8", "--load", directory)
    return {
        "straight": straight.losses,
        "straight_lr": straight.learning_rates,
        "half": half.losses,
        "resumed": resumed.losses,
        "resumed_lr": resumed.learning_rates,
        "resumed_start": resumed.start_iteration,
        "checkpoint": half.checkpoint,
        "load_balancing_loss": straight.progress[-1].get("load_balancing_loss"),
    }


#: Mixture of experts: 4 experts over 2 expert-parallel ranks (each saves its own), alltoall with the fused
#: permutation, top-2 with the load-balancing loss, the distributed optimizer.
MOE_EP2 = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
           "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall", "--moe-permute-fusion",
           "--use-distributed-optimizer"]


#: MoE layers over 2 pipeline stages, the experts grouped (TEGroupedMLP on ascendspeed's grouped linears).
MOE_PP2_GROUPED = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
                   "--pipeline-model-parallel-size", "2", "--moe-grouped-gemm", "--no-bias-dropout-fusion"]


@pytest.mark.parametrize("extra", [[], ["--use-distributed-optimizer", "--bf16"], MOE_EP2, MOE_PP2_GROUPED],
                         ids=["fp32", "distopt-bf16", "moe-ep2", "moe-pp2-grouped"])
def test_resuming_from_a_checkpoint_continues_the_loss_curve(tmp_path, extra):
    results = run_distributed(_checkpoint_worker, 2, str(tmp_path), extra, timeout=240)
    result = results[0]
    assert result["resumed_start"] == 4
    assert Path(result["checkpoint"]).name == "iter_0000004"
    saved = {p.name for p in Path(result["checkpoint"]).iterdir()}  # Megatron's torch_dist format and the record
    assert {".metadata", "metadata.json", "ascendspeed_record.json"} <= saved and any(
        name.endswith(".distcp") for name in saved), saved
    assert result["half"] == result["straight"][:4]
    assert result["resumed"] == pytest.approx(result["straight"][4:], rel=1e-6, abs=1e-6)
    assert result["resumed_lr"] == pytest.approx(result["straight_lr"][4:])
    assert results[1]["resumed"] == result["resumed"]
    # the routers' load-balancing loss in the progress line (about 1 for balanced routing), MoE runs only
    if "--num-experts" in extra:
        assert 0.9 < result["load_balancing_loss"] < 2.0, result["load_balancing_loss"]
    else:
        assert result["load_balancing_loss"] is None
