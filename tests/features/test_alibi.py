"""--position-embedding-type alibi on real megatron-core: attention against float64, GPT, TP=2, training."""
import argparse

import pytest
import torch

from tests.helpers import megatron as mu  # installs ascendspeed (CPU shims) before megatron is used
from tests.helpers.distributed import run_distributed
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from ascendspeed.features import (
    FeatureArgumentError,
    add_feature_arguments,
    disable_features,
    enable_features,
    validate_features,
)
from ascendspeed.features.alibi import AlibiSettings, mark_config
from ascendspeed.ops.alibi import alibi_slopes
from ascendspeed.patching import MANAGER
from tests.helpers.megatron_lm import add_megatron_lm_to_path


@pytest.fixture(scope="module")
def megatron_world():
    """A one-process gloo world with megatron's parallel state, and the alibi feature's patches."""
    with mu.one_process_world():
        enable_features(position_embedding_type="alibi")
        yield
        disable_features(["alibi"])


def reference_attention(q, k, v, slopes, q_offset):
    """Causal softmax(q k^T / sqrt(d) - m (i - j)) v in float64, [b, heads, s, d], bias materialised."""
    q, k, v = q.double(), k.double(), v.double()
    distance = torch.arange(q_offset, q_offset + q.size(-2))[:, None] - torch.arange(k.size(-2))
    scores = q @ k.transpose(-1, -2) / q.size(-1) ** 0.5 - slopes.double()[:, None, None] * distance
    return torch.softmax(scores.masked_fill(distance < 0, float("-inf")), -1) @ v


def attention_module(heads, groups, head_dim, dtype, fused):
    config = mu.TinyGPT(hidden_size=heads * head_dim, num_attention_heads=heads).config(
        num_query_groups=groups, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        attention_softmax_in_fp32=True,
    )
    mark_config(config, AlibiSettings(fused=fused))
    return DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


# -- flags and validation ------------------------------------------------------------------------------
def megatron_like_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--position-embedding-type", default="learned_absolute",
                        choices=["learned_absolute", "rope", "mrope", "relative", "none"])
    return add_feature_arguments(parser)


def test_alibi_is_a_position_embedding_choice():
    args = megatron_like_parser().parse_args(["--position-embedding-type", "alibi", "--alibi-fused-attention"])
    assert args.position_embedding_type == "alibi" and args.alibi_fused_attention


@pytest.mark.megatron_lm
def test_megatron_lm_parser_accepts_alibi():
    import sys

    add_megatron_lm_to_path()
    from megatron.training import arguments

    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(["--position-embedding-type", "alibi", "--transformer-impl", "local"])
    assert args.position_embedding_type == "alibi"


def test_transformer_engine_impl_runs_alibi_only_without_transformer_engine(monkeypatch):
    """TEDotProductAttention is megatron-core's DotProductAttention where TE is absent (accelerator.te_fallback);
    with TE installed its attention has no ALiBi and the flag is refused."""
    from ascendspeed.accelerator import te_fallback

    parser = megatron_like_parser()
    parser.add_argument("--transformer-impl", default="local")
    args = parser.parse_args(["--position-embedding-type", "alibi", "--transformer-impl", "transformer_engine"])
    monkeypatch.setattr(te_fallback, "needed", lambda: True)
    assert "alibi" in [f.name for f in validate_features(args)]
    monkeypatch.setattr(te_fallback, "needed", lambda: False)
    with pytest.raises(FeatureArgumentError, match="--transformer-impl transformer_engine"):
        validate_features(args)


@pytest.mark.parametrize("flags,named", [
    (["--sft"], "--sft"),
    (["--apply-query-key-layer-scaling"], "--apply-query-key-layer-scaling"),
    (["--alibi-fused-attention", "--reset-attention-mask"], "--reset-attention-mask"),
    (["--alibi-fused-attention", "--window-size", "(64,0)"], "--window-size"),
])
def test_unsupported_combinations_fail_naming_the_flag(flags, named):
    parser = megatron_like_parser()
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--transformer-impl", default="local")
    parser.add_argument("--sft", action="store_true")
    parser.add_argument("--apply-query-key-layer-scaling", action="store_true")
    parser.add_argument("--reset-attention-mask", action="store_true")
    parser.add_argument("--window-size", default=None)
    args = parser.parse_args(["--position-embedding-type", "alibi", *flags])
    with pytest.raises(FeatureArgumentError, match=named):
        validate_features(args)


