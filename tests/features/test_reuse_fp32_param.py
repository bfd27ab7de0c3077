"""``--reuse-fp32-param``: the exact bit split, flag validation, bit-identical training against
megatron-core's own optimizers (DP=2, gloo), checkpoints across the flag, and the memory account."""
from __future__ import annotations

import argparse
import os

import pytest
import torch

from tests.helpers.distributed import call, run_distributed_cases

from ascendspeed.features import FeatureArgumentError
from ascendspeed.features.reuse_fp32_param import FEATURE
from ascendspeed.ops.bf16_split import bf16_join_, bf16_split_, join_reference, split_reference


def _rne_high(bits: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even of fp32 bit patterns to bf16, in int64 integer arithmetic (the definition)."""
    unsigned = bits.to(torch.int64) & 0xFFFFFFFF
    rounded = (unsigned + 0x7FFF + ((unsigned >> 16) & 1)) >> 16
    return rounded & 0xFFFF


def _patterns() -> torch.Tensor:
    """fp32 bit patterns: every upper half with the interesting lower halves (ties, their neighbours,
    zero, all ones, random), and every lower half under interesting upper halves (zeros, denormals,
    the largest finite values, infinities, NaNs, both parities, both signs)."""
    generator = torch.Generator().manual_seed(0)
    every = torch.arange(1 << 16, dtype=torch.int64)
    lows = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    lows = torch.cat([lows, torch.randint(0, 1 << 16, (10,), generator=generator)])
    highs = torch.tensor([0x0000, 0x0001, 0x0002, 0x007F, 0x0080, 0x3F80, 0x3F81, 0x7F7E, 0x7F7F, 0x7F80,
                          0x7F81, 0x7FC0, 0x7FFF], dtype=torch.int64)
    highs = torch.cat([highs, highs | 0x8000, torch.randint(0, 1 << 16, (16,), generator=generator)])
    grid = [(every[:, None] << 16 | lows[None, :]).flatten(), (highs[:, None] << 16 | every[None, :]).flatten(),
            torch.randint(0, 1 << 32, (1 << 20,), generator=generator)]
    return torch.cat(grid).to(torch.int32)  # int64 -> int32 keeps the low 32 bits


def _split_by_operator(main: torch.Tensor):
    """``(high, low, ties)`` of fp32 ``main`` by the layout switch's operator (main is left as it is)."""
    halves, low = main.view(torch.int16).clone(), torch.empty(main.numel(), dtype=torch.int16)
    ties = bf16_split_(halves, 0, low)
    return halves[: main.numel()], low, ties


def _join_by_operator(high, low, ties):
    halves = torch.empty(2 * high.numel(), dtype=torch.int16)
    halves[: high.numel()] = high
    bf16_join_(halves, ties, 0, low)
    return halves.view(torch.float32)


def _join_by_reference(high, low, ties):
    out = torch.empty(high.numel(), 2, dtype=torch.int16)
    return join_reference(high, low, ties, out).view(torch.float32).view(-1)


SPLITS = {"operator": (_split_by_operator, _join_by_operator), "reference": (split_reference, _join_by_reference)}


@pytest.mark.parametrize("implementation", list(SPLITS))
def test_split_is_exact_and_rounds_like_megatron(implementation):
    split, join = SPLITS[implementation]
    bits = _patterns()
    main = bits.view(torch.float32)
    high, low, ties = split(main)
    restored = join(high, low, ties)
    nan = torch.isnan(main)
    assert torch.equal(restored.view(torch.int32)[~nan], bits[~nan]), "fp32 restored exactly (all but NaN)"
    assert torch.isnan(restored[nan]).all() and nan.sum() > 0, "NaN stays NaN"
    megatron = torch.empty_like(main, dtype=torch.bfloat16)
    megatron.copy_(main)  # what Float16OptimizerWithFloat16Params does to the model weight
    assert torch.equal(high, megatron.view(torch.int16))
    assert torch.equal(high.to(torch.int64)[~nan] & 0xFFFF, _rne_high(bits)[~nan]), "round to nearest even"
    tie_rounded_down = ((bits.to(torch.int64) & 0xFFFF) == 0x8000) & (((bits.to(torch.int64) >> 16) & 1) == 0)
    assert torch.equal(ties[~nan[ties]], torch.nonzero(tie_rounded_down & ~nan).flatten())
    assert ties.numel() > 30000, "the tie positions are exercised (every even upper half)"


@pytest.mark.skipif(not os.environ.get("ASCENDSPEED_EXHAUSTIVE"),
                    reason="all 2^32 patterns take minutes; set ASCENDSPEED_EXHAUSTIVE=1")
def test_split_is_exact_for_every_fp32_pattern():
    chunk = 1 << 24
    offsets = torch.arange(chunk, dtype=torch.int64)
    for first in range(0, 1 << 32, chunk):
        bits = (offsets + first).to(torch.int32)
        main = bits.view(torch.float32)
        high, low, ties = _split_by_operator(main)
        restored = _join_by_operator(high, low, ties).view(torch.int32)
        nan = torch.isnan(main)
        assert torch.equal(restored[~nan], bits[~nan]), hex(first)
        assert torch.isnan(restored.view(torch.float32)[nan]).all(), hex(first)
        assert torch.equal(high.to(torch.int64)[~nan] & 0xFFFF, _rne_high(bits)[~nan]), hex(first)


@pytest.fixture(params=[1, 3], ids=["1-thread", "3-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_piecewise_read_and_write_keep_ties_of_other_pieces(threads):
    from ascendspeed.features.reuse_fp32_param.storage import ParameterUnit

    generator = torch.Generator().manual_seed(1)
    values = torch.randint(0, 1 << 32, (4096,), generator=generator).to(torch.int32)
    values[::7] = (values[::7] & ~0x1FFFF) | 0x8000  # ties that round down (even upper half)
    param = torch.nn.Parameter(torch.zeros(64, 64, dtype=torch.bfloat16))
    unit = ParameterUnit([param])
    finite = values.view(torch.float32).isfinite()
    values[~finite] = 0
    unit.write(values.view(torch.float32)[:3000])
    unit.write(values.view(torch.float32)[3000:], start=3000)
    assert torch.equal(unit.read().view(torch.int32), values)
    assert torch.equal(unit.read(1000, 3500).view(torch.int32), values[1000:3500])
    assert torch.equal(param.detach().reshape(-1).view(torch.int16), values.view(torch.float32).to(torch.bfloat16).view(torch.int16))
    assert param.untyped_storage().data_ptr() == unit.main_params()[0].untyped_storage().data_ptr()
    unit.to_main_layout()
    assert torch.equal(unit.main_params()[0].reshape(-1).view(torch.int32), values)
    unit.to_model_layout()
    assert torch.equal(unit.read().view(torch.int32), values)


def test_grouped_parameters_share_one_buffer_and_read_back_exactly(threads):
    from ascendspeed.features.reuse_fp32_param.storage import ParameterUnit, group_parameters

    generator = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator).to(torch.bfloat16))
              for shape in ((3, 5), (7,), (4, 4), (1,))]
    expected = [p.detach().clone() for p in params]
    groups = group_parameters(params, max_elements=22)
    assert [len(g) for g in groups] == [2, 2]
    unit = ParameterUnit(groups[0])
    assert params[0].untyped_storage().data_ptr() == params[1].untyped_storage().data_ptr()
    for param, main, before in zip(groups[0], unit.main_params(), expected):
        assert torch.equal(param.detach(), before)
    unit.to_main_layout()
    for main, before in zip(unit.main_params(), expected):
        assert torch.equal(main, before.float())
        main.add_(torch.randn(main.shape, generator=generator))
    updated = [main.clone() for main in unit.main_params()]
    unit.to_model_layout()
    for param, (start, end), value in zip(groups[0], unit.ranges(), updated):
        assert torch.equal(param.detach(), value.to(torch.bfloat16))
        assert torch.equal(unit.read(start, end).view(value.shape), value)


