"""accelerator.te_fallback: Transformer Engine's layer classes built from megatron-core's local modules.

On this machine Transformer Engine is not installed, so megatron-core's TE classes are mocks (or raising stubs)
and its TE layer spec cannot build without the fallback. Real megatron-core modules, float64.
"""
import argparse
import functools
import types

import pytest
import torch

from tests.helpers.autograd_graph import backward_nodes
from tests.helpers import megatron as mu  # installs ascendspeed (CPU shims) before megatron is used
from megatron.core.extensions import transformer_engine as te_classes
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from ascendspeed.accelerator import TE_FALLBACK_FEATURE, te_fallback
from ascendspeed.accelerator.te_fallback import standins
from ascendspeed.features import FeatureArgumentError, disable_features, enable_features
from ascendspeed.patching import ABSENT, MANAGER, PatchError, PatchManager, describe_signature, replace

pytestmark = pytest.mark.skipif(not te_fallback.needed(), reason="Transformer Engine is installed")

#: local-spec parameter name -> the TE spec's name for the same weight (the norms move into the linears).
TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}


@pytest.fixture(scope="module")
def megatron_world():
    with mu.one_process_world():
        yield


def test_the_te_classes_are_the_stand_ins_and_listed():
    for name in ("TENorm", "TELinear", "TELayerNormColumnParallelLinear", "TEColumnParallelLinear",
                 "TERowParallelLinear", "TEDotProductAttention"):
        assert getattr(te_classes, name) is getattr(standins, name), name
    targets = {row["target"] for row in MANAGER.report() if row["feature"] == TE_FALLBACK_FEATURE}
    assert "megatron.core.extensions.transformer_engine:TELinear" in targets
    assert "megatron.core.models.gpt.gpt_layer_specs:TESpecProvider" in targets


def test_the_te_spec_providers_q_k_norm_is_an_rms_norm_as_with_te():
    """Megatron's MLA tests take megatron-core's TESpecProvider directly; its q/k norm was apex's FusedLayerNorm
    (TE's version reads 0 without TE), which refused RMSNorm."""
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    provider = TESpecProvider()
    assert provider.layer_norm(rms_norm=True, for_qk=True) is te_classes.TENorm
    assert isinstance(standins.TESpecProvider(), TESpecProvider)  # gpt_layer_specs' name builds the same
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, normalization="RMSNorm",
                               params_dtype=torch.float64)
    norm = build_module(provider.layer_norm(rms_norm=True, for_qk=True), config=config, hidden_size=8, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 2, 8, dtype=torch.float64)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected)


