"""Sequence parallelism with megatron-core's local layer spec on gloo, and the local norm it needs.

Two ranks run tensor parallel 2 with ``--sequence-parallel`` and compare every gradient with the unsharded
single-process model (fp32, 1e-6 relative), for LayerNorm, RMSNorm (eager and fused), zero-centred gamma,
and with ALiBi + fused SwiGLU, with RoPE, and with fused RoPE + fused RMSNorm on. The training entry with
the fused RMSNorm and RoPE, with and without sequence parallelism, matches Megatron's own norm and rotary
embedding step for step.
"""
import pytest
import torch
import torch.nn.functional as F

from ascendspeed.accelerator import te_fallback
from ascendspeed.features import FeatureArgumentError, default_arguments, disable_features, enable_features
from ascendspeed.features.local_norm import FEATURE, LocalNorm
from tests.helpers.distributed import run_distributed

TOLERANCE = 1e-6

CASES = {
    "layernorm": ({}, {}, {}),
    "rmsnorm": ({"normalization": "RMSNorm"}, {"normalization": "RMSNorm"}, {}),
    "rmsnorm_fused": ({"normalization": "RMSNorm"}, {"normalization": "RMSNorm", "use_fused_rmsnorm": True}, {}),
    "zero_centered_gamma": ({"layernorm_zero_centered_gamma": True}, {}, {}),
    "alibi_fused_swiglu": (
        {"gated_linear_unit": True, "activation_func": F.silu, "ffn_hidden_size": 48},
        {"position_embedding_type": "alibi", "swiglu": True, "use_fused_swiglu": True},
        {"position_embedding_type": "alibi"},
    ),
    "rope": ({}, {"position_embedding_type": "rope"}, {"position_embedding_type": "rope"}),
    "rope_fused_rmsnorm_fused": (
        {"normalization": "RMSNorm"},
        {"position_embedding_type": "rope", "use_fused_rotary_pos_emb": True, "normalization": "RMSNorm",
         "use_fused_rmsnorm": True},
        {"position_embedding_type": "rope"},
    ),
}


def _sequence_parallel(rank, world_size, cases):
    from tests.helpers import megatron as mu

    shape = mu.TinyGPT()
    batch = mu.make_batch(shape, batch_size=2 * shape.micro_batch_size)
    results = {}
    for name in cases:
        config_overrides, feature_settings, gpt_kwargs = CASES[name]
        disable_features()
        enable_features(sequence_parallel=True, **feature_settings)
        mu.initialize_parallel()
        reference = mu.build_gpt_model(shape.config(**config_overrides), shape, **gpt_kwargs)
        full = mu.full_parameters(reference)
        reference_losses = torch.stack(mu.reference_forward_backward(reference, batch, shape))
        reference_grads = mu.gradients([reference])
        mu.destroy_parallel()

        mu.initialize_parallel(tp=2)
        config = shape.config(sequence_parallel=True, **config_overrides)
        chunks = mu.build_model_chunks(config, shape, **gpt_kwargs)
        mu.load_full_parameters(chunks, full)
        ddp = mu.wrap_ddp(chunks)  # finalize_model_grads all-reduces the norms' partial gradients over TP
        losses = torch.stack(mu.run_forward_backward(ddp, batch, shape))
        grads = mu.gradients(ddp)
        errors = {
            full_name: mu.relative_error(grads[full_name], mu.shard_like(reference_grads[full_name], param,
                                                                       full_name, config))
            for full_name, param in mu.named_parameters_full(ddp)
        }
        norms = [module for module in ddp[0].modules() if isinstance(module, LocalNorm)]
        results[name] = {
            "loss_error": mu.relative_error(losses, reference_losses),
            "errors": errors,
            "norms": len(norms),
            "marked": all(p.sequence_parallel for norm in norms for p in norm.parameters()),
            "fused": {norm.fused for norm in norms},
        }
        mu.destroy_parallel()
    disable_features()
    return results


@pytest.fixture(scope="module")
def sequence_parallel():
    return run_distributed(_sequence_parallel, 2, list(CASES), timeout=900)


@pytest.mark.parametrize("case", list(CASES))
def test_tensor_and_sequence_parallel_gradients_equal_the_unsharded_model(sequence_parallel, case):
    for rank, results in enumerate(sequence_parallel):
        result = results[case]
        assert result["norms"] > 0 and result["marked"], "the local spec's norms are not sequence-parallel norms"
        assert result["loss_error"] <= TOLERANCE, f"rank {rank}: loss differs by {result['loss_error']:.2e}"
        worst = max(result["errors"], key=result["errors"].get)
        assert result["errors"][worst] <= TOLERANCE, f"rank {rank}: {worst} differs by {result['errors'][worst]:.2e}"
    assert sequence_parallel[0]["rmsnorm_fused"]["fused"] == {True}
    assert sequence_parallel[0]["rmsnorm"]["fused"] == {False}