def test_fused_flag_needs_alibi():
    args = megatron_like_parser().parse_args(["--alibi-fused-attention"])
    with pytest.raises(FeatureArgumentError, match="needs --position-embedding-type alibi"):
        validate_features(args)


def test_patches_are_listed_and_name_their_targets(megatron_world):
    targets = {row["target"] for row in MANAGER.report() if row["feature"] == "alibi"}
    assert targets == {
        "megatron.core.models.gpt.gpt_model:GPTModel.__init__",
        "megatron.core.transformer.dot_product_attention:DotProductAttention.__init__",
        "megatron.core.transformer.dot_product_attention:DotProductAttention.forward",
        "megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.forward",
    }


# -- Megatron's DotProductAttention against the float64 reference ------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True], ids=["local", "fused"])
@pytest.mark.parametrize("sq,sk", [(16, 16), (96, 96), (1, 40), (7, 64)])
def test_attention_matches_float64_reference(megatron_world, dtype, fused, sq, sk):
    heads, groups, head_dim, batch = 4, 2, 16, 2
    module = attention_module(heads, groups, head_dim, dtype, fused)
    q = torch.randn(sq, batch, heads, head_dim).to(dtype).requires_grad_()
    k, v = (torch.randn(sk, batch, groups, head_dim).to(dtype).requires_grad_() for _ in range(2))
    offset = sk - sq
    mask = None
    if sq > 1 and sq != sk:  # Megatron builds the mask itself only for sq == sk
        mask = (torch.arange(sk) > torch.arange(offset, offset + sq)[:, None]).view(1, 1, sq, sk)
    out = module(q, k, v, mask)  # [s, b, heads, d] in, [sq, b, heads * d] out
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_q, ref_k, ref_v = (t.permute(1, 2, 0, 3) for t in leaves)
    ref_k, ref_v = ref_k.repeat_interleave(2, dim=1), ref_v.repeat_interleave(2, dim=1)
    expected = reference_attention(ref_q, ref_k, ref_v, alibi_slopes(heads), offset)
    expected = expected.permute(2, 0, 1, 3).reshape(sq, batch, heads * head_dim)
    expected.backward(grad_out.double())

    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    assert mu.relative_error(out, expected) < tolerance
    for actual, leaf in zip((q, k, v), leaves):
        assert mu.relative_error(actual.grad, leaf.grad) < 2 * tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_local_path_softmax_and_its_backward_see_no_subnormals(megatron_world, dtype):
    """At 1024 tokens ALiBi's steepest heads make distant keys' probabilities subnormal, which many x86
    CPUs process a hundred times slower; the local path flushes them to zero forward and backward and
    restores the threads' mode afterwards."""
    tiny = torch.finfo(torch.float32).tiny
    heads, head_dim, s = 4, 16, 1024
    module = attention_module(heads, heads, head_dim, dtype, fused=False)
    q, k, v = (torch.randn(s, 1, heads, head_dim).to(dtype).requires_grad_() for _ in range(3))
    captured = {}

    def keep_probs(softmax, inputs, probs):
        def keep_modes(grad):
            captured["modes"] = list(torch.ops.ascendspeed._flush_subnormals_states())

        def keep_grad(grad):
            captured["grad_scores"] = grad

        captured["probs"] = probs
        probs.register_hook(keep_modes)
        inputs[0].register_hook(keep_grad)

    handle = module.scale_mask_softmax.register_forward_hook(keep_probs)
    try:
        out = module(q, k, v, None)
        out.backward(torch.randn_like(out))
    finally:
        handle.remove()

    probs = captured["probs"].float()
    visible = torch.ones(s, s, dtype=torch.bool).tril()
    unflushed = torch.softmax(_scores_of(q, k, heads).masked_fill(~visible, float("-inf")), -1)[:, :, visible]
    assert ((unflushed != 0) & (unflushed < tiny)).sum() > 1000, "the test must produce subnormal probabilities"
    assert ((probs != 0) & (probs.abs() < tiny)).sum() == 0
    grad_scores = captured["grad_scores"].float()
    assert ((grad_scores != 0) & (grad_scores.abs() < tiny)).sum() == 0
    assert all(captured["modes"]), "the softmax backward runs flushed on every thread"
    assert not any(torch.ops.ascendspeed._flush_subnormals_states()), "and the mode is restored afterwards"


