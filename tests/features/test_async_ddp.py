"""Async DDP: overlapped gradient reduction is exact, covers every pipeline stage and is measured.

Two spawned gloo ranks check the reduced gradients (bucket layouts, first iteration, unused, frozen
and twice-used parameters) and several optimizer steps with and without the distributed optimizer;
four ranks (pipeline 2 x data 2) check pipeline and virtual-pipeline training against data parallel.
"""
import argparse
import sys

import pytest
import torch

import ascendspeed.megatron_adaptor  # noqa: F401
from tests.helpers import async_ddp as helpers
from ascendspeed.features import FeatureArgumentError, default_arguments
from ascendspeed.features.async_ddp import FEATURE
from ascendspeed.features.async_ddp.telemetry import BucketRecord, IterationRecord, Telemetry, covered_time
from ascendspeed.patching import PatchManager
from tests.helpers.distributed import run_distributed
from tests.helpers.megatron_lm import add_megatron_lm_to_path

GRADIENT_CONFIGS = {
    "off": {"overlap": False},
    "single": {"overlap": True, "bucket_size": 10**9},
    "split": {"overlap": True, "bucket_size": 300},  # 544-element buckets that end inside a weight
    "tiny": {"overlap": True, "bucket_size": 1},  # one bucket per parameter
    "slow": {"overlap": True, "bucket_size": 1, "slow_backward_s": 0.2},
    "frozen_unused": {"overlap": True, "bucket_size": 300, "frozen": (0,), "unused": (2,), "use_unused_at": (2,)},
    "twice": {"overlap": True, "bucket_size": 300, "backwards": 2},
}
TRAINING_CONFIGS = {
    "off": {"overlap": False, "distributed_optimizer": False},
    "on": {"overlap": True, "distributed_optimizer": False, "bucket_size": 300},
    "distributed_off": {"overlap": False, "distributed_optimizer": True},
    "distributed_on": {"overlap": True, "distributed_optimizer": True, "bucket_size": 300},
    "distributed_tiny": {"overlap": True, "distributed_optimizer": True, "bucket_size": 1},
}
PIPELINE_LAYOUTS = {
    "data_parallel": {"overlap": False},
    "pp2_distributed_optimizer": {"overlap": True, "pp": 2, "bucket_size": 2000, "distributed_optimizer": True},
    "pp2_vpp2_aligned": {"overlap": True, "pp": 2, "vpp": 2, "bucket_size": 2000, "align_grad_reduce": True},
    "pp2_megatron_policy": {"overlap": True, "pp": 2, "bucket_size": 2000, "all_stages": False,
                            "align_grad_reduce": True},
}


# -- flags, patches, telemetry arithmetic (this process) ---------------------------------------------
def test_flags_defaults_and_enabling():
    args = default_arguments()
    assert args.overlap_grad_reduce is False and args.log_grad_reduce_overlap is False
    assert args.overlap_grad_reduce_all_stages is True
    assert not FEATURE.is_enabled(args)
    parser = argparse.ArgumentParser()
    FEATURE.add_arguments(parser)
    parsed = parser.parse_args(["--no-overlap-grad-reduce-all-stages", "--log-grad-reduce-overlap"])
    assert parsed.overlap_grad_reduce_all_stages is False and parsed.log_grad_reduce_overlap is True
    args.log_grad_reduce_overlap = True
    assert FEATURE.is_enabled(args)


@pytest.mark.parametrize("setting, message", [
    ({"ddp_bucket_size": 0}, "--ddp-bucket-size must be positive"),
    ({"num_distributed_optimizer_instances": 2}, "--num-distributed-optimizer-instances"),
])
def test_invalid_settings_name_the_flag(setting, message):
    args = default_arguments()
    args.overlap_grad_reduce = True
    for key, value in setting.items():
        setattr(args, key, value)
    with pytest.raises(FeatureArgumentError, match=message):
        FEATURE.validate(args)