def _args(**settings) -> argparse.Namespace:
    from ascendspeed.features import default_arguments

    args = default_arguments()
    for key, value in settings.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize("settings, message", [
    (dict(), "--reuse-fp32-param needs --bf16"),
    (dict(bf16=True, fp16=True), "--fp16"),
    (dict(bf16=True, overlap_param_gather=True), "--overlap-param-gather"),
    (dict(bf16=True, use_precision_aware_optimizer=True), "--use-precision-aware-optimizer"),
    (dict(bf16=True, log_params_norm=True), "--log-params-norm"),
    (dict(bf16=True, use_distributed_optimizer=True, data_parallel_size=1), "data-parallel size of at least 2"),
])
def test_validation_names_the_flags(settings, message):
    with pytest.raises(FeatureArgumentError, match=message):
        FEATURE.validate(_args(reuse_fp32_param=True, **settings))


def test_validation_accepts_bf16_and_the_entry_registers_the_flag():
    FEATURE.validate(_args(reuse_fp32_param=True, bf16=True, use_distributed_optimizer=True, data_parallel_size=2))
    from ascendspeed.training.arguments import parse_args

    args = parse_args(["--bf16", "--reuse-fp32-param"], world_size=1, device="cpu")
    assert args.reuse_fp32_param
    with pytest.raises(SystemExit):
        parse_args(["--reuse-fp32-param"], world_size=1, device="cpu")