def _scores_of(q, k, heads):
    """The local path's biased scores [1, heads, s, s] in fp32, recomputed without flushing."""
    q, k = (t.detach().float().permute(1, 2, 0, 3) for t in (q, k))
    s = q.size(-2)
    scores = q @ k.transpose(-1, -2) / q.size(-1) ** 0.5
    distance = torch.arange(s)[:, None] - torch.arange(s)
    return scores - alibi_slopes(heads)[:, None, None] * distance


def test_fused_and_local_attention_agree(megatron_world):
    torch.manual_seed(torch.seed())
    q, k, v = (torch.randn(64, 2, 4, 16, requires_grad=True) for _ in range(3))
    results = []
    for fused in (False, True):
        module = attention_module(4, 4, 16, torch.float32, fused)
        out = module(q, k, v, None)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        results.append((out, *grads))
    for local, fused in zip(*results):
        torch.testing.assert_close(fused, local, rtol=1e-5, atol=1e-5)


def test_cross_attention_is_rejected(megatron_world):
    config = mu.TinyGPT().config()
    mark_config(config, AlibiSettings())
    with pytest.raises(ValueError, match="cross attention"):
        DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.padding, attention_type="cross")


def test_non_causal_self_attention_uses_the_symmetric_bias(megatron_world):
    config = mu.TinyGPT().config()
    mark_config(config, AlibiSettings())
    module = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.padding, attention_type="self")
    q, k, v = (torch.randn(12, 1, 4, 8) for _ in range(3))
    out = module(q, k, v, torch.zeros(1, 1, 12, 12, dtype=torch.bool))
    qd, kd, vd = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    distance = (torch.arange(12)[:, None] - torch.arange(12)).abs()
    scores = qd @ kd.transpose(-1, -2) / 8**0.5 - alibi_slopes(4).double()[:, None, None] * distance
    expected = (torch.softmax(scores, -1) @ vd).permute(2, 0, 1, 3).reshape(12, 1, 32)
    assert mu.relative_error(out, expected) < 1e-5


# -- the GPT -------------------------------------------------------------------------------------------
def build_gpt(position_embedding_type, fused=False):
    torch.manual_seed(mu.SEED)
    model_parallel_cuda_manual_seed(mu.SEED)
    config = mu.TinyGPT().config()
    if position_embedding_type == "alibi":
        mark_config(config, AlibiSettings(fused=fused))
    return mu.build_gpt_model(config, position_embedding_type=position_embedding_type)


def gpt_loss(model, batch):
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return mu.masked_mean_loss(output, batch["loss_mask"])


def core_attentions(model):
    return [layer.self_attention.core_attention for layer in model.decoder.layers]


def test_gpt_with_alibi_has_no_position_embedding_and_alibi_everywhere(megatron_world):
    model = build_gpt("alibi")
    assert model.position_embedding_type == "none"
    assert not model.embedding.add_position_embedding
    assert all(attention.alibi.causal and attention.alibi.tp_size == 1 for attention in core_attentions(model))


def test_bias_is_applied_and_zero_slopes_equal_no_position_embedding(megatron_world):
    batch = mu.make_batch(seed=int(torch.randint(0, 1000, ())))
    reference = gpt_loss(build_gpt("none"), batch)
    alibi = build_gpt("alibi")
    with_alibi = gpt_loss(alibi, batch)

    for attention in core_attentions(alibi):
        attention.alibi.slopes = 2 * alibi_slopes(4)
    steeper = gpt_loss(alibi, batch)
    for attention in core_attentions(alibi):
        attention.alibi.slopes = torch.zeros(4)
    flat = gpt_loss(alibi, batch)

    assert with_alibi != reference and steeper != with_alibi
    assert flat == reference


def test_gpt_fused_and_local_paths_agree(megatron_world):
    batch = mu.make_batch(seed=int(torch.randint(0, 1000, ())))
    losses, grads = [], []
    for fused in (False, True):
        model = build_gpt("alibi", fused=fused)
        loss = gpt_loss(model, batch)
        loss.backward()
        losses.append(loss.item())
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert mu.max_relative_error(grads[1], grads[0]) < 1e-5


