"""The entry's parallel layouts train the same model: TP=2 (with and without sequence parallelism), PP=2 with
virtual stages, CP=2 and the rest match DP=2.

Each layout starts from the reference's initial weights (sliced and distributed as the layout needs),
sees the same global batches, and must produce the same training and validation losses.
"""
import functools
import re

import pytest

from tests.helpers.distributed import run_distributed

BASE = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "3e-3", "--lr-warmup-iters", "1", "--train-iters", "10",
]

VALIDATION_WINDOWS = 64

LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "tp2-sp-coc": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-ascend-coc",
                   "--coc-parallel-num", "4"],
    "tp2-coc": ["--tensor-model-parallel-size", "2", "--use-ascend-coc"],
    "pp2-vpp2": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    "dp2-distopt-overlap": ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "5000"],
    "cp2": ["--context-parallel-size", "2"],
    "cp2-ulysses": ["--context-parallel-size", "2", "--context-parallel-algo", "ulysses_cp_algo"],
    "pp2-cp2-hybrid": ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2",
                       "--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "2"],
}


def _tied_name(name: str) -> str:
    """A pipelined last stage holds its own copy of the tied output weight: the word embedding."""
    return "embedding.word_embeddings.weight" if name == "output_layer.weight" else name


def _run(args, full=None, steps=3):
    import torch
    from tests.helpers import megatron as mu
    from ascendspeed.features import apply_features, disable_features
    from ascendspeed.training.initialize import initialize_parallel, teardown
    from ascendspeed.training.trainer import Trainer

    apply_features(args)
    state = initialize_parallel(args)
    try:
        trainer = Trainer(args, state.device)
        if full is None:
            full = {name: param.detach().clone() for name, param in mu.named_parameters_full(trainer.model)}
        else:
            config = trainer.config
            with torch.no_grad():
                for name, param in mu.named_parameters_full(trainer.model):
                    param.copy_(mu.shard_like(full[_tied_name(name)], param, name, config))
        losses = [trainer.train_step()[0] for _ in range(steps)]
        # The first 64 held-out windows (a multiple of every layout's micro-batches x data-parallel ranks):
        # the whole split would cost twice the training steps, and 4096 tokens tell the layouts apart as well.
        validation = [trainer.evaluator.evaluate(length, max_windows=VALIDATION_WINDOWS).loss for length in (32, 64)]
        return full, losses, validation + [trainer.num_parameters()]
    finally:
        teardown(state)
        disable_features()  # the next layout applies its own settings


def _layouts_worker(rank, world_size, names):
    from ascendspeed.training.arguments import parse_args

    full, losses, validation = _run(parse_args(BASE, world_size=world_size))
    results = {"reference": (losses, validation)}
    for name in names:
        _, losses, validation = _run(parse_args(BASE + LAYOUTS[name], world_size=world_size), full)
        results[name] = (losses, validation)
    return results


TWO_RANK_LAYOUTS = ["tp2", "tp2-sp", "tp2-sp-coc", "tp2-coc", "pp2-vpp2", "dp2-distopt-overlap", "cp2", "cp2-ulysses"]


@functools.cache
def _two_rank_layouts():
    """The reference and every 2-rank layout in one job (the reference trains once)."""
    return run_distributed(_layouts_worker, 2, TWO_RANK_LAYOUTS, timeout=600)


@pytest.mark.parametrize("name", TWO_RANK_LAYOUTS)
def test_layouts_match_the_data_parallel_reference(name):
    results = _two_rank_layouts()
    reference_losses, reference_validation = results[0]["reference"]
    assert reference_losses[-1] < reference_losses[0]
    for rank_result in results:
        losses, validation = rank_result[name]
        assert losses == pytest.approx(reference_losses, rel=2e-5), name
        assert validation == pytest.approx(reference_validation, rel=2e-5), name  # and parameter count


@pytest.mark.slow
def test_pipeline_and_context_parallel_match_the_data_parallel_reference():
    """4 ranks: PP 2 x CP 2 (hybrid) against DP 4. Validation at twice the length is left out: DP 4 deals the
    held-out windows in multiples of 4, so it evaluates fewer of them than a single replica does."""
    results = run_distributed(_layouts_worker, 4, ["pp2-cp2-hybrid"], timeout=600)
    reference_losses, (reference_validation, _, reference_parameters) = results[0]["reference"]
    for rank_result in results:
        losses, (validation, _, parameters) = rank_result["pp2-cp2-hybrid"]
        assert losses == pytest.approx(reference_losses, rel=2e-5)
        assert validation == pytest.approx(reference_validation, rel=2e-5)
        assert parameters == reference_parameters