def test_te_attention_runs_on_explicit_process_groups_without_model_parallel_state(tmp_path):
    """TE's attention needs no model-parallel state: Megatron's multi-module pipeline tests build models on
    HyperCommGrid groups alone, where the stand-in's local attention found no global memory buffer."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.enums import AttnMaskType

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        parallel_state.destroy_model_parallel()
        assert parallel_state._GLOBAL_MEMORY_BUFFER is None
        get_cuda_rng_tracker().reset()  # an earlier test's seeds may still be tracked
        get_cuda_rng_tracker().add("model-parallel-rng", 1)  # what model_parallel_cuda_manual_seed adds
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, attention_dropout=0.0,
                                   params_dtype=torch.float64)
        groups = ProcessGroupCollection(tp=dist.group.WORLD, cp=dist.group.WORLD)
        attention = te_classes.TEDotProductAttention(config, 1, AttnMaskType.causal, "self", pg_collection=groups)
        query, key, value = (torch.randn(5, 3, 2, 8, dtype=torch.float64) for _ in range(3))  # [s, b, heads, d]
        out = attention(query, key, value, None, attn_mask_type=AttnMaskType.causal)
        scores = torch.einsum("sbhd,tbhd->bhst", query, key) / 8 ** 0.5
        scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
        expected = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), value).reshape(5, 3, 16)
        torch.testing.assert_close(out, expected)
    finally:
        get_cuda_rng_tracker().reset()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_upstream_constructor_of_a_class_stubbed_on_a_mock_is_checked():
    original = MANAGER.original("megatron.core.extensions.transformer_engine:TERowParallelLinear")
    assert describe_signature(original).startswith("(input_size, output_size, *, config, init_method, bias, ")
    module = types.ModuleType("ascendspeed_test_stub_module")
    module.Stubbed = original
    import sys

    sys.modules[module.__name__] = module
    try:
        manager = PatchManager()
        with pytest.raises(PatchError, match="signature"):
            manager.apply("test", [replace(f"{module.__name__}:Stubbed", object, expect="(input_size)")])
    finally:
        del sys.modules[module.__name__]


def test_absent_names_are_added_and_deleted_again():
    import sys

    module = types.ModuleType("ascendspeed_test_absent_module")
    sys.modules[module.__name__] = module
    try:
        manager = PatchManager()
        manager.apply("test", [replace(f"{module.__name__}:added", 42, expect=ABSENT)])
        assert module.added == 42
        manager.revert("test")
        assert not hasattr(module, "added")
        module.present = 1
        with pytest.raises(PatchError, match="missing"):
            manager.apply("test", [replace(f"{module.__name__}:present", 2, expect=ABSENT)])
    finally:
        del sys.modules[module.__name__]


@pytest.mark.parametrize("flags, named", [
    ({"fp8": "hybrid"}, "--fp8-format"),
    ({"tp_comm_overlap": True}, "--tp-comm-overlap"),
    ({"cuda_graph_impl": "local"}, "--cuda-graph-impl"),
    ({"enable_cuda_graph": True}, "--enable-cuda-graph"),
    ({"moe_use_legacy_grouped_gemm": True}, "--moe-use-legacy-grouped-gemm"),
    ({"transformer_impl": "inference_optimized"}, "--transformer-impl inference_optimized"),
])
def test_what_needs_transformer_engine_is_refused_naming_the_flag(flags, named):
    args = argparse.Namespace(transformer_impl="transformer_engine", fp8=None, tp_comm_overlap=False)
    te_fallback.check_arguments(args)
    for dest, value in flags.items():
        setattr(args, dest, value)
    with pytest.raises(FeatureArgumentError, match=named):
        te_fallback.check_arguments(args)


def _te_linear(grouped: bool, config, init_method):
    if grouped:
        return te_classes.TEColumnParallelGroupedLinear(2, 32, 48, config=config, init_method=init_method, bias=False,
                                                        skip_bias_add=False, is_expert=True)
    return te_classes.TEColumnParallelLinear(32, 48, config=config, init_method=init_method, gather_output=False,
                                             bias=False, skip_bias_add=False, is_expert=False)


@pytest.mark.parametrize("grouped", [False, True], ids=["linear", "grouped-experts"])
def test_te_classes_built_before_any_seeding_draw_their_weights_as_te_does(megatron_world, grouped):
    """TE's modules fork the model-parallel RNG tracker only once it has states, else the default generator draws
    (Megatron's tests build TE experts that way); megatron-core's local modules raised "cuda rng state ... is not
    added". Once seeded, the tracker's stream draws, as before."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    config = _config(use_cpu_initialization=False, params_dtype=torch.float32)
    init_method = functools.partial(torch.nn.init.normal_, std=0.02)
    expected = torch.empty(48, 32)
    torch.manual_seed(7)
    init_method(expected)
    tracker = get_cuda_rng_tracker()
    states = tracker.get_states()
    tracker.reset()
    try:
        torch.manual_seed(7)
        unseeded = _te_linear(grouped, config, init_method)
        assert not tracker.is_initialized() and "fork" not in vars(tracker)
    finally:
        tracker.set_states(states)
    torch.manual_seed(7)
    seeded = _te_linear(grouped, config, init_method)
    weight = "weight0" if grouped else "weight"
    assert torch.equal(getattr(unseeded, weight), expected)
    assert not torch.equal(getattr(seeded, weight), expected)


# -- the TE layer spec equals the local one, step for step ----------------------------------------------
def _config(**overrides):
    settings = dict(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, hidden_dropout=0.0,
                    attention_dropout=0.0, params_dtype=torch.float64, use_cpu_initialization=True,
                    bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                    persist_layer_norm=False, gradient_accumulation_fusion=False)
    settings.update(overrides)
    return TransformerConfig(**settings)


def _layers(config, local_spec, te_spec):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)   # the local spec's torch norms are made in the default dtype
    try:
        local = build_module(local_spec, config=config, layer_number=1)
        te = build_module(te_spec, config=config, layer_number=1)
    finally:
        torch.set_default_dtype(previous)
    weights = dict(local.named_parameters())
    with torch.no_grad():
        for name, param in te.named_parameters():
            local_name = next((k for k, v in TE_NAMES.items() if v == name), name)
            param.copy_(weights[local_name] + 0.01 * torch.randn_like(param))
            weights[local_name].copy_(param)
    assert set(TE_NAMES.get(n, n) for n in weights) == set(dict(te.named_parameters()))
    return local, te


def _step(layer, hidden, attention_mask=None):
    hidden = hidden.clone().requires_grad_(True)
    output, _ = layer(hidden, attention_mask=attention_mask)
    (output * torch.linspace(-1, 1, output.numel(), dtype=output.dtype).view_as(output)).sum().backward()
    grads = {name: param.grad for name, param in layer.named_parameters()}
    return output.detach(), hidden.grad, grads