def test_config_with_alibi_refuses_another_position_embedding(megatron_world):
    config = mu.TinyGPT().config()
    mark_config(config, AlibiSettings())
    with pytest.raises(ValueError, match="position_embedding_type='rope'"):
        mu.build_gpt_model(config, position_embedding_type="rope")


# -- two ranks: TP=2 equals TP=1, and the pretraining entry trains with ALiBi --------------------------
def _two_rank_worker(rank, world_size):
    from ascendspeed.training.arguments import parse_args
    from ascendspeed.training.trainer import train

    enable_features(position_embedding_type="alibi")
    shape = mu.TinyGPT(num_attention_heads=4)
    batch = mu.make_batch(shape, batch_size=4)

    mu.initialize_parallel(tp=1)
    reference = mu.build_gpt_model(shape.config(), shape, position_embedding_type="alibi")
    full = mu.full_parameters(reference)
    reference_losses = mu.reference_forward_backward(reference, batch, shape)
    full_grads = {name: param.grad for name, param in mu.named_parameters_full([reference])}
    mu.destroy_parallel()

    mu.initialize_parallel(tp=2)
    chunks = mu.build_model_chunks(shape.config(), shape, position_embedding_type="alibi")
    mu.load_full_parameters(chunks, full)
    losses = mu.run_forward_backward(chunks, batch, shape)
    config = chunks[0].config
    grad_error = max(
        mu.relative_error(param.grad, mu.shard_like(full_grads[name], param, name, config))
        for name, param in mu.named_parameters_full(chunks)
    )
    local_slopes = core_attentions(chunks[0])[0].alibi.slopes_on(torch.device("cpu")).clone()
    mu.destroy_parallel()

    args = parse_args([
        "--position-embedding-type", "alibi", "--tensor-model-parallel-size", "2",
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "8", "--train-iters", "30", "--lr-warmup-iters", "3", "--lr", "3e-3",
        "--eval-interval", "1000", "--log-interval", "1000", "--eval-seq-lengths", "64", "--split", "998,2",
    ], world_size=world_size)
    result = train(args)
    return {
        "loss_error": max(abs(a.item() - b.item()) for a, b in zip(losses, reference_losses)),
        "grad_error": grad_error,
        "local_slopes": local_slopes,
        "train_losses": result.losses,
        "features": result.features,
    }


def test_tensor_parallel_alibi_equals_one_rank_and_trains():
    results = run_distributed(_two_rank_worker, 2)
    full = alibi_slopes(4)
    for rank, result in enumerate(results):
        assert result["loss_error"] < 1e-5
        assert result["grad_error"] < 1e-4
        assert torch.equal(result["local_slopes"], full[2 * rank : 2 * rank + 2])
        assert "alibi" in result["features"]
        losses = result["train_losses"]
        assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses


def test_fused_where_exact_applies_every_mask_as_given(megatron_world):
    """Under Megatron's default --attention-backend auto ALiBi layers take the fused kernel, whose causal mask
    is built in: a call with any other mask (documents) takes the local path and applies it."""
    heads, head_dim, s, batch = 4, 8, 12, 2
    config = mu.TinyGPT(hidden_size=heads * head_dim, num_attention_heads=heads).config()
    mark_config(config, AlibiSettings(fused_where_exact=True))
    module = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    local_config = mu.TinyGPT(hidden_size=heads * head_dim, num_attention_heads=heads).config()
    mark_config(local_config, AlibiSettings())
    local = DotProductAttention(local_config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                attention_type="self")
    q, k, v = (torch.randn(s, batch, heads, head_dim) for _ in range(3))
    causal = torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)
    documents = causal.clone().repeat(batch, 1, 1, 1)
    documents[:, :, 5:, :5] = True
    for mask, fused_expected in ((None, True), (causal, True), (documents, False)):
        with torch.autograd.profiler.profile() as profile:
            out = module(q, k, v, mask)
        fused_ran = any(event.name == "ascendspeed::alibi_flash_attention" for event in profile.function_events)
        assert fused_ran == fused_expected, mask
        torch.testing.assert_close(out, local(q, k, v, causal if mask is None else mask), rtol=2e-5, atol=2e-6)
