"""Flags and validation of context parallelism: every bad combination fails at parse time naming its flags."""
from __future__ import annotations

import argparse

import pytest

from ascendspeed.features import FeatureArgumentError, add_feature_arguments, validate_features
from ascendspeed.features.context_parallel import FEATURE, ContextParallelSettings


def megatron_like_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--position-embedding-type", default="learned_absolute",
                        choices=["learned_absolute", "rope", "none"])
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--attention-dropout", type=float, default=0.0)
    parser.add_argument("--reset-attention-mask", action="store_true")
    parser.add_argument("--transformer-impl", default="local")
    parser.add_argument("--window-size", default=None)
    parser.add_argument("--cp-comm-type", nargs="+", default=["p2p"])
    parser.add_argument("--hybrid-context-parallel", action="store_true")
    return add_feature_arguments(parser)


def parse(*flags):
    return megatron_like_parser().parse_args(list(flags))


@pytest.mark.parametrize("flags, named", [
    (["--context-parallel-size", "4", "--context-parallel-algo", "ulysses_cp_algo", "--num-attention-heads", "6"],
     "--num-attention-heads"),
    (["--context-parallel-size", "2", "--context-parallel-algo", "ulysses_cp_algo", "--num-attention-heads", "8",
      "--tensor-model-parallel-size", "8"], "--tensor-model-parallel-size"),
    (["--context-parallel-size", "4", "--seq-length", "20"], "--seq-length 20 must divide by 2 x --context-parallel"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "hybrid_cp_algo"], "--ulysses-degree-in-cp"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "3"],
     "--ulysses-degree-in-cp K dividing --context-parallel-size 4"),
    (["--context-parallel-size", "4", "--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "4",
      "--num-attention-heads", "6"], "--num-attention-heads"),
    (["--context-parallel-size", "2", "--ulysses-degree-in-cp", "2"], "--ulysses-degree-in-cp only applies"),
    (["--context-parallel-size", "2", "--reset-attention-mask"], "--cp-attention-mask-type general"),
    (["--context-parallel-size", "2", "--window-size", "(8,0)"], "--window-size"),
    (["--context-parallel-size", "2", "--transformer-impl", "transformer_engine", "--context-parallel-algo",
      "ulysses_cp_algo"], "--transformer-impl"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a"],
     r"--cp-comm-type a2a selects .* a2a -> --context-parallel-algo ulysses_cp_algo"),
    (["--context-parallel-size", "2", "--hybrid-context-parallel"], "--hybrid-context-parallel True"),
    (["--log-cp-ring-overlap"], r"--log-cp-ring-overlap times .*\(--context-parallel-size 1,"),
    (["--context-parallel-size", "2", "--context-parallel-algo", "ulysses_cp_algo", "--log-cp-ring-overlap"],
     "--log-cp-ring-overlap times .* --context-parallel-algo ulysses_cp_algo"),
    (["--context-parallel-size", "2", "--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "2",
      "--log-cp-ring-overlap"], "--log-cp-ring-overlap times .* --ulysses-degree-in-cp 2"),
])
def test_bad_combinations_fail_naming_the_flags(flags, named):
    with pytest.raises(FeatureArgumentError, match=named):
        validate_features(parse(*flags))


def test_flags_have_the_ascend_names_and_defaults():
    args = parse()
    assert (args.context_parallel_algo, args.ulysses_degree_in_cp, args.cp_attention_mask_type) == (
        "megatron_cp_algo", None, "causal")
    with pytest.raises(SystemExit):
        parse("--context-parallel-algo", "zigzag")


@pytest.mark.parametrize("flags, expected", [
    (["--context-parallel-size", "2"], ContextParallelSettings("megatron_cp_algo", 1, "causal")),
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"],
     ContextParallelSettings("megatron_cp_algo", 1, "causal")),
    (["--context-parallel-size", "4", "--context-parallel-algo", "ulysses_cp_algo"],
     ContextParallelSettings("ulysses_cp_algo", 1, "causal")),
    (["--context-parallel-size", "4", "--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "2",
      "--reset-attention-mask", "--cp-attention-mask-type", "general"],
     ContextParallelSettings("hybrid_cp_algo", 2, "general")),
    (["--context-parallel-size", "4", "--context-parallel-algo", "hybrid_cp_algo", "--ulysses-degree-in-cp", "2",
      "--log-cp-ring-overlap"], ContextParallelSettings("hybrid_cp_algo", 2, "causal", telemetry=True)),
])
def test_valid_combinations_enable_the_feature_with_their_settings(flags, expected):
    args = parse(*flags)
    assert FEATURE in validate_features(args)
    assert FEATURE.settings(args) == expected


def test_one_rank_or_transformer_engine_leaves_megatron_alone():
    assert FEATURE not in validate_features(parse())
    assert FEATURE not in validate_features(parse("--context-parallel-size", "2", "--transformer-impl",
                                                  "transformer_engine"))


def test_alibi_runs_with_context_parallelism():
    args = parse("--context-parallel-size", "2")
    args.position_embedding_type = "alibi"
    assert FEATURE in validate_features(args)
