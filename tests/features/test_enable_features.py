"""``enable_features``, the Python switch for megatron-core users (issue 21 item 4), on real megatron-core.

Values are checked against the choices and types of the flags (``feature_parser``, the one declaration the
``--list`` parser shares); a second call replaces the first instead of adding to it; a call that fails
leaves the previous selection applied.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import megatron as mu  # installs ascendspeed (CPU shims) before megatron is used
from megatron.core.fusions import fused_bias_swiglu
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import mlp as megatron_mlp
from megatron.core.transformer.mlp import MLP, MLPSubmodules

from ascendspeed.adaptor import build_list_parser
from ascendspeed.features import (
    FeatureArgumentError,
    all_features,
    default_arguments,
    enable_features,
    feature_parser,
)
from ascendspeed.features.fused_swiglu import mlp as fused_mlp
from ascendspeed.patching import MANAGER, PatchManager

FEATURES = {feature.name for feature in all_features()}
ORIGINAL_BIAS_SWIGLU_IMPL = fused_bias_swiglu.bias_swiglu_impl
FUSED_NODE = "GeneratedBackwardFor_ascendspeed_swiglu_defaultBackward"


@pytest.fixture(scope="module")
def megatron_world():
    with mu.one_process_world():
        yield


@pytest.fixture(autouse=True)
def no_features_after():
    yield
    enable_features()  # reverts what the test's last call applied


def applied_features():
    """The features applied besides fused attention, which Megatron's default --attention-backend auto enables."""
    return MANAGER.features() & FEATURES - {"fused_attention"}


def test_megatron_s_default_attention_backend_enables_fused_attention():
    enable_features()
    assert "fused_attention" in MANAGER.features()
    enable_features(attention_backend="unfused")
    assert "fused_attention" not in MANAGER.features()
    with pytest.raises(FeatureArgumentError, match="'flashy' is not a choice of --attention-backend"):
        enable_features(attention_backend="flashy")


@pytest.mark.parametrize("settings, message", [
    (dict(position_embedding_type="alibbi"),
     "position_embedding_type='alibbi' is not a choice of --position-embedding-type; choose from "
     "'learned_absolute', 'rope', 'yarn', 'mrope', 'relative', 'none', 'alibi'"),
    (dict(normalization="rmsnorm", use_fused_rmsnorm=True), "'rmsnorm' is not a choice of --normalization"),
    (dict(context_parallel_size=2, context_parallel_algo="ring"), "'ring' is not a choice of --context-parallel-algo"),
    (dict(swiglu=True, use_fused_swiglu=1), r"use_fused_swiglu \(--use-fused-swiglu\) is an on/off flag: pass True"),
    (dict(swiglu="yes"), r"swiglu \(--swiglu\) is an on/off flag"),
    (dict(context_parallel_size="2"), r"context_parallel_size \(--context-parallel-size\) must be int, got str '2'"),
    (dict(context_parallel_size=2.0), "must be int, got float"),
    (dict(rotary_base=True), "must be int, got bool"),
    (dict(cp_comm_type="p2p"), "takes a non-empty list"),
])
def test_values_are_checked_like_the_flags(settings, message):
    with pytest.raises(FeatureArgumentError, match=message):
        enable_features(**settings)
    assert not applied_features()


def test_accepted_values_are_the_flags_own():
    args = enable_features(rotary_percent=1, ulysses_degree_in_cp=None)
    assert args.rotary_percent == 1.0 and isinstance(args.rotary_percent, float)
    assert not applied_features()


def test_one_declaration_of_choices_and_types():
    """The --list parser and enable_features read the same actions; defaults are the features' own."""
    ours = {action.dest: action for action in feature_parser()._actions}
    listed = {action.dest: action for action in build_list_parser()._actions}
    for dest, action in ours.items():
        assert (listed[dest].choices, listed[dest].type, listed[dest].default) == (
            action.choices, action.type, action.default), dest
    assert "alibi" in ours["position_embedding_type"].choices
    defaults = vars(default_arguments())
    for feature in all_features():
        for dest, default in feature.megatron_arguments.items():
            assert dest in defaults
    assert defaults["position_embedding_type"] == "learned_absolute" and defaults["seq_length"] is None


def build_mlp():
    config = mu.TinyGPT().config(ffn_hidden_size=48, gated_linear_unit=True, activation_func=F.silu,
                                 use_cpu_initialization=True)
    torch.manual_seed(mu.SEED)
    return MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
               ffn_hidden_size=config.ffn_hidden_size)


def runs_fused_swiglu(module) -> bool:
    output, _ = module(torch.randn(4, 2, 32))
    names, stack, seen = set(), [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            names.add(node.name())
            stack.extend(next_node for next_node, _ in node.next_functions)
    return FUSED_NODE in names


def test_a_second_call_replaces_the_first(megatron_world):
    enable_features(swiglu=True, use_fused_swiglu=True)
    assert applied_features() == {"fused_swiglu"}
    assert megatron_mlp.bias_swiglu_impl is fused_mlp.fused_bias_swiglu_impl
    assert runs_fused_swiglu(build_mlp())

    enable_features(normalization="RMSNorm", use_fused_rmsnorm=True)
    assert applied_features() == {"local_norm"}
    assert megatron_mlp.bias_swiglu_impl is ORIGINAL_BIAS_SWIGLU_IMPL
    assert fused_bias_swiglu.bias_swiglu_impl is ORIGINAL_BIAS_SWIGLU_IMPL
    assert not runs_fused_swiglu(build_mlp())

    enable_features(swiglu=True, use_fused_swiglu=True, normalization="RMSNorm", use_fused_rmsnorm=True)
    assert applied_features() == {"local_norm", "fused_swiglu"}
    enable_features()
    assert not applied_features()


def test_a_failed_call_leaves_the_previous_selection(megatron_world):
    enable_features(swiglu=True, use_fused_swiglu=True)
    with pytest.raises(FeatureArgumentError, match="alibbi"):
        enable_features(position_embedding_type="alibbi")
    with pytest.raises(FeatureArgumentError, match="needs --swiglu"):
        enable_features(use_fused_swiglu=True)
    assert applied_features() == {"fused_swiglu"}
    assert runs_fused_swiglu(build_mlp())


def test_each_manager_keeps_its_own_selection():
    other = PatchManager()
    enable_features(swiglu=True, use_fused_swiglu=True)
    enable_features(other, normalization="RMSNorm", use_fused_rmsnorm=True)
    assert applied_features() == {"fused_swiglu"}
    assert other.features() == {"local_norm", "fused_attention"}
    enable_features(other, attention_backend="local")
    assert not other.features() and applied_features() == {"fused_swiglu"}
