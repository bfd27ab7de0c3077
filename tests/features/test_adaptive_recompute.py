"""Adaptive recompute (``--adaptive-recompute-device-size``): the solver against brute force on synthetic layer
profiles, and the pretraining entry on two pipeline stages (1F1B: the first stage holds two micro-batches, the
second one), where every plan trains exactly as without recompute, the measured peak stays within budgets
between the full-recompute and the no-recompute peaks, the stages choose different plans for the same budget,
and a budget below full recompute is refused at the end of profiling naming the minimum; then interleaved
stages of MoE layers, and context parallelism over both ranks, whose ranks (one stage) agree on one plan.
The profiling steps include one recomputing every layer's norms, core attention and MLP.
"""
import itertools
import random

import pytest

from ascendspeed.features import FeatureArgumentError, all_features, default_arguments
from ascendspeed.features.adaptive_recompute import solver
from tests.helpers.distributed import run_distributed

MIB = 2**20


def _random_layer(rng, mlp_recompute=True, norms=True):
    none = rng.randint(50, 100)
    attention = none - rng.randint(0, 30)
    saved = {solver.NONE: none, solver.ATTENTION: attention, solver.ATTENTION_MLP: attention - rng.randint(0, 20),
             solver.FULL: rng.randint(1, 10)}
    seconds = {solver.NONE: 0.0, solver.ATTENTION: rng.random(), solver.ATTENTION_MLP: 0.5 + 2 * rng.random(),
               solver.FULL: 3 + rng.random()}
    if not mlp_recompute:
        del saved[solver.ATTENTION_MLP], seconds[solver.ATTENTION_MLP]
    if norms:
        norms_saved, norms_seconds = rng.randint(0, 15), 0.1 * rng.random()
        for option in [option for option in saved if option != solver.FULL]:
            with_norms = solver.selective_option(solver.recomputed_parts(option) | {"norms"})
            saved[with_norms] = max(1, saved[option] - norms_saved)
            seconds[with_norms] = seconds[option] + norms_seconds
    return solver.LayerProfile(saved, seconds)


def _brute_force(chunks, units, allowed):
    """Every option per layer with the same full prefix in every chunk; the cheapest that fits."""
    flat = [layer for chunk in chunks for layer in chunk]
    best = None
    for options in itertools.product(*(list(layer.saved_bytes) for layer in flat)):
        prefixes, start, valid = set(), 0, True
        for chunk in chunks:
            mine = options[start:start + len(chunk)]
            start += len(chunk)
            full = next((i for i, option in enumerate(mine) if option != solver.FULL), len(mine))
            valid &= solver.FULL not in mine[full:]
            prefixes.add(full)
        if not valid or len(prefixes) > 1:
            continue
        plan = solver.plan_of(chunks, options, units)
        if plan.peak_bytes <= allowed and (best is None or plan.recompute_seconds < best.recompute_seconds):
            best = plan
    return best


def test_solver_finds_the_cheapest_plan_that_fits():
    rng = random.Random(0)
    for _ in range(300):
        chunks = [[_random_layer(rng, mlp_recompute=rng.random() > 0.2, norms=rng.random() > 0.2)
                   for _ in range(rng.randint(1, 3))] for _ in range(rng.choice((1, 1, 2)))]
        layers = sum(len(chunk) for chunk in chunks)
        units = rng.randint(1, 3)
        allowed = rng.randint(0, 100 * layers * units)
        expected, found = _brute_force(chunks, units, allowed), solver.solve(chunks, units, allowed)
        assert (expected is None) == (found is None), (expected, found)
        if expected is not None:
            assert found.recompute_seconds == pytest.approx(expected.recompute_seconds, abs=1e-12)
            assert found.peak_bytes == solver.peak_bytes(chunks, found.options, units) <= allowed


def test_solver_scales_to_deep_models():
    rng = random.Random(1)
    layer = _random_layer(rng)
    chunks = [[layer] * 96]
    none, full = layer.saved_bytes[solver.NONE] * 96, layer.saved_bytes[solver.FULL] * 96
    plan = solver.solve(chunks, 4, 4 * (none + full) // 2)
    assert plan is not None and plan.peak_bytes == solver.peak_bytes(chunks, plan.options, 4) <= 4 * (none + full) // 2
    assert solver.solve(chunks, 4, 4 * full - 1) is None


#: Activations of some MiB per micro-batch, so budgets a few MiB apart (the flag counts MiB) choose other plans.
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "256",
        "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "3e-3", "--lr-warmup-iters", "1",
        "--train-iters", "8", "--log-interval", "6", "--eval-interval", "0", "--eval-iters", "1",
        "--split", "998,2", "--eval-seq-lengths", "256", "--pipeline-model-parallel-size", "2"]