STEPS = 50
OPTIMIZERS = {"float16-optimizer": [], "distributed-optimizer": ["--use-distributed-optimizer"]}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """Every 2-rank run of this module in one job: 50 steps with each optimizer, checkpoints with each."""
    from tests.helpers.reuse_fp32_param import exactness_worker

    directory = tmp_path_factory.mktemp("reuse_fp32_param")
    cases = [(exactness_worker, bool(extra), STEPS) for extra in OPTIMIZERS.values()]
    cases += [(_checkpoint_worker, str(directory / name), extra) for name, extra in OPTIMIZERS.items()]
    per_case = run_distributed_cases(call, 2, cases, timeout=1800)
    return {"exactness": dict(zip(OPTIMIZERS, per_case[:2])), "checkpoints": dict(zip(OPTIMIZERS, per_case[2:]))}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_fifty_steps_bit_identical_to_megatron(two_rank_runs, optimizer):
    steps = STEPS
    for report in two_rank_runs["exactness"][optimizer]:
        reference, reused = report["losses"]
        assert reused == reference, "losses bit-identical"
        assert report["main"] == [0] * steps, "fp32 main weights bit-identical after every step"
        assert report["model"] == [0] * steps, "bf16 model weights bit-identical after every step"
        assert report["shared"], "the main weights really share the model weights' memory"
        assert report["ties"] > 0, "ties that round down occurred and were restored"


def _checkpoint_worker(rank, world_size, directory, extra):
    from ascendspeed.features import disable_features
    from ascendspeed.training.arguments import parse_args
    from ascendspeed.training.trainer import train

    tiny = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--lr", "5e-3", "--min-lr", "5e-4", "--lr-warmup-iters", "2",
            "--eval-iters", "1", "--log-interval", "100", "--eval-interval", "0", "--eval-seq-lengths", "32",
            "--split", "998,2",
            "--bf16", "--lr-decay-iters", "8", *extra]

    def run(reuse, *flags):
        args = parse_args([*tiny, *(["--reuse-fp32-param"] if reuse else []), *flags], world_size=world_size)
        try:
            return train(args)
        finally:
            disable_features(["reuse_fp32_param"])

    plain, reused = run(False, "--train-iters", "8"), run(True, "--train-iters", "8")
    with_flag, without_flag = f"{directory}/with", f"{directory}/without"
    first_half = run(True, "--train-iters", "4", "--save", with_flag)
    run(False, "--train-iters", "4", "--save", without_flag)
    return {
        "plain": plain.losses,
        "reused": reused.losses,
        "first_half": first_half.losses,
        "resumed with -> with": run(True, "--train-iters", "8", "--load", with_flag).losses,
        "resumed with -> without": run(False, "--train-iters", "8", "--load", with_flag).losses,
        "resumed without -> with": run(True, "--train-iters", "8", "--load", without_flag).losses,
        "memory": (plain.memory_account, reused.memory_account),
    }


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_checkpoints_resume_the_same_trajectory_across_the_flag(two_rank_runs, optimizer):
    extra = OPTIMIZERS[optimizer]
    for result in two_rank_runs["checkpoints"][optimizer]:
        assert result["reused"] == result["plain"]
        assert result["first_half"] == result["plain"][:4]
        for key in ("resumed with -> with", "resumed with -> without", "resumed without -> with"):
            assert result[key] == pytest.approx(result["plain"][4:], rel=1e-6, abs=1e-6), key
        plain, reused = result["memory"]
        assert reused.model_weights == plain.model_weights and reused.gradients == plain.gradients
        assert reused.optimizer_state == plain.optimizer_state
        saved = plain.bytes_per_parameter - reused.bytes_per_parameter
        if extra:
            assert saved == pytest.approx(2 / 2, rel=0.05), "2/DP bytes per parameter with the distributed optimizer"
        else:
            assert saved == pytest.approx(2.0, abs=0.01), "2 bytes per parameter (less 8 per kept tie)"