@pytest.mark.parametrize("all_stages, telemetry, count", [(True, True, 12), (True, False, 11), (False, False, 8)])
def test_patches_match_installed_megatron_core_and_revert(all_stages, telemetry, count):
    from megatron.core.distributed import param_and_grad_buffer

    args = default_arguments()
    args.overlap_grad_reduce = True
    args.overlap_grad_reduce_all_stages = all_stages
    args.log_grad_reduce_overlap = telemetry
    manager = PatchManager()
    original = param_and_grad_buffer._ParamAndGradBucketGroup.finish_grad_sync
    manager.apply(FEATURE.name, FEATURE.patches(FEATURE.settings(args)))
    try:
        rows = manager.report()
        assert len(rows) == count and {row["state"] for row in rows} == {"applied"}
        assert param_and_grad_buffer._ParamAndGradBucketGroup.finish_grad_sync is not original
    finally:
        manager.revert()
    assert param_and_grad_buffer._ParamAndGradBucketGroup.finish_grad_sync is original


def test_ddp_config_from_flags():
    from ascendspeed.training.arguments import parse_args
    from ascendspeed.training.model import ddp_config

    args = parse_args(["--overlap-grad-reduce", "--use-distributed-optimizer", "--ddp-bucket-size", "1000"],
                      world_size=1, device="cpu")
    config = ddp_config(args)
    assert (config.overlap_grad_reduce, config.use_distributed_optimizer, config.bucket_size) == (True, True, 1000)