PROFILING = ["--adaptive-recompute-profiling-step", "6"]
FRACTIONS = (0.25, 0.5, 0.75)
#: Two model chunks per stage (interleaved 1F1B) of MoE layers.
VPP_MOE = ["--num-layers-per-virtual-pipeline-stage", "1", "--num-experts", "4", "--moe-router-topk", "2",
           "--moe-aux-loss-coeff", "1e-2"]
#: Context parallelism over both ranks (one pipeline stage): each rank holds half of every sequence.
CP2 = ["--pipeline-model-parallel-size", "1", "--context-parallel-size", "2"]


def _train(flags):
    from ascendspeed.features import applied_features, disable_features
    from ascendspeed.training.arguments import parse_args
    from ascendspeed.training.trainer import train

    try:
        result = train(parse_args([*BASE, *flags], world_size=2))
        controllers = [feature.state for feature in applied_features() if feature.name == "adaptive_recompute"]
        return result, (controllers[0] if controllers else None)
    finally:
        disable_features()


def _bounds(probe):
    """The full-recompute and no-recompute peaks, the larger of both stages'."""
    import torch
    import torch.distributed as dist

    bounds = torch.tensor([probe.minimum_bytes, probe.none_peak_bytes], dtype=torch.float64)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    return bounds.tolist()


def _halfway_run(flags):
    """Without the feature, then at a budget halfway between the full-recompute and no-recompute peaks."""
    reference, _ = _train(flags)
    _, probe = _train([*flags, "--adaptive-recompute-device-size", str(10**6), *PROFILING])
    low, high = _bounds(probe)
    budget_mib = int((low + 0.5 * (high - low)) / MIB) + 1
    result, controller = _train([*flags, "--adaptive-recompute-device-size", str(budget_mib), *PROFILING])
    return {"reference": reference.losses, "losses": result.losses, "budget": budget_mib * MIB,
            "plan": controller.plan.options, "predicted": controller.predicted_peak,
            "measured": controller.measured_peak, "units": controller.units}


def _job(rank, world_size):
    reference, _ = _train([])
    probed, probe = _train(["--adaptive-recompute-device-size", str(10**6), *PROFILING])
    low, high = _bounds(probe)  # budgets between full recompute and none, feasible on both stages
    runs = {}
    for fraction in FRACTIONS:
        budget_mib = int((low + fraction * (high - low)) / MIB) + 1
        result, controller = _train(["--adaptive-recompute-device-size", str(budget_mib), *PROFILING])
        runs[fraction] = {"budget": budget_mib * MIB, "losses": result.losses, "plan": controller.plan.options,
                          "predicted": controller.predicted_peak, "measured": controller.measured_peak,
                          "activations": result.activations, "static": result.memory_account.total}
    try:
        _train(["--adaptive-recompute-device-size", str(max(1, int(low / MIB) - 1)), *PROFILING])
        refusal = None
    except FeatureArgumentError as error:
        refusal = str(error)
    return {"reference": reference.losses, "bounds": (low, high), "runs": runs, "refusal": refusal,
            "minimum": probe.minimum_bytes, "units": probe.units, "reference_activations": reference.activations,
            "profiles": probe.profiles,
            "first_step_activations": probed.activations[0][1],
            "vpp_moe": _halfway_run(VPP_MOE),
            "cp2": _halfway_run(CP2),
            "stage_agreement": _stage_agreement(rank),
            # the controller's step-1 peak: static (no optimizer state yet: Adam allocates it in the step) + activations
            "first_step_peak": probe.peaks["none"][0] - (probed.memory_account.total
                                                         - probed.memory_account.optimizer_state)}


@pytest.fixture(scope="module")
def job():
    return run_distributed(_job, 2, timeout=600)


def _stage_agreement(rank):
    """``agreed_within_stage`` on two ranks of one stage (TP 1, CP 2) that measured different profiles."""
    from megatron.core import parallel_state

    from ascendspeed.features.adaptive_recompute.controller import agreed_within_stage

    layers = [_random_layer(random.Random(rank * 100 + i), mlp_recompute=i != 1) for i in range(3)]
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    try:
        agreed, counts = agreed_within_stage([layers[:2], layers[2:]], 10 + rank, 7 * (1 - rank))
    finally:
        parallel_state.destroy_model_parallel()
    return {"mine": [[layers[0], layers[1]], [layers[2]]], "agreed": agreed, "counts": counts}


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_every_plan_trains_as_without_recompute_within_the_budget(job, fraction):
    for rank, result in enumerate(job):
        run = result["runs"][fraction]
        assert run["losses"] == result["reference"], f"rank {rank}: recompute changed the losses"
        assert run["measured"] <= run["predicted"] <= run["budget"], (rank, run)


