"""--use-fused-swiglu on real megatron-core: flags, patches, MLP equivalence, and 2-rank training."""
import argparse

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import megatron as mu  # installs ascendspeed (CPU shims) before megatron is used
from tests.helpers.autograd_graph import backward_nodes
from tests.helpers.distributed import run_distributed
from megatron.core.fusions import fused_bias_swiglu
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import mlp as megatron_mlp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import TEGroupedMLP

from ascendspeed.features import (
    FeatureArgumentError,
    add_feature_arguments,
    all_features,
    disable_features,
    enable_features,
    validate_features,
)
from ascendspeed.features.fused_swiglu import mlp as fused_mlp
from ascendspeed.patching import MANAGER

ORIGINAL_BIAS_SWIGLU_IMPL = fused_bias_swiglu.bias_swiglu_impl
ORIGINAL_WEIGHTED_BIAS_SWIGLU_IMPL = fused_bias_swiglu.weighted_bias_swiglu_impl
FUSED_BACKWARD_NODE = "GeneratedBackwardFor_ascendspeed_swiglu_defaultBackward"
WEIGHTED_BACKWARD_NODE = "GeneratedBackwardFor_ascendspeed_weighted_swiglu_defaultBackward"


@pytest.fixture(scope="module")
def megatron_world():
    """A one-process gloo world with megatron's parallel state (the feature is switched per test)."""
    with mu.one_process_world():
        yield


@pytest.fixture
def fused_swiglu():
    """The feature switched on through the Python API, and off again afterwards."""
    enable_features(swiglu=True, use_fused_swiglu=True)
    yield
    disable_features(["fused_swiglu"])


# -- flags and validation ------------------------------------------------------------------------------
def megatron_like_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--swiglu", action="store_true")
    parser.add_argument("--use-te-activation-func", action="store_true")
    parser.add_argument("--activation-func-clamp-value", type=float, default=None)
    parser.add_argument("--glu-linear-offset", type=float, default=0.0)
    return add_feature_arguments(parser, extend_megatron=False)


def test_feature_is_registered_with_its_flag():
    assert "fused_swiglu" in [feature.name for feature in all_features()]
    args = megatron_like_parser().parse_args(["--swiglu", "--use-fused-swiglu"])
    assert args.use_fused_swiglu
    assert "fused_swiglu" in [feature.name for feature in validate_features(args)]


def test_fused_swiglu_requires_swiglu():
    args = megatron_like_parser().parse_args(["--use-fused-swiglu"])
    with pytest.raises(FeatureArgumentError, match="--use-fused-swiglu needs --swiglu"):
        validate_features(args)
    with pytest.raises(FeatureArgumentError, match="needs --swiglu"):
        enable_features(use_fused_swiglu=True)
    assert "fused_swiglu" not in MANAGER.features()


@pytest.mark.parametrize("flags,named", [
    (["--use-te-activation-func"], "--use-te-activation-func True"),
    (["--activation-func-clamp-value", "7"], "--activation-func-clamp-value 7.0"),
    (["--glu-linear-offset", "1.0"], "--glu-linear-offset 1.0"),
])
def test_unsupported_combinations_fail_naming_the_flag(flags, named):
    args = megatron_like_parser().parse_args(["--swiglu", "--use-fused-swiglu", *flags])
    with pytest.raises(FeatureArgumentError, match=f"--use-fused-swiglu cannot run with {named}"):
        validate_features(args)


def test_fp8_input_store_is_refused_from_python():
    with pytest.raises(FeatureArgumentError, match="cannot run with activation_func_fp8_input_store True"):
        enable_features(swiglu=True, use_fused_swiglu=True, activation_func_fp8_input_store=True)
    assert "fused_swiglu" not in MANAGER.features()


def test_patches_are_listed_swept_and_reverted(fused_swiglu):
    rows = [row for row in MANAGER.report() if row["feature"] == "fused_swiglu"]
    assert {(row["kind"], row["target"]) for row in rows} == {
        ("replace", "megatron.core.transformer.mlp:bias_swiglu_impl"),
        ("replace", "megatron.core.transformer.mlp:weighted_bias_swiglu_impl"),
        ("wrap", "megatron.core.transformer.mlp:MLP.__init__"),
        ("wrap", "megatron.core.transformer.moe.experts:TEGroupedMLP.__init__"),
    }
    assert megatron_mlp.bias_swiglu_impl is fused_mlp.fused_bias_swiglu_impl
    assert fused_bias_swiglu.bias_swiglu_impl is fused_mlp.fused_bias_swiglu_impl  # the copy it was bound from
    assert fused_bias_swiglu.weighted_bias_swiglu_impl is fused_mlp.fused_weighted_bias_swiglu_impl
    disable_features(["fused_swiglu"])
    assert megatron_mlp.bias_swiglu_impl is ORIGINAL_BIAS_SWIGLU_IMPL
    assert fused_bias_swiglu.bias_swiglu_impl is ORIGINAL_BIAS_SWIGLU_IMPL
    assert fused_bias_swiglu.weighted_bias_swiglu_impl is ORIGINAL_WEIGHTED_BIAS_SWIGLU_IMPL
    assert not hasattr(MLP.__init__, "__wrapped__")
    assert not hasattr(TEGroupedMLP.__init__, "__wrapped__")