def test_telemetry_totals_and_log_line():
    assert covered_time([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0
    assert covered_time([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)], after=2.5) == 1.5
    record = IterationRecord(index=7, start=0.0, compute_end=10.0, buckets=[
        BucketRecord("b0", 100, ready=2.0, start=2.0, end=6.0),
        BucketRecord("b1", 100, ready=6.0, start=6.0, end=9.0),
        BucketRecord("b2", 100, ready=10.0, start=10.0, end=12.0),
    ])
    assert record.comm_time == pytest.approx(9.0)
    assert record.exposed_time == pytest.approx(2.0)
    assert record.hidden_fraction == pytest.approx(7.0 / 9.0)
    lines = []
    telemetry = Telemetry(log=lines.append)
    telemetry.begin_iteration()
    telemetry.on_gradient()
    telemetry.on_dispatch("b0", 10, None, telemetry.now(), [])
    telemetry.on_compute_end()
    closed = telemetry.end_iteration()
    assert closed.buckets[0].end >= closed.buckets[0].start
    assert len(lines) == 1 and "grad-reduce comm" in lines[0] and "exposed" in lines[0] and "hidden" in lines[0]


@pytest.mark.megatron_lm
def test_megatron_arguments_exist_in_megatron_lm():
    add_megatron_lm_to_path()
    from megatron.training import arguments

    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    defaults = vars(parser.parse_args([]))
    for dest, default in FEATURE.megatron_arguments.items():
        assert defaults[dest] == default, dest


# -- two data-parallel ranks ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(helpers.two_rank_checks, 2, GRADIENT_CONFIGS, TRAINING_CONFIGS)


def _grads(rank_result, name):
    return rank_result["gradients"]["results"][name]["grads"]


def test_reduced_gradients_bit_identical_with_and_without_overlap(two_ranks):
    for result in two_ranks:
        reference = _grads(result, "off")
        for name in ("single", "split", "tiny", "slow"):
            for step, grads in enumerate(_grads(result, name)):
                for key, grad in grads.items():
                    assert torch.equal(grad, reference[step][key]), (name, step, key)


def test_reduced_gradients_equal_the_single_process_reference(two_ranks):
    for result in two_ranks:
        for name in GRADIENT_CONFIGS:
            reference = result["gradients"]["reference"][name]
            for step, grads in enumerate(_grads(result, name)):
                assert grads.keys() == reference[step].keys()
                for key, grad in grads.items():
                    torch.testing.assert_close(grad, reference[step][key], rtol=1e-6, atol=1e-7,
                                               msg=f"{name} step {step} {key}")


def test_bucket_layouts(two_ranks):
    results = two_ranks[0]["gradients"]["results"]
    assert results["off"]["buckets"] == 1
    assert results["single"]["buckets"] == 1
    assert results["split"]["buckets"] == 2
    assert results["tiny"]["buckets"] == 2 * helpers.LAYERS


def test_overlap_starts_in_the_first_iteration(two_ranks):
    for result in two_ranks:
        for name in ("split", "tiny", "slow"):
            first = result["gradients"]["results"][name]["telemetry"][0]
            starts = sorted(bucket[3] for bucket in first["buckets"])
            assert all(start < first["compute_end"] for start in starts[:-1]), name


def test_completion_comes_from_the_future_not_from_wait(two_ranks):
    """With 0.2 s of backward left after the last three layers, their buckets complete before backward
    ends; ``finish_grad_sync`` (the only ``wait``) runs after it."""
    for result in two_ranks:
        for iteration in result["gradients"]["results"]["slow"]["telemetry"]:
            early = [b for b in iteration["buckets"] if b[3] < iteration["compute_end"] - 0.15]
            assert len(early) == 6
            assert all(bucket[4] < iteration["compute_end"] - 0.1 for bucket in early)


def test_unused_and_frozen_parameters_do_not_hang(two_ranks):
    """Layer 0 frozen; layer 2 unused in steps 1-2 (its bucket is sent at the end of backward in step 1,
    during backward in step 2) and used in step 3 (its late gradients are reduced separately)."""
    for result in two_ranks:
        results = result["gradients"]["results"]["frozen_unused"]
        assert "layers.0.weight" not in results["grads"][0]
        kinds = [[bucket[1] for bucket in iteration["buckets"]] for iteration in results["telemetry"]]
        assert kinds[0] == ["reduce", "reduce"] and kinds[1] == ["reduce", "reduce"]
        assert "late" in kinds[2]
        second = results["telemetry"][1]
        assert all(bucket[3] < second["compute_end"] for bucket in second["buckets"])


def test_parameters_used_twice_per_step_are_waited_for_after_the_first_step(two_ranks):
    for result in two_ranks:
        results = result["gradients"]["results"]["twice"]
        kinds = [[bucket[1] for bucket in iteration["buckets"]] for iteration in results["telemetry"]]
        assert kinds[0].count("late") == 2 and "late" not in kinds[1] + kinds[2]
        assert set(results["expected"].values()) == {2}


def test_parameters_identical_across_ranks_after_training(two_ranks):
    first, second = (result["training"] for result in two_ranks)
    for name in TRAINING_CONFIGS:
        for key, value in first[name]["params"].items():
            assert torch.equal(value, second[name]["params"][key]), (name, key)
            assert torch.equal(value, first["off"]["params"][key]), (name, key)
        assert first[name]["losses"] == first["off"]["losses"]


# -- pipeline 2 x data 2 ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pipeline():
    return run_distributed(helpers.pipeline_training, 4, PIPELINE_LAYOUTS, 2)


def test_pipeline_training_matches_data_parallel(pipeline):
    reference = pipeline[0]["data_parallel"]["params"]
    for result in pipeline:
        for name in PIPELINE_LAYOUTS:
            for key, value in result[name]["params"].items():
                torch.testing.assert_close(value, reference[key], rtol=1e-4, atol=1e-5, msg=f"{name} {key}")


def test_pipeline_parameters_identical_across_data_parallel_ranks(pipeline):
    for name in PIPELINE_LAYOUTS:
        by_stage = {}
        for result in pipeline:
            by_stage.setdefault(result[name]["pp_rank"], []).append(result[name]["params"])
        for replicas in by_stage.values():
            for key, value in replicas[0].items():
                assert all(torch.equal(value, other[key]) for other in replicas[1:]), (name, key)


def test_every_stage_keeps_its_buckets_and_overlaps(pipeline):
    for result in pipeline:
        for name in ("pp2_distributed_optimizer", "pp2_vpp2_aligned"):
            layout = result[name]
            assert all(count > 1 for count in layout["buckets"]), (name, layout["pp_rank"], layout["buckets"])
            for iteration in layout["telemetry"]:
                starts = sorted(bucket[3] for bucket in iteration["buckets"])
                assert all(start < iteration["compute_end"] for start in starts[:-1]), (name, layout["pp_rank"])


def test_switching_all_stages_off_restores_megatron_policy(pipeline):
    for result in pipeline:
        layout = result["pp2_megatron_policy"]
        assert (layout["buckets"][0] > 1) == (layout["pp_rank"] == 0), layout