def test_local_norm_matches_torch_norms_forward_and_backward():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 24, dtype=torch.float64, requires_grad=True)
    for normalization, reference in (("LayerNorm", torch.nn.LayerNorm(24, eps=1e-5)),
                                     ("RMSNorm", torch.nn.RMSNorm(24, eps=1e-5))):
        reference = reference.double()
        with torch.no_grad():
            reference.weight.uniform_(0.5, 1.5)
        ours = LocalNorm(normalization, 24, 1e-5, sequence_parallel=False, zero_centered_gamma=True,
                         fused=False, dtype=torch.float64)
        with torch.no_grad():
            ours.weight.copy_(reference.weight - 1)
            if ours.bias is not None:
                ours.bias.copy_(reference.bias)
        grad = torch.randn(5, 3, 24, dtype=torch.float64)
        expected = torch.autograd.grad(reference(x), (x, reference.weight), grad)
        found = torch.autograd.grad(ours(x), (x, ours.weight), grad)
        for a, b in zip(found, expected):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert set(ours.state_dict()) == set(reference.state_dict())


def test_the_feature_is_on_for_sequence_parallel_or_the_fused_rmsnorm():
    args = default_arguments()
    assert not FEATURE.is_enabled(args)
    args.sequence_parallel = True
    assert FEATURE.is_enabled(args)
    args.transformer_impl = "transformer_engine"   # its TENorm is the local norm where TE is absent
    assert FEATURE.is_enabled(args) == te_fallback.needed()


@pytest.mark.parametrize("settings, named", [
    ({"use_fused_rmsnorm": True}, "--normalization RMSNorm"),
    ({"use_fused_rmsnorm": True, "normalization": "RMSNorm", "transformer_impl": "transformer_engine"},
     "--transformer-impl local"),
])
def test_bad_combinations_are_refused_naming_the_flags(settings, named, monkeypatch):
    monkeypatch.setattr(te_fallback, "needed", lambda: False)   # with TE installed, its norms run
    with pytest.raises(FeatureArgumentError, match=named):
        enable_features(**settings)
    disable_features(["local_norm"])


# -- two ranks, the training entry: fused norm and RoPE with sequence parallelism, step for step -----------
TRAIN_FLAGS = [
    "--tensor-model-parallel-size", "2", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "4", "--lr-warmup-iters", "1",
    "--lr", "3e-3", "--eval-interval", "1000", "--eval-iters", "1", "--log-interval", "1000",
    "--eval-seq-lengths", "32", "--split", "998,2",
]
#: Counted in backward: the final evaluation runs the forward operators too.
FUSED_OPS = ("ascendspeed::rms_norm_backward", "ascendspeed::rotary_embedding_backward")


def _train_worker(rank, world_size):
    from ascendspeed.training.arguments import parse_args
    from ascendspeed.training.trainer import train

    runs = {}
    for name, extra in [
        ("megatron", []),
        ("fused", ["--use-fused-rmsnorm", "--use-fused-rotary-pos-emb"]),
        ("fused, sequence parallel", ["--use-fused-rmsnorm", "--use-fused-rotary-pos-emb", "--sequence-parallel"]),
    ]:
        try:
            with torch.autograd.profiler.profile() as profile:
                result = train(parse_args(TRAIN_FLAGS + extra, world_size=world_size))
        finally:
            disable_features()
        calls = {op: sum(event.name == op for event in profile.function_events) for op in FUSED_OPS}
        runs[name] = (list(result.losses), list(result.features), calls)
    return runs


def test_training_with_fused_rmsnorm_and_rope_matches_megatron_step_for_step():
    """The entry with --use-fused-rmsnorm --use-fused-rotary-pos-emb, with and without --sequence-parallel,
    against Megatron's own RMSNorm and rotary embedding: the same losses at every step."""
    for runs in run_distributed(_train_worker, 2, timeout=600):
        reference, features, calls = runs["megatron"]
        assert "fused_rope" not in features and calls == dict.fromkeys(FUSED_OPS, 0) and len(reference) == 4
        for name in ("fused", "fused, sequence parallel"):
            losses, features, calls = runs[name]
            assert {"local_norm", "fused_rope"} <= set(features), name
            # per iteration and micro-batch: 2 norms per layer and the final norm; RoPE on q and k per layer
            assert calls["ascendspeed::rms_norm_backward"] == 4 * 2 * (2 * 2 + 1), name
            assert calls["ascendspeed::rotary_embedding_backward"] == 4 * 2 * 2 * 2, name
            assert losses == pytest.approx(reference, rel=1e-5), name