@pytest.mark.parametrize("case", ["layernorm", "rmsnorm-swiglu-fused"])
def test_te_spec_layer_equals_local_spec_layer(megatron_world, case):
    fused = case != "layernorm"
    if fused:
        enable_features(swiglu=True, use_fused_swiglu=True, normalization="RMSNorm", use_fused_rmsnorm=True,
                        transformer_impl="transformer_engine")
    try:
        import torch.nn.functional as F

        extra = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu) if fused else {}
        config = _config(**extra)
        local, te = _layers(config, get_gpt_layer_local_spec(normalization=config.normalization),
                            get_gpt_layer_with_transformer_engine_spec())
        hidden = torch.randn(8, 2, 32, dtype=torch.float64)
        _assert_same_step(local, te, hidden)
        if fused:
            # ascendspeed's features reach the TE spec's modules: the fused RMSNorm inside the layer-norm
            # linears, the fused SwiGLU in its MLP
            assert te.mlp.linear_fc1._te_norm.fused and te.self_attention.linear_qkv._te_norm.fused
            output, _ = te(hidden.clone().requires_grad_(True), attention_mask=None)
            names = " ".join(backward_nodes(output))
            assert "ascendspeed_swiglu" in names and "ascendspeed_rms_norm" in names, names
    finally:
        if fused:
            disable_features(["fused_swiglu", "local_norm"])


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_te_spec_attention_runs_fused_as_te_does(megatron_world, dropout):
    """TE's attention is a fused kernel that never holds the [b, heads, s, s] scores; the stand-in runs the fused
    kernel wherever it computes megatron-core's function, and megatron-core's materialised path where it does not
    (attention dropout in training draws its mask from Megatron's RNG tracker)."""
    config = _config(params_dtype=torch.float32, attention_dropout=dropout)
    layer = build_module(get_gpt_layer_with_transformer_engine_spec(), config=config, layer_number=1)
    output, _ = layer(torch.randn(16, 2, 32, requires_grad=True), attention_mask=None)
    names = " ".join(backward_nodes(output))
    fused = "ScaledDotProductFlashAttentionForCpuBackward" in names
    assert fused == (dropout == 0.0) and ("SoftmaxBackward" in names) == (dropout > 0.0), names