# -- one MLP: the fused operator against megatron-core's own SwiGLU ------------------------------------
def build_mlp(is_expert=False, **overrides):
    """An MLP with the same weights at every call (the feature decides its path when it is built)."""
    settings = dict(ffn_hidden_size=48, gated_linear_unit=True, activation_func=F.silu, use_cpu_initialization=True)
    settings.update(overrides)
    config = mu.TinyGPT().config(**settings)
    torch.manual_seed(mu.SEED)
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return MLP(config, submodules, is_expert, ffn_hidden_size=config.ffn_hidden_size)


def run_mlp(module, hidden):
    """Output, output bias and every gradient of one forward/backward; whether the fused operator ran."""
    module.zero_grad(set_to_none=True)
    hidden = hidden.detach().clone().requires_grad_()
    output, output_bias = module(hidden)
    if output_bias is not None:  # skip_bias_add: the caller adds it (bias-dropout-add)
        output = output + output_bias
    grad = torch.linspace(-1, 1, output.numel()).view_as(output)
    output.backward(grad)
    grads = {name: param.grad.clone() for name, param in module.named_parameters()}
    grads["input"] = hidden.grad
    return output.detach(), output_bias, grads, FUSED_BACKWARD_NODE in backward_nodes(output)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("fusion", [True, False], ids=["bias-activation-fusion", "unfused-glu"])
def test_mlp_matches_megatron(megatron_world, fusion, bias):
    hidden = torch.randn(mu.TinyGPT().seq_length, 3, 32) * 3
    expected_out, expected_bias, expected_grads, fused = run_mlp(
        build_mlp(bias_activation_fusion=fusion, add_bias_linear=bias), hidden)
    assert not fused
    enable_features(swiglu=True, use_fused_swiglu=True)
    try:
        out, out_bias, grads, fused = run_mlp(build_mlp(bias_activation_fusion=fusion, add_bias_linear=bias), hidden)
    finally:
        disable_features(["fused_swiglu"])
    assert fused
    assert mu.relative_error(out, expected_out) < 1e-6
    assert (out_bias is None) == (expected_bias is None)
    for name, expected in expected_grads.items():
        assert mu.relative_error(grads[name], expected) < 1e-6, name


def _expert_reference(module, hidden, scale, grad):
    """Float64: fc2(swiglu(fc1(x) + b1) * p) + b2 * p, the expert's output and the gradients of the input,
    the routing probabilities and every parameter."""
    params = {name: param.detach().double().requires_grad_() for name, param in module.named_parameters()}
    x = hidden.detach().double().requires_grad_()
    p = scale.detach().double().requires_grad_()
    a = x @ params["linear_fc1.weight"].t() + params.get("linear_fc1.bias", 0)
    gate, value = a.chunk(2, -1)
    y = (F.silu(gate) * value * p.unsqueeze(-1)) @ params["linear_fc2.weight"].t()
    if "linear_fc2.bias" in params:
        y = y + params["linear_fc2.bias"] * p.unsqueeze(-1)
    (y * grad.double()).sum().backward()
    return y.detach(), {"input": x.grad, "probs": p.grad, **{name: t.grad for name, t in params.items()}}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("fusion", [True, False], ids=["bias-activation-fusion", "unfused-glu"])
def test_expert_mlp_with_routing_probabilities_equals_the_float64_reference(megatron_world, fusion, bias):
    """An expert MLP called with its tokens' routing probabilities (SequentialMLP's call) runs a fused
    operator on every path (without a bias the weighted one: SwiGLU and probability scale in one pass), and
    equals the float64 formula; the probabilities get their gradient (the router learns through it)."""
    enable_features(swiglu=True, use_fused_swiglu=True, num_experts=4)
    try:
        module = build_mlp(bias_activation_fusion=fusion, add_bias_linear=bias, is_expert=True)
        hidden = torch.randn(24, 32, requires_grad=True)
        scale = torch.rand(24, requires_grad=True)
        output, output_bias = module(hidden, scale)
        assert output_bias is None  # an expert adds its own bias times the probabilities
        grad = torch.randn_like(output)
        # with a bias the moe feature scales after fc2 (ascendspeed/features/moe/mlp.py): the plain operator
        fused = (FUSED_BACKWARD_NODE if bias else WEIGHTED_BACKWARD_NODE) in backward_nodes(output)
        output.backward(grad)
    finally:
        disable_features()
    assert fused
    expected, expected_grads = _expert_reference(module, hidden, scale, grad)
    assert mu.relative_error(output.detach(), expected) < 1e-6
    grads = {"input": hidden.grad, "probs": scale.grad,
             **{name: param.grad for name, param in module.named_parameters()}}
    for name, reference in expected_grads.items():
        assert mu.relative_error(grads[name], reference) < 1e-5, name