RING_LINE = (r"^\[cp-ring\] iteration (\d+) \| hops (\d+) \| sent [\d.]+ MiB \| ring comm [\d.]+ ms \| "
             r"exposed [\d.]+ ms \| hidden ([\d.]+) %$")


def _ring_overlap_worker(rank, world_size):
    import contextlib
    import io

    from ascendspeed.features import disable_features
    from ascendspeed.training.arguments import parse_args
    from ascendspeed.training.trainer import train

    flags = ["--context-parallel-size", "2", "--log-cp-ring-overlap", "--train-iters", "4", "--log-interval", "2",
             "--eval-iters", "1", "--eval-interval", "0", "--eval-seq-lengths", "32", "--split", "998,2"]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            result = train(parse_args([*BASE, *flags], world_size=world_size))
    finally:
        disable_features()
    return result.telemetry["cp_ring"], [entry["cp_ring"] for entry in result.progress], printed.getvalue()


def test_ring_overlap_is_reported_per_interval_and_for_the_run():
    """``--log-cp-ring-overlap``: a ``[cp-ring]`` line per logging interval and a run total, on rank 0; the
    same numbers from Python on every rank (sums over ranks). Validation's forward passes are not counted."""
    results = run_distributed(_ring_overlap_worker, 2, timeout=240)
    # per rank and training step: 4 layers x 4 micro-batches attention calls, each 1 K/V hop forward and
    # 1 K/V + 2 dK/dV hops backward (cp 2)
    hops_per_step = 2 * 4 * 4 * 4
    total, intervals, printed = results[0]
    assert total.hops == 4 * hops_per_step
    assert [interval["hops"] for interval in intervals] == [2 * hops_per_step] * 2
    assert total.sent_bytes > 0 and total.communication_s > 0 and 0.0 <= total.hidden_fraction <= 1.0
    assert sum(interval["exposed_s"] for interval in intervals) == pytest.approx(total.exposed_s)
    lines = re.findall(RING_LINE, printed, re.MULTILINE)
    assert [(int(iteration), int(hops)) for iteration, hops, _ in lines] == [(2, 2 * hops_per_step),
                                                                              (4, 2 * hops_per_step)], printed
    assert f"all 2 ranks: hops {total.hops} | " in printed
    other_total, other_intervals, other_printed = results[1]
    assert other_total == total and other_intervals == intervals
    assert "[cp-ring]" not in other_printed


TP_COMM_LINE = (r"^\[tp-comm\] iteration (\d+) \| collectives (\d+) \| [\d.]+ MiB \| tp comm [\d.]+ ms \| "
                r"exposed [\d.]+ ms \| hidden ([\d.]+) %$")


def _tp_comm_overlap_worker(rank, world_size):
    import contextlib
    import io

    from ascendspeed.features import disable_features
    from ascendspeed.training.arguments import parse_args
    from ascendspeed.training.trainer import train

    flags = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-ascend-coc", "--log-tp-comm-overlap",
             "--train-iters", "4", "--log-interval", "2", "--eval-iters", "1", "--eval-interval", "2",
             "--eval-seq-lengths", "32", "--split", "998,2"]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            result = train(parse_args([*BASE, *flags], world_size=world_size))
    finally:
        disable_features()
    return result.telemetry["tp_comm"], [entry["tp_comm"] for entry in result.progress], printed.getvalue()


def test_tp_communication_overlap_is_reported_per_interval_and_for_the_run():
    """``--log-tp-comm-overlap``: a ``[tp-comm]`` line per logging interval and a run total on rank 0, the same
    numbers on every rank; validation (every interval here) is not counted."""
    results = run_distributed(_tp_comm_overlap_worker, 2, timeout=240)
    total, intervals, printed = results[0]
    assert [interval["collectives"] for interval in intervals] == [total["collectives"] // 2] * 2
    # per rank, step and micro-batch: 4 layers x (2 column linears x 2 chunks x 3 collectives + 2 row linears x
    # 2 chunks x 2) + the output layer's 2 x 3; 4 micro-batches, 2 ranks
    assert total["collectives"] == 4 * 2 * 4 * (4 * (2 * 2 * 3 + 2 * 2 * 2) + 2 * 3)
    assert total["communication_s"] > 0 and 0.0 <= total["hidden_fraction"] <= 1.0
    assert sum(interval["exposed_s"] for interval in intervals) == pytest.approx(total["exposed_s"])
    lines = re.findall(TP_COMM_LINE, printed, re.MULTILINE)
    assert [(int(iteration), int(count)) for iteration, count, _ in lines] == [
        (2, intervals[0]["collectives"]), (4, intervals[1]["collectives"])], printed
    assert f"all 2 ranks: collectives {total['collectives']} | " in printed
    assert results[1][0] == total and results[1][1] == intervals and "[tp-comm]" not in results[1][2]