def _assert_same_step(local, te, hidden, attention_mask=None):
    assert type(te.self_attention.core_attention).__name__ == "LocalTEDotProductAttention"
    expected = _step(local, hidden, attention_mask)
    found = _step(te, hidden, attention_mask)
    torch.testing.assert_close(found[0], expected[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(found[1], expected[1], rtol=1e-12, atol=1e-12)
    for name, grad in expected[2].items():
        torch.testing.assert_close(found[2][TE_NAMES.get(name, name)], grad, rtol=1e-11, atol=1e-12,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _bert_specs():
    from megatron.core.models.bert import bert_layer_specs

    return bert_layer_specs.bert_layer_local_spec, bert_layer_specs.get_bert_layer_with_transformer_engine_spec()


def _t5_encoder_specs():
    from megatron.core.models.T5 import t5_spec

    return t5_spec.encoder_model_with_local_spec(), t5_spec.encoder_model_with_transformer_engine_default_spec()


@pytest.mark.parametrize("specs", [_bert_specs, _t5_encoder_specs], ids=["bert", "t5-encoder"])
def test_other_models_te_layer_specs_equal_their_local_specs(megatron_world, specs):
    """BERT's and T5's TE specs (megatron-core binds their TE classes to None, and BERT's refuses to build,
    where TE does not import) build on the stand-ins and compute their local specs' step, padding mask given."""
    local, te = _layers(_config(), *specs())
    hidden = torch.randn(8, 2, 32, dtype=torch.float64)
    padding = torch.zeros(2, 1, 8, 8, dtype=torch.bool)
    padding[1, :, :, 6:] = True
    _assert_same_step(local, te, hidden, padding)


@pytest.mark.parametrize("norm_class", ["TENorm", "WrappedTorchNorm"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_te_norm_serves_sequence_parallel_and_zero_centred_gamma_as_te_does(megatron_world, normalization,
                                                                            norm_class):
    """megatron-core's WrappedTorchNorm (the local spec's norm) refuses both; TE's TENorm has them, also without
    ascendspeed's arguments (megatron-core's tests build models from configs alone, e.g. its multi-token
    prediction layer on the local spec under SP); where TE is absent both build the same norm."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = _config(normalization=normalization, layernorm_zero_centered_gamma=True)
    config.sequence_parallel = True   # set after validation: it needs TP > 1 there, and this is one process
    norm = {"TENorm": te_classes.TENorm, "WrappedTorchNorm": WrappedTorchNorm}[norm_class](config, 32, eps=1e-5)
    assert norm.weight.dtype == torch.float64 and not norm.weight.any(), "stored as gamma - 1, initialised 0"
    assert all(param.sequence_parallel for param in norm.parameters())
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(4, 2, 32, dtype=torch.float64)
    if normalization == "LayerNorm":
        expected = torch.nn.functional.layer_norm(x, (32,), norm.weight + 1, norm.bias, 1e-5)
    else:
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * (norm.weight + 1)
    torch.testing.assert_close(norm(x), expected, rtol=1e-13, atol=1e-13)


def test_selective_recompute_of_the_layer_norms_runs_without_transformer_engine(megatron_world):
    """``--recompute-modules layernorm`` (``CheckpointWithoutOutput``) raised ``NameError:
    FP8GlobalStateManager`` on every device without TE; recomputed, the layer's step is the plain one."""
    config = _config()
    recomputing = _config(recompute_granularity="selective", recompute_modules=["layernorm"])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        plain = build_module(get_gpt_layer_local_spec(), config=config, layer_number=1)
        recomputed = build_module(get_gpt_layer_local_spec(), config=recomputing, layer_number=1)
    finally:
        torch.set_default_dtype(previous)
    recomputed.load_state_dict(plain.state_dict())
    assert recomputed.recompute_input_layernorm and recomputed.recompute_pre_mlp_layernorm
    hidden = torch.randn(8, 2, 32, dtype=torch.float64)
    expected, found = _step(plain, hidden), _step(recomputed, hidden)
    torch.testing.assert_close(found[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(found[1], expected[1], rtol=1e-13, atol=1e-13)
    for name, grad in expected[2].items():
        torch.testing.assert_close(found[2][name], grad, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_optimizer_config_without_a_learning_rate_builds_as_with_te(megatron_world, optimizer):
    """``OptimizerConfig()`` leaves ``lr`` to the scheduler; TE's FusedAdam takes it, torch's Adam / SGD raised
    a TypeError. Built now with rate 0 (a step moves nothing), the config unchanged; once the groups' rate is
    set, steps move the parameters."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    shape = mu.TinyGPT(num_layers=1)
    model = mu.wrap_ddp(mu.build_model_chunks(shape.config(), shape))
    config = OptimizerConfig(optimizer=optimizer, weight_decay=0.0, clip_grad=0.0)
    wrapped = get_megatron_optimizer(config, model)
    assert config.lr is None
    groups = wrapped.param_groups
    assert groups and all(group["lr"] == 0.0 for group in groups)
    params = [param for group in groups for param in group["params"]]
    before = [param.detach().clone() for param in params]
    for param in params:
        param.main_grad = torch.ones_like(param)
    wrapped.step()
    assert all(torch.equal(param, old) for param, old in zip(params, before))
    for group in groups:
        group["lr"] = 0.5
    wrapped.step()
    assert all(not torch.equal(param, old) for param, old in zip(params, before))


def test_clip_vit_model_builds_with_its_default_norms(megatron_world):
    """megatron-core's CLIPViTModel (vision encoders, MIMO) defaults its norms to torch.nn.LayerNorm without TE,
    which build_module cannot build ("unexpected keyword argument 'config'"): the TENorm stand-in serves them."""
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0)
    model = CLIPViTModel(config, get_gpt_layer_with_transformer_engine_spec(), patch_dim=4, img_h=8, img_w=8)
    out = model(torch.randn(2, 3, 8, 8))
    assert isinstance(model.ln_pre, (torch.nn.LayerNorm, WrappedTorchNorm)) and model.ln_pre.weight.shape == (32,)
    assert out.shape == (2, 4 + 1, 32) and torch.isfinite(out).all()


def _rope_inputs(tokens, dtype, d=16, d_rot=8, heads=3, batch=2, generator=None):
    """Fresh [s, b, h, d] inputs and Megatron-style fp32 angles [max_s, 1, 1, d_rot] (partial rotation)."""
    t = torch.randn(tokens, batch, heads, d, generator=generator).to(dtype)
    inverse = 1.0 / (10000 ** (torch.arange(0, d_rot, 2, dtype=torch.float32) / d_rot))
    angles = torch.outer(torch.arange(2 * tokens, dtype=torch.float32), inverse)
    return t, torch.cat((angles, angles), dim=-1)[:, None, None, :]


def _rope_step(function, t, cotangent):
    t = t.detach().clone().requires_grad_(True)
    out = function(t)
    (out.double() * cotangent).sum().backward()
    return out.detach(), t.grad


#: (forward, input gradient) tolerances against the float64 reference: fp32 rounds once, bf16 once more.
ROPE_TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [5, 32])
def test_rope_fusion_runs_as_megatrons_unfused_rope(megatron_world, tokens, dtype):
    """``apply_rope_fusion=True`` was refused without TE ("Please install TE >= 1.4"); through megatron-core's
    own ``apply_rotary_pos_emb`` it now runs the stand-in, which equals megatron-core's unfused RoPE computed in
    float64, forward and backward, the features past the rotated ones unchanged."""
    from megatron.core.models.common.embeddings import rope_utils

    config = _config(apply_rope_fusion=True)
    generator = torch.Generator().manual_seed(tokens)
    t, freqs = _rope_inputs(tokens, dtype, generator=generator)
    freqs = freqs[:tokens]
    cotangent = torch.randn(t.shape, dtype=torch.float64, generator=generator)
    found = _rope_step(lambda x: rope_utils.apply_rotary_pos_emb(x, freqs, config), t, cotangent)
    expected = _rope_step(lambda x: rope_utils._apply_rotary_pos_emb_bshd(x, freqs.double()), t.double(), cotangent)
    assert found[0].dtype == dtype
    for value, reference in zip(found, expected):
        torch.testing.assert_close(value.double(), reference, **ROPE_TOLERANCE[dtype])
    torch.testing.assert_close(found[0][..., 8:], t[..., 8:], rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("cp_size", [1, 2])
def test_packed_rope_fusion_rotates_each_sequence_from_its_start_on_every_context_parallel_rank(cp_size, interleaved):
    """TE's packed (``thd``) fused RoPE contract: each sequence's positions start at 0, and context-parallel rank
    ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of every sequence. Reference: megatron-core's unfused RoPE on
    each whole sequence in float64, then the rank's chunks."""
    from megatron.core.models.common.embeddings import rope_utils

    lengths = [8, 4, 12]
    generator = torch.Generator().manual_seed(cp_size)
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    whole, freqs = _rope_inputs(sum(lengths), torch.float32, batch=1, generator=generator)
    cotangent = torch.randn(whole.shape, dtype=torch.float64, generator=generator)
    starts = cu_seqlens[:-1].tolist()
    expected = [torch.cat([_rope_step(lambda x: rope_utils._apply_rotary_pos_emb_bshd(
        x, freqs[:length].double(), rotary_interleaved=interleaved), whole[start:start + length].double(),
        cotangent[start:start + length])[part] for start, length in zip(starts, lengths)]) for part in (0, 1)]
    for rank in range(cp_size):
        rows = _rank_rows(starts, lengths, cp_size, rank)
        found = _rope_step(lambda x: rope_utils.fused_apply_rotary_pos_emb_thd(
            x[:, 0], cu_seqlens, freqs, cp_size=cp_size, cp_rank=rank, interleaved=interleaved)[:, None],
            whole[rows], cotangent[rows])
        for value, reference in zip(found, expected):
            torch.testing.assert_close(value.double(), reference[rows], **ROPE_TOLERANCE[torch.float32])


def _rank_rows(starts, lengths, cp_size, rank):
    """The rows of a pack (sequences of ``lengths`` from ``starts``) context-parallel rank ``rank`` holds."""
    return torch.cat([start + positions for start, positions in zip(starts, _rank_positions(lengths, cp_size, rank))])


def _rank_positions(lengths, cp_size, rank):
    """Per sequence, the positions context-parallel rank ``rank`` holds (megatron-core's load-balanced split)."""
    if cp_size == 1:
        return [torch.arange(length) for length in lengths]
    chunks = [torch.arange(length).chunk(2 * cp_size) for length in lengths]
    return [torch.cat((parts[rank], parts[2 * cp_size - 1 - rank])) for parts in chunks]


def _mla_layer_step(dtype, rope_fusion, weights=None):
    """One multi-latent-attention GPT layer (TE spec, YaRN RoPE) forward and backward: (output, input gradient,
    parameter gradients, weights)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    model_parallel_cuda_manual_seed(1)
    config = MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, q_lora_rank=32,
                                  kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
                                  rope_type="yarn", apply_rope_fusion=rope_fusion, multi_latent_attention=True,
                                  normalization="RMSNorm", use_cpu_initialization=True, params_dtype=dtype,
                                  hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False)
    layer = build_module(get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True), config=config,
                         layer_number=1)
    if weights is not None:
        layer.load_state_dict(weights)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(12, 2, 64, generator=generator, dtype=torch.float64).to(dtype).requires_grad_()
    out, _ = layer(x, attention_mask=None)
    out.backward(torch.randn(out.shape, generator=generator, dtype=torch.float64).to(dtype))
    grads = {name: param.grad for name, param in layer.named_parameters()}
    return out.detach(), x.grad, grads, layer.state_dict()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mla_rope_fusion_off_cuda_equals_megatrons_unfused_mla_rope(megatron_world, dtype):
    """Multi-latent attention with ``apply_rope_fusion`` (YaRN) calls megatron-core's triton kernels, which need
    CUDA; off CUDA the torch stand-ins run (counted), and the layer's output and every gradient equal the layer
    without rope fusion (megatron-core's unfused MLA RoPE)."""
    from megatron.core.transformer import multi_latent_attention

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        *unfused, weights = _mla_layer_step(dtype, rope_fusion=False)
        calls = []

        def counted(name):
            inner = getattr(multi_latent_attention, name)
            return lambda *args, **kwargs: calls.append(name) or inner(*args, **kwargs)

        names = ("fused_apply_mla_rope_for_q", "fused_apply_mla_rope_for_kv")
        with pytest.MonkeyPatch.context() as patch:
            for name in names:
                patch.setattr(multi_latent_attention, name, counted(name))
            *fused, _ = _mla_layer_step(dtype, rope_fusion=True, weights=weights)
    finally:
        torch.set_default_dtype(previous)
    assert calls == list(names)
    tolerance = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(fused[0], unfused[0], **tolerance)
    torch.testing.assert_close(fused[1], unfused[1], **tolerance)
    for name, grad in unfused[2].items():
        torch.testing.assert_close(fused[2][name], grad, **tolerance, msg=name)


@pytest.mark.parametrize("cp_size", [1, 2])
def test_packed_mla_rope_fusion_rotates_each_sequence_from_its_start(cp_size):
    """The ``thd`` form of the MLA stand-ins: every packed token rotated at its position in its sequence, on
    context-parallel ranks holding chunks ``r`` and ``2 cp - 1 - r``; reference: the ``sbhd`` form on each whole
    sequence, then the rank's rows. The key's rotated part is shared by the heads, after the no-position part."""
    from ascendspeed.accelerator.te_fallback import rope

    lengths, heads, nope, emb, v_dim = [8, 4, 12], 3, 5, 8, 6
    generator = torch.Generator().manual_seed(cp_size)
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    angles = torch.rand(16, 1, 1, emb, generator=generator, dtype=torch.float64) * 6
    cos, sin = angles.cos() * 1.1, angles.sin() * 1.1   # YaRN's caches carry its mscale
    q = torch.randn(sum(lengths), heads, nope + emb, generator=generator, dtype=torch.float64)
    kv = torch.randn(sum(lengths), heads, nope + v_dim, generator=generator, dtype=torch.float64)
    k_pos = torch.randn(sum(lengths), 1, emb, generator=generator, dtype=torch.float64)
    starts = cu_seqlens[:-1].tolist()
    pieces = [(rope.mla_rope_for_q(q[start:start + n, None], cos, sin, nope, emb)[:, 0],
               *(t[:, 0] for t in rope.mla_rope_for_kv(kv[start:start + n, None], k_pos[start:start + n, None],
                                                      cos, sin, emb, nope, v_dim)))
              for start, n in zip(starts, lengths)]
    expected = [torch.cat(parts) for parts in zip(*pieces)]
    assert torch.equal(expected[1][..., :nope], kv[..., :nope]) and torch.equal(expected[2], kv[..., nope:])
    assert torch.equal(expected[1][:, 0, nope:], expected[1][:, heads - 1, nope:])
    for rank in range(cp_size):
        rows = _rank_rows(starts, lengths, cp_size, rank)
        found = (rope.mla_rope_for_q(q[rows], cos, sin, nope, emb, cu_seqlens, rank, cp_size),
                 *rope.mla_rope_for_kv(kv[rows], k_pos[rows], cos, sin, emb, nope, v_dim, cu_seqlens, rank, cp_size))
        for value, reference in zip(found, expected):
            assert torch.equal(value, reference[rows])


def test_packed_rope_fusion_refuses_sequences_context_parallelism_cannot_split():
    from megatron.core.models.common.embeddings import rope_utils

    t, freqs = _rope_inputs(5, torch.float32, batch=1)
    with pytest.raises(ValueError, match="pad it to a multiple of 4"):
        rope_utils.fused_apply_rotary_pos_emb_thd(t[:, 0], torch.tensor([0, 5], dtype=torch.int32), freqs, cp_size=2)


#: THD packs for the context-parallel layer test: (cu_seqlens, cu_seqlens_padded or None), 24 tokens in all
TE_CP_PACKS = {"packed": ([0, 8, 12, 24], None), "padded": ([0, 6, 10, 21], [0, 8, 12, 24])}


def _megatron_splits_thd_batches() -> bool:
    """megatron-core 0.18+ splits a batch with ``cu_seqlens`` by TE's ``thd_get_partitioned_indices``."""
    import megatron.core.utils

    return hasattr(megatron.core.utils, "_get_batch_on_this_cp_rank_per_document_balancing")


def _thd_batch_on_this_cp_rank(cp_group):
    """megatron-core's own split of a packed batch (padded documents of 8, 4 and 12 tokens) on this rank."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    tokens = torch.arange(24)[None]
    batch = {"tokens": tokens, "labels": tokens + 100, "loss_mask": torch.ones(1, 24), "position_ids": tokens,
             "attention_mask": None, "cu_seqlens": torch.tensor([[0, 6, 10, 21]], dtype=torch.int32),
             "cu_seqlens_padded": torch.tensor([[0, 8, 12, 24]], dtype=torch.int32)}
    return get_batch_on_this_cp_rank(batch, False, cp_group)


def _te_layer_context_parallel_job(rank, world_size):
    """One TE-spec GPT layer built from a config alone (no context_parallel feature): whole sequences on one
    context-parallel rank, then the same weights and inputs over two (p2p and TE's default None: ring; a2a: Ulysses;
    a2a+p2p: the hybrid, here of one Ulysses group), float64; and
    the same for THD packs (with and without padding between the sequences), also in a layer whose mask type is
    padding (each sequence of a pack attends to itself whole)."""
    import copy

    from megatron.core.transformer.enums import AttnMaskType

    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ascendspeed.accelerator.te_fallback.modules import LocalTEDotProductAttention
    from ascendspeed.features.context_parallel import layout

    generator = torch.Generator().manual_seed(7)
    inputs = {"sbhd": (torch.randn(16, 2, 32, dtype=torch.float64, generator=generator), None)}
    mine = {"sbhd": layout.positions_on_rank(16, rank, world_size)}
    for name, (bounds, padded) in TE_CP_PACKS.items():
        inputs[name] = (torch.randn(24, 1, 32, dtype=torch.float64, generator=generator), PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=torch.tensor(bounds, dtype=torch.int32),
            cu_seqlens_kv=torch.tensor(bounds, dtype=torch.int32), max_seqlen_q=12, max_seqlen_kv=12,
            cu_seqlens_q_padded=None if padded is None else torch.tensor(padded, dtype=torch.int32),
            cu_seqlens_kv_padded=None if padded is None else torch.tensor(padded, dtype=torch.int32)))
        mine[name] = layout.packed_positions_on_rank(torch.tensor(padded or bounds), rank, world_size)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    results, weights = {}, None
    layer_specs = {"causal": get_gpt_layer_with_transformer_engine_spec()}
    layer_specs["padding"] = copy.deepcopy(layer_specs["causal"])
    layer_specs["padding"].submodules.self_attention.params["attn_mask_type"] = AttnMaskType.padding
    try:
        runs = [(mask_type, cp, comm) for mask_type in layer_specs
                for cp, comm in ((1, "p2p"), (2, "p2p"), (2, "a2a"), (2, None), (2, "a2a+p2p"))]
        for mask_type, cp, comm in runs:
            parallel_state.initialize_model_parallel(context_parallel_size=cp)
            model_parallel_cuda_manual_seed(1)
            try:
                config = _config(context_parallel_size=cp, cp_comm_type=comm,
                                 hierarchical_context_parallel_sizes=[2, 1] if comm == "a2a+p2p" else None)
                layer = build_module(layer_specs[mask_type], config=config, layer_number=1)
                attention = layer.self_attention.core_attention
                assert isinstance(attention, LocalTEDotProductAttention)
                assert (attention.__dict__.get("te_context_parallel") is not None) == (cp > 1)
                if weights is None:
                    weights = layer.state_dict()
                layer.load_state_dict(weights)
                if cp > 1 and comm == "p2p" and _megatron_splits_thd_batches():
                    results["thd batch"] = _thd_batch_on_this_cp_rank(parallel_state.get_context_parallel_group())
                for name, (hidden, packed_seq_params) in inputs.items():
                    if mask_type == "padding" and packed_seq_params is None:
                        continue  # a padding layer over whole sequences takes Megatron's attention_mask
                    layer.zero_grad()
                    cotangent = torch.linspace(-1, 1, hidden.numel(), dtype=hidden.dtype).view_as(hidden)
                    rows = mine[name] if cp > 1 else torch.arange(hidden.size(0))
                    local = hidden[rows].clone().requires_grad_(True)
                    output, _ = layer(local, attention_mask=None, packed_seq_params=packed_seq_params)
                    (output * cotangent[rows]).sum().backward()
                    grads = {n: param.grad.clone() for n, param in layer.named_parameters()}
                    for grad in grads.values():
                        torch.distributed.all_reduce(grad, group=parallel_state.get_context_parallel_group())
                    results[(mask_type, name, cp, comm)] = (output.detach(), local.grad, grads)
            finally:
                parallel_state.destroy_model_parallel()
    finally:
        torch.set_default_dtype(previous)
    return {"rows": mine, "results": results}


def test_te_attention_serves_context_parallelism_built_from_a_config_alone():
    """megatron-core's local attention asserts "Context parallelism is only supported by
    TEDotProductAttention!"; a model built from a config alone (megatron-core's API, Megatron's unit tests)
    with ``context_parallel_size=2`` and the TE spec now runs ascendspeed's context-parallel attention in the
    stand-in, and equals the one-rank layer: this rank's rows of the output and input gradient, and every
    weight gradient summed over the ranks. THD packs too (each sequence split over the ranks, padding rows
    zero as on one rank)."""
    from tests.helpers.distributed import run_distributed

    for result in run_distributed(_te_layer_context_parallel_job, 2, timeout=300):
        results = result["results"]
        if _megatron_splits_thd_batches():  # megatron-core's THD batch split: the rows the attention expects
            split = results["thd batch"]
            assert split["tokens"][0].tolist() == result["rows"]["padded"].tolist()
            assert split["labels"][0].tolist() == (result["rows"]["padded"] + 100).tolist()
        cases = {key[:2] for key in results if key != "thd batch"}
        assert cases == {("causal", name) for name in result["rows"]} | {("padding", name) for name in TE_CP_PACKS}
        for mask_type, name in cases:
            rows = result["rows"][name]
            whole_output, whole_input_grad, whole_grads = results[(mask_type, name, 1, "p2p")]
            for comm in ("p2p", "a2a", None, "a2a+p2p"):  # None: TE's default, p2p
                output, input_grad, grads = results[(mask_type, name, 2, comm)]
                torch.testing.assert_close(output, whole_output[rows], rtol=1e-12, atol=1e-12,
                                           msg=f"{mask_type} {name} {comm}")
                torch.testing.assert_close(input_grad, whole_input_grad[rows], rtol=1e-12, atol=1e-12)
                for param, grad in grads.items():
                    torch.testing.assert_close(grad, whole_grads[param], rtol=1e-11, atol=1e-11,
                                               msg=f"{mask_type} {name} {comm} {param}")


def test_te_attention_refuses_context_parallel_modes_it_cannot_serve(megatron_world):
    from megatron.core.transformer.enums import AttnMaskType

    from ascendspeed.accelerator.te_fallback.modules import _te_context_parallel_settings

    config = _config(context_parallel_size=4, cp_comm_type="a2a+p2p")
    with pytest.raises(ValueError, match="cp_comm_type 'allgather' has no local equivalent; use one of p2p, a2a, "
                                         "a2a\\+p2p"):
        _te_context_parallel_settings(config, AttnMaskType.causal, "allgather")
    assert _te_context_parallel_settings(config, AttnMaskType.padding, "p2p").mask_type == "general"
    with pytest.raises(ValueError, match="needs hierarchical_context_parallel_sizes"):
        _te_context_parallel_settings(config, AttnMaskType.causal, "a2a+p2p")
    config.hierarchical_context_parallel_sizes = [2, 2]
    assert _te_context_parallel_settings(config, AttnMaskType.causal, "a2a+p2p").ulysses_degree == 2


#: DeepSeek-V3's router (sigmoid scores, group-limited top-k, expert bias, scaling) and Mixtral's (softmax after
#: top-k), each with its auxiliary loss.
ROUTERS = {
    "sigmoid-group-limited": dict(moe_router_score_function="sigmoid", moe_router_num_groups=4,
                                  moe_router_group_topk=2, moe_router_enable_expert_bias=True,
                                  moe_router_topk_scaling_factor=2.5, moe_router_load_balancing_type="seq_aux_loss",
                                  moe_aux_loss_coeff=1e-2),
    "softmax-aux-loss": dict(moe_router_score_function="softmax", moe_router_load_balancing_type="aux_loss",
                             moe_aux_loss_coeff=1e-2),
}


def _routed(router_settings, fusion, inputs, cotangent):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    torch.manual_seed(7)
    config = _config(num_moe_experts=8, moe_router_topk=2, add_bias_linear=False, moe_router_fusion=fusion,
                     **router_settings)
    router = TopKRouter(config=config, pg_collection=get_default_pg_collection()).double()
    if getattr(router, "expert_bias", None) is not None:
        router.expert_bias.copy_(torch.linspace(-0.1, 0.1, 8, dtype=router.expert_bias.dtype))
    hidden = inputs.clone().requires_grad_(True)
    probs, routing_map = router(hidden)
    (probs.double() * cotangent).sum().backward()
    return probs.detach(), routing_map, hidden.grad, router.weight.grad


@pytest.mark.parametrize("router_settings", ROUTERS.values(), ids=ROUTERS.keys())
def test_router_fusion_routes_as_megatrons_unfused_router(megatron_world, router_settings):
    """``moe_router_fusion=True`` raised "fused_topk_with_score_function is not available. Please install TE >=
    2.6.0" at the first forward; it now routes as megatron-core's unfused router: the same probabilities,
    routing map, and gradients of the input and the gate (auxiliary losses included)."""
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(6, 2, 32, dtype=torch.float64, generator=generator)
    cotangent = torch.randn(12, 8, dtype=torch.float64, generator=generator)
    enable_features(num_experts=8)  # feature moe: the router's gating runs without TE on megatron-core 0.15 / 0.16
    try:
        fused = _routed(router_settings, True, inputs, cotangent)
        unfused = _routed(router_settings, False, inputs, cotangent)
    finally:
        disable_features(["moe"])
    assert fused[1].sum() == 12 * 2
    for found, expected in zip(fused, unfused):
        torch.testing.assert_close(found, expected, rtol=0, atol=0)