def test_the_entry_reports_the_activations_the_plan_kept(job):
    for rank, result in enumerate(job):
        # step 1 profiles without recompute: the entry's account (around the step) and the controller's (inside
        # it) count the same bytes, and so does a run without the feature
        assert result["first_step_activations"] == result["first_step_peak"] > 0, rank
        (first, without), *_ = result["reference_activations"]
        assert first == 1 and without == result["first_step_activations"]
        for fraction, run in result["runs"].items():
            (_, step_1), (iteration, with_plan) = run["activations"]
            assert iteration == 7 and step_1 == without, (rank, fraction)
            # the step after the plan's measured one keeps what the measured one kept
            assert with_plan == run["measured"] - run["static"], (rank, fraction)
            recomputes = any(option != "none" for option in run["plan"])
            assert with_plan < without if recomputes else with_plan == without, (rank, fraction, run["plan"])


def test_interleaved_stages_of_moe_layers_train_as_without_recompute_within_the_budget(job):
    for rank, result in enumerate(job):
        run = result["vpp_moe"]
        assert len(run["plan"]) == 2, "two model chunks of one MoE layer each"
        assert run["losses"] == run["reference"], f"rank {rank}: recompute changed the losses"
        assert run["measured"] <= run["predicted"] <= run["budget"], (rank, run)


def test_context_parallel_layers_train_as_without_recompute_within_the_budget(job):
    # the ranks of a stage must recompute the same layers: a layer recomputed on one CP rank only would run
    # ring exchanges its peer never joins (this hung when each rank solved its own timings)
    assert job[0]["cp2"]["plan"] == job[1]["cp2"]["plan"]
    for rank, result in enumerate(job):
        run = result["cp2"]
        assert len(run["plan"]) == 4 and set(run["plan"]) != {"none"}, run["plan"]
        assert run["losses"] == run["reference"], rank
        assert run["measured"] <= run["predicted"] <= run["budget"], (rank, run)


def test_the_ranks_of_a_stage_solve_the_largest_of_their_measurements(job):
    first, second = (result["stage_agreement"] for result in job)
    assert first["agreed"] == second["agreed"] and first["counts"] == second["counts"] == (11, 7)
    for chunk, (mine, theirs, agreed) in enumerate(zip(first["mine"], second["mine"], first["agreed"])):
        for layer, (a, b, both) in enumerate(zip(mine, theirs, agreed)):
            assert both.saved_bytes == {option: max(a.saved_bytes[option], b.saved_bytes[option])
                                        for option in a.saved_bytes}, (chunk, layer)
            assert both.recompute_seconds == {option: max(a.recompute_seconds[option], b.recompute_seconds[option])
                                              for option in a.recompute_seconds}, (chunk, layer)
    assert solver.ATTENTION_MLP not in first["agreed"][0][1].saved_bytes, "a layer without MLP recompute keeps none"


def test_recomputing_the_norms_saves_their_outputs(job):
    # each layer's two norms give back their outputs (kept by the next linear or the MLP's checkpoint): a
    # [seq, micro-batch, hidden] fp32 tensor each, freed in forward and recomputed in backward
    output_bytes = 256 * 4 * 64 * 4
    for rank, result in enumerate(job):
        for layer in (layer for chunk in result["profiles"] for layer in chunk):
            saved = layer.saved_bytes
            for option in (solver.NONE, solver.ATTENTION, solver.ATTENTION_MLP):
                with_norms = solver.selective_option(solver.recomputed_parts(option) | {"norms"})
                assert 2 * output_bytes <= saved[option] - saved[with_norms] <= 3 * output_bytes, (rank, option)
                assert layer.recompute_seconds[with_norms] > layer.recompute_seconds[option], (rank, option)


def test_stages_holding_other_micro_batches_get_other_plans(job):
    # 1F1B with 4 micro-batches: the first stage holds two at once, the last one
    assert [result["units"] for result in job] == [2, 1]
    plans = [[result["runs"][fraction]["plan"] for fraction in FRACTIONS] for result in job]
    assert plans[0] != plans[1], plans


def test_a_budget_below_full_recompute_is_refused_naming_the_minimum(job):
    refusals = [result["refusal"] for result in job]
    assert any(refusals), refusals
    message = next(refusal for refusal in refusals if refusal)
    assert "--adaptive-recompute-device-size" in message and "cannot be met" in message and "give at least" in message


def _validate(**flags):
    args = default_arguments()
    for key, value in flags.items():
        setattr(args, key, value)
    next(feature for feature in all_features() if feature.name == "adaptive_recompute").validate(args)


@pytest.mark.parametrize("flags, message", [
    (dict(adaptive_recompute_device_size=0), "a memory size in MiB"),
    (dict(adaptive_recompute_device_size=1000, adaptive_recompute_profiling_step=5), "use 6 or more"),
    (dict(adaptive_recompute_device_size=1000, recompute_granularity="full"), "drop one of them"),
    (dict(memory_fragmentation=True), "on the CPU"),
])
def test_invalid_settings_are_refused_naming_the_flags(flags, message):
    with pytest.raises(FeatureArgumentError, match=message):
        _validate(**flags)