def test_mlp_with_glu_extras_keeps_megatron_path(megatron_world, fused_swiglu):
    """A clamped or offset GLU is not plain SwiGLU: megatron-core's own code runs it."""
    module = build_mlp(activation_func_clamp_value=2.0)
    _, _, _, fused = run_mlp(module, torch.randn(4, 2, 32))
    assert not fused


def test_fused_path_saves_less_than_megatron_unfused(megatron_world):
    """The unfused glu keeps both halves and silu(a) for backward; the fused operator keeps its input."""
    hidden = torch.randn(16, 2, 32, requires_grad=True)

    def saved_bytes():
        module = build_mlp(bias_activation_fusion=False, add_bias_linear=False)
        total = 0

        def pack(tensor):
            nonlocal total
            total += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            module(hidden)
        return total

    megatron = saved_bytes()
    enable_features(swiglu=True, use_fused_swiglu=True)
    try:
        fused = saved_bytes()
    finally:
        disable_features(["fused_swiglu"])
    fc1_output = 16 * 2 * 96 * 4
    assert megatron - fused == fc1_output // 2  # silu(a) is no longer kept


def test_fp8_input_store_is_rejected(megatron_world, fused_swiglu):
    with pytest.raises(ValueError, match="activation_func_fp8_input_store"):
        megatron_mlp.bias_swiglu_impl(torch.randn(4, 8), None, True, False)
    module = build_mlp(bias_activation_fusion=True, activation_func_fp8_input_store=True)
    with pytest.raises(ValueError, match="activation_func_fp8_input_store"):
        module(torch.randn(4, 2, 32))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_cpu_offload_marks_the_saved_input(bias):
    """As in megatron-core, the tensor saved for backward carries ``activation_offloading`` for TE."""
    saved = []
    x = torch.randn(4, 2, 16, requires_grad=True)
    b = torch.randn(16, requires_grad=True) if bias else None
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fused_mlp.fused_bias_swiglu_impl(x, b, False, True)
    assert len(saved) == 1 and getattr(saved[0], "activation_offloading", False)
    expected = fused_bias_swiglu.bias_swiglu_impl(x, b) if bias else None
    if expected is not None:
        assert mu.relative_error(y, expected) < 1e-6


# -- two ranks: training with the flag matches training without it, step for step ----------------------
TRAIN_FLAGS = [
    "--swiglu", "--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "64",
    "--ffn-hidden-size", "96", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "4",
    "--global-batch-size", "8", "--train-iters", "4", "--lr-warmup-iters", "1", "--lr", "3e-3",
    "--eval-interval", "1000", "--eval-iters", "1", "--log-interval", "1000", "--eval-seq-lengths", "32",
    "--split", "998,2",
]


def _train_worker(rank, world_size):
    from ascendspeed.training.arguments import parse_args
    from ascendspeed.training.trainer import train

    runs = {}
    # Megatron's eager SwiGLU first: the fused runs apply the feature's patches for the rest of the process.
    for name, extra in [
        ("megatron", ["--no-bias-swiglu-fusion", "--no-use-fused-swiglu"]),
        ("fused, fusion path", ["--use-fused-swiglu"]),
        ("fused, unfused path", ["--use-fused-swiglu", "--no-bias-swiglu-fusion"]),
    ]:
        with torch.autograd.profiler.profile() as profile:
            result = train(parse_args(TRAIN_FLAGS + extra, world_size=world_size))
        fused_calls = sum(event.name == "ascendspeed::swiglu_backward" for event in profile.function_events)
        runs[name] = (list(result.losses), list(result.features), fused_calls)
    return runs


def test_training_with_fused_swiglu_matches_megatron_step_for_step():
    results = run_distributed(_train_worker, 2)
    for runs in results:
        reference, features, fused_calls = runs["megatron"]
        assert "fused_swiglu" not in features and fused_calls == 0 and len(reference) == 4
        for name in ("fused, fusion path", "fused, unfused path"):
            losses, features, fused_calls = runs[name]
            assert "fused_swiglu" in features
            assert fused_calls == 4 * 2 * 2, name  # iterations x micro-batches x layers
            assert losses == pytest.approx(reference, rel=1e-5), name
