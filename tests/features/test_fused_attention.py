"""Fused core attention (``--attention-backend auto|flash|fused``) on real megatron-core ``DotProductAttention``:
every mask form against float64 and against Megatron's own materialised path (``--attention-backend
unfused``), forward and backward, fp32 / bf16 / fp16; the calls that must keep Megatron's path; a GPT whose
loss and gradients do not depend on the backend."""
import argparse
import contextlib
import itertools
import os

import pytest
import torch

from tests.helpers import megatron as mu  # installs ascendspeed (CPU shims) before megatron is used
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend, AttnMaskType

from ascendspeed.accelerator import cpu_half_gemm
from ascendspeed.features import disable_features, enable_features, validate_features
from ascendspeed.features.fused_attention.attention import MaskPlan, fused_core_attention, mask_plan, why_unfused

FUSED_KERNEL = "aten::_scaled_dot_product_flash_attention_for_cpu"
OWN_KERNEL = "ascendspeed::alibi_flash_attention"
#: dtype -> relative tolerance against float64 (outputs; gradients get twice as much).
TOLERANCES = {torch.float32: 2e-6, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}


@contextlib.contextmanager
def half_gemm_policy(policy):
    """``ASCENDSPEED_CPU_HALF_GEMM`` while the feature reads its settings."""
    saved = os.environ.get(cpu_half_gemm.ENVIRONMENT_VARIABLE)
    os.environ[cpu_half_gemm.ENVIRONMENT_VARIABLE] = policy
    try:
        yield
    finally:
        if saved is None:
            del os.environ[cpu_half_gemm.ENVIRONMENT_VARIABLE]
        else:
            os.environ[cpu_half_gemm.ENVIRONMENT_VARIABLE] = saved


@pytest.fixture(scope="module")
def megatron_world():
    """The feature as on a CPU with fast half-precision GEMMs, whatever this one has (``fp32_products`` below
    is the other case)."""
    with mu.one_process_world():
        with half_gemm_policy("native"):
            enable_features(attention_backend="auto")
        yield
        disable_features(["fused_attention"])


@pytest.fixture
def fp32_products(megatron_world):
    """The feature as on a CPU without fast bf16 / fp16 GEMMs (no AVX-512): ``ASCENDSPEED_CPU_HALF_GEMM=fp32``."""
    disable_features(["fused_attention"])
    with half_gemm_policy("fp32"):
        enable_features(attention_backend="auto")
    try:
        yield
    finally:
        disable_features(["fused_attention"])
        with half_gemm_policy("native"):
            enable_features(attention_backend="auto")


def attention(heads, groups, head_dim, dtype, mask_type=AttnMaskType.causal, backend=AttnBackend.auto, **overrides):
    config = mu.TinyGPT(hidden_size=heads * head_dim, num_attention_heads=heads).config(
        num_query_groups=groups, params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        attention_softmax_in_fp32=True, attention_backend=backend, **overrides)
    return DotProductAttention(config, layer_number=1, attn_mask_type=mask_type, attention_type="self")


def causal(sq, sk):
    return torch.ones(sq, sk, dtype=torch.bool).triu(diagonal=1).view(1, 1, sq, sk)


def block_diagonal_causal(batch, length, documents):
    """Megatron-LM's --reset-attention-mask: causal within each document of a packed sequence, per sample."""
    mask = causal(length, length).repeat(batch, 1, 1, 1)
    for sample, ends in enumerate(documents):
        for end in ends:
            mask[sample, 0, end:, :end] = True
    return mask


def key_padding(batch, sq, sk, lengths):
    """Padding masks as Megatron's BERT builds them: key j of sample b is masked beyond its length."""
    mask = torch.zeros(batch, 1, sq, sk, dtype=torch.bool)
    for sample, length in enumerate(lengths):
        mask[sample, 0, :, length:] = True
    return mask


def reference(q, k, v, mask, scale):
    """softmax(q k^T * scale, masked keys excluded) v in float64; [s, b, heads, d] in, [s, b, heads * d] out."""
    groups = q.shape[2] // k.shape[2]
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.permute(2, 0, 1, 3).flatten(2)


def run(module, q, k, v, mask, grad, kernels=False):
    """Output and input gradients of one call, and whether the fused kernel ran (with ``kernels``: the set of
    (kernel, operand dtype) that ran, torch's flash kernel or ascendspeed's)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with torch.autograd.profiler.profile(record_shapes=True) as profile:
        out = module(q, k, v, mask)
        out.backward(grad)
    ran = {(event.name, event.input_dtypes[0]) for event in profile.function_events
           if event.name in (FUSED_KERNEL, OWN_KERNEL)}
    return out, (q.grad, k.grad, v.grad), ran if kernels else any(name == FUSED_KERNEL for name, _ in ran)


# name -> (heads, groups, sq, sk, mask type, mask builder(batch, sq, sk))
CASES = {
    "causal, no mask given": (4, 4, 24, 24, AttnMaskType.causal, lambda b, sq, sk: None),
    "causal mask given": (4, 2, 24, 24, AttnMaskType.causal, lambda b, sq, sk: causal(sq, sk)),
    "reset attention mask": (4, 4, 24, 24, AttnMaskType.causal,
                             lambda b, sq, sk: block_diagonal_causal(b, sq, [[5, 17], [11]])),
    "key padding": (2, 1, 16, 20, AttnMaskType.padding, lambda b, sq, sk: key_padding(b, sq, sk, [20, 7])),
    "no mask": (4, 2, 8, 40, AttnMaskType.no_mask, lambda b, sq, sk: None),
}


def case_inputs(case, dtype, batch=2, head_dim=16):
    """(heads, groups, head_dim, mask type, mask, q, k, v, grad) of one of ``CASES``, fresh random values."""
    heads, groups, sq, sk, mask_type, make_mask = CASES[case]
    q = torch.randn(sq, batch, heads, head_dim).to(dtype)
    k, v = (torch.randn(sk, batch, groups, head_dim).to(dtype) for _ in range(2))
    grad = torch.randn(sq, batch, heads * head_dim).to(dtype)
    return heads, groups, head_dim, mask_type, make_mask(batch, sq, sk), q, k, v, grad


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_path_matches_float64_and_megatron(megatron_world, case, dtype):
    heads, groups, head_dim, mask_type, mask, q, k, v, grad = case_inputs(case, dtype)
    sq, sk = q.shape[0], k.shape[0]

    fused_module = attention(heads, groups, head_dim, dtype, mask_type)
    out, grads, fused_ran = run(fused_module, q, k, v, mask, grad)
    megatron_out, megatron_grads, megatron_fused = run(
        attention(heads, groups, head_dim, dtype, mask_type, backend=AttnBackend.unfused), q, k, v, mask, grad)
    assert fused_ran == (dtype == torch.float32) and not megatron_fused  # CPU_REDUCED_PRECISION: Megatron's
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    expected = reference(*leaves, mask if mask is not None or mask_type != AttnMaskType.causal else causal(sq, sk),
                         fused_module.softmax_scale)
    expected.backward(grad.double())

    tolerance = TOLERANCES[dtype]
    assert out.dtype == dtype and out.shape == expected.shape
    assert mu.relative_error(out, expected) < tolerance
    for actual, leaf in zip(grads, leaves):
        assert mu.relative_error(actual, leaf.grad) < 2 * tolerance
    if not fused_ran:  # the kernel itself, as other devices run it in this dtype
        plan = mask_plan(mask_type == AttnMaskType.causal, mask, sq, sk)
        kernel_inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        kernel_out = fused_core_attention(fused_module, *kernel_inputs, plan)
        kernel_out.backward(grad)
        assert mu.relative_error(kernel_out, expected) < tolerance
        for actual, leaf in zip(kernel_inputs, leaves):
            assert mu.relative_error(actual.grad, leaf.grad) < 2 * tolerance
    # No worse than Megatron's own path, within a rounding step of the dtype.
    assert mu.relative_error(out, expected) <= mu.relative_error(megatron_out, expected) + tolerance / 4
    for actual, megatron, leaf in zip(grads, megatron_grads, leaves):
        assert mu.relative_error(actual, leaf.grad) <= mu.relative_error(megatron, leaf.grad) + tolerance / 2


def test_mask_plans():
    assert mask_plan(True, None, 8, 8) == MaskPlan(causal=True)
    assert mask_plan(True, None, 1, 8) == MaskPlan(causal=False)  # one query sees every key, as in Megatron
    assert mask_plan(True, None, 4, 8) is None  # Megatron's default causal mask needs sq == sk
    assert mask_plan(False, None, 4, 8) == MaskPlan(causal=False)
    assert mask_plan(True, causal(8, 8), 8, 8) == MaskPlan(causal=True)
    assert mask_plan(False, causal(8, 8).expand(3, 1, 8, 8), 8, 8) == MaskPlan(causal=True)
    reset = block_diagonal_causal(2, 8, [[3], [5]])
    plan = mask_plan(True, reset, 8, 8)
    assert not plan.causal and torch.equal(plan.allowed, ~reset)
    fully_masked_row = key_padding(2, 8, 8, [8, 0])
    assert mask_plan(False, fully_masked_row, 8, 8) is None  # Megatron averages every value there
    assert mask_plan(True, causal(8, 8).float(), 8, 8) is None


def test_a_mask_changed_in_place_is_checked_again():
    mask = causal(8, 8)
    assert mask_plan(True, mask, 8, 8).causal
    mask[0, 0, 7, 0] = True
    assert not mask_plan(True, mask, 8, 8).causal


def test_calls_the_fused_kernel_cannot_reproduce_keep_megatron_s_path(megatron_world):
    heads, head_dim = 4, 8
    q, k, v = (torch.randn(12, 2, heads, head_dim) for _ in range(3))

    dropout = attention(heads, heads, head_dim, torch.float32, attention_dropout=0.1)
    assert why_unfused(dropout, None, None, None) is not None
    dropout.eval()
    assert why_unfused(dropout, None, None, None) is None  # nothing is drawn in evaluation
    for backend in (AttnBackend.unfused, AttnBackend.local):
        assert "attention_backend" in why_unfused(attention(heads, heads, head_dim, torch.float32, backend=backend),
                                                  None, None, None)
    scaled = attention(heads, heads, head_dim, torch.float16, apply_query_key_layer_scaling=True)
    assert why_unfused(scaled, None, None, None) is not None

    # A row whose every key is masked: Megatron's -10000 fill averages all values; that is what runs.
    module = attention(heads, heads, head_dim, torch.float32, AttnMaskType.padding)
    mask = key_padding(2, 12, 12, [12, 0])
    out, _, fused_ran = run(module, q, k, v, mask, torch.ones(12, 2, heads * head_dim))
    assert not fused_ran and torch.isfinite(out).all()
    torch.testing.assert_close(out[:, 1], v[:, 1].mean(0, keepdim=True).expand(12, -1, -1).flatten(1))


def test_the_backend_flag_enables_the_feature():
    def enabled(backend):
        return "fused_attention" in [f.name for f in validate_features(argparse.Namespace(attention_backend=backend))]

    assert all(enabled(backend) for backend in ("auto", "flash", "fused", AttnBackend.auto, AttnBackend.flash))
    assert not any(enabled(backend) for backend in ("unfused", "local", AttnBackend.unfused, AttnBackend.local))
    from ascendspeed.training.arguments import parse_args

    assert parse_args([]).attention_backend == "auto"
    assert parse_args(["--attention-backend", "local"]).attention_backend == "local"


def test_gpt_loss_and_gradients_do_not_depend_on_the_backend(megatron_world, monkeypatch):
    shape = mu.TinyGPT(num_layers=2, seq_length=32)
    batch = mu.make_batch(shape, batch_size=4)
    results = []
    for backend in (AttnBackend.auto, AttnBackend.unfused):
        for variable in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):  # a model sets them for TE
            monkeypatch.delenv(variable, raising=False)
        torch.manual_seed(mu.SEED)
        model_parallel_cuda_manual_seed(mu.SEED)
        model = mu.build_gpt_model(shape.config(attention_backend=backend), shape)
        losses = mu.reference_forward_backward(model, batch, shape)
        results.append((torch.stack(losses), mu.gradients([model])))
    (fused_loss, fused_grads), (megatron_loss, megatron_grads) = results
    torch.testing.assert_close(fused_loss, megatron_loss, rtol=1e-6, atol=0)
    assert fused_grads.keys() == megatron_grads.keys()
    for name in megatron_grads:
        assert mu.relative_error(fused_grads[name], megatron_grads[name]) < 1e-5, name


def _run_pack(module, packed, total, heads, groups, head_dim, dtype):
    """Forward and backward of ``module`` on a random THD pack: the inputs, output, output gradient and the
    inputs' float64 leaves for the reference."""
    q = torch.randn(total, heads, head_dim).to(dtype).requires_grad_()
    k, v = (torch.randn(total, groups, head_dim).to(dtype).requires_grad_() for _ in range(2))
    out = module(q, k, v, None, packed_seq_params=packed)
    grad = torch.randn_like(out)
    out.backward(grad)
    return (q, k, v), out, grad, [t.detach().double().requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_thd_pack_attends_within_each_sequence(megatron_world, dtype):
    """Transformer Engine's packed format, which Megatron's local attention refuses: [tokens, heads, d]
    sequences one after another; tokens after the last boundary are one more sequence."""
    from megatron.core.packed_seq_params import PackedSeqParams

    heads, groups, head_dim, bounds, total = 4, 2, 8, [0, 5, 12, 20], 23
    module = attention(heads, groups, head_dim, dtype)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=8, max_seqlen_kv=8)
    (q, k, v), out, grad, leaves = _run_pack(module, packed, total, heads, groups, head_dim, dtype)
    pieces = [reference(*(t[start:end].unsqueeze(1) for t in leaves), None if end - start == 1 else
                        causal(end - start, end - start), module.softmax_scale)
              for start, end in zip(bounds + [20], bounds[1:] + [total])]
    expected = torch.cat(pieces).squeeze(1)
    expected.backward(grad.double())
    tolerance = TOLERANCES[dtype]
    assert out.shape == (total, heads * head_dim)
    assert mu.relative_error(out, expected) < tolerance
    for actual, leaf in zip((q, k, v), leaves):
        assert mu.relative_error(actual.grad, leaf.grad) < 2 * tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_thd_pack_with_padding_between_sequences(megatron_world, dtype):
    """TE's padded THD layout: sequence i starts at cu_seqlens_padded[i]; the rest of its slot, and the tokens
    after the last slot, are padding: attended by nobody, output zero, no gradient."""
    from megatron.core.packed_seq_params import PackedSeqParams

    heads, groups, head_dim, total = 4, 2, 8, 26
    lengths, slots = [5, 7, 1, 8], [0, 8, 16, 17, 25]
    module = attention(heads, groups, head_dim, dtype)
    bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                             cu_seqlens_q_padded=torch.tensor(slots, dtype=torch.int32),
                             cu_seqlens_kv_padded=torch.tensor(slots, dtype=torch.int32), max_seqlen_q=8,
                             max_seqlen_kv=8)
    (q, k, v), out, grad, leaves = _run_pack(module, packed, total, heads, groups, head_dim, dtype)
    expected = torch.zeros(total, heads * head_dim, dtype=torch.float64)
    tokens = torch.zeros(total, dtype=torch.bool)
    for start, length in zip(slots, lengths):
        piece = reference(*(t[start:start + length].unsqueeze(1) for t in leaves), causal(length, length),
                          module.softmax_scale)
        expected = expected.index_put((torch.arange(start, start + length),), piece.squeeze(1))
        tokens[start:start + length] = True
    expected.backward(grad.double())
    tolerance = TOLERANCES[dtype]
    assert out.shape == (total, heads * head_dim) and not out[~tokens].any()
    assert mu.relative_error(out, expected) < tolerance
    for actual, leaf in zip((q, k, v), leaves):
        assert not actual.grad[~tokens].any()
        assert mu.relative_error(actual.grad, leaf.grad) < 2 * tolerance

    too_small = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                                cu_seqlens_q_padded=torch.tensor([0, 4, 12, 13, 21], dtype=torch.int32),
                                cu_seqlens_kv_padded=torch.tensor([0, 4, 12, 13, 21], dtype=torch.int32))
    with pytest.raises(ValueError, match="padded boundaries"):
        module(q, k, v, None, packed_seq_params=too_small)


def test_a_thd_pack_with_attention_dropout_runs_the_kernel_s_dropout(megatron_world):
    """Megatron's path refuses packs, so dropout in a pack is the kernel's (as in TE), drawn in the stream
    Megatron's attention dropout uses."""
    from megatron.core.packed_seq_params import PackedSeqParams

    heads, head_dim, total = 2, 8, 16
    module = attention(heads, heads, head_dim, torch.float32, attention_dropout=0.5)
    cu_seqlens = torch.tensor([0, 7, 16], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens)
    q, k, v = (torch.randn(total, heads, head_dim) for _ in range(3))
    module.eval()
    without = module(q, k, v, None, packed_seq_params=packed)
    module.train()
    with_dropout = module(q, k, v, None, packed_seq_params=packed)
    assert with_dropout.shape == without.shape and torch.isfinite(with_dropout).all()
    assert not torch.allclose(with_dropout, without)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_half_precision_without_a_fast_gemm_computes_in_fp32(fp32_products, case, dtype):
    """On a CPU without a fast GEMM for the dtype, Megatron's materialised scores would run torch's scalar
    GEMM: a plain causal call runs ascendspeed's flash kernel in the dtype (fp32 sums), any other mask torch's
    flash kernel in fp32; both against float64."""
    heads, groups, head_dim, mask_type, mask, q, k, v, grad = case_inputs(case, dtype)
    sq, sk = q.shape[0], k.shape[0]
    module = attention(heads, groups, head_dim, dtype, mask_type)
    out, grads, ran = run(module, q, k, v, mask, grad, kernels=True)
    plan = mask_plan(mask_type == AttnMaskType.causal, mask, sq, sk)
    expected_kernel = (OWN_KERNEL, {torch.bfloat16: "c10::BFloat16", torch.float16: "c10::Half"}[dtype]) \
        if plan.causal else (FUSED_KERNEL, "float")
    assert ran == {expected_kernel}

    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    expected = reference(*leaves, mask if mask is not None or mask_type != AttnMaskType.causal else causal(sq, sk),
                         module.softmax_scale)
    expected.backward(grad.double())
    assert out.dtype == dtype and out.shape == expected.shape
    assert mu.relative_error(out, expected) < TOLERANCES[dtype]
    for actual, leaf in zip(grads, leaves):
        assert actual.dtype == dtype
        assert mu.relative_error(actual, leaf.grad) < 2 * TOLERANCES[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("te_stand_in", [False, True], ids=["local", "te-stand-in"])
def test_a_half_precision_thd_pack_without_a_fast_gemm_computes_in_fp32(fp32_products, te_stand_in, dtype):
    """A THD pack on a CPU without a fast GEMM for the dtype, in megatron-core's local attention and in the
    Transformer Engine stand-in (which serves packs itself): torch's flash kernel on fp32 copies, against
    float64."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from ascendspeed.accelerator.te_fallback.modules import LocalTEDotProductAttention

    heads, groups, head_dim, bounds, total = 4, 2, 8, [0, 5, 12, 20], 20
    module = attention(heads, groups, head_dim, dtype)
    if te_stand_in:
        with half_gemm_policy("fp32"):
            module = LocalTEDotProductAttention(module.config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                                attention_type="self")
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=8, max_seqlen_kv=8)
    with torch.autograd.profiler.profile(record_shapes=True) as profile:
        (q, k, v), out, grad, leaves = _run_pack(module, packed, total, heads, groups, head_dim, dtype)
    assert {(event.name, event.input_dtypes[0]) for event in profile.function_events
            if event.name in (FUSED_KERNEL, OWN_KERNEL)} == {(FUSED_KERNEL, "float")}
    expected = torch.cat([reference(*(t[start:end].unsqueeze(1) for t in leaves), causal(end - start, end - start),
                                    module.softmax_scale) for start, end in zip(bounds, bounds[1:])]).squeeze(1)
    expected.backward(grad.double())
    assert out.dtype == dtype and mu.relative_error(out, expected) < TOLERANCES[dtype]
    for actual, leaf in zip((q, k, v), leaves):
        assert actual.grad.dtype == dtype and mu.relative_error(actual.grad, leaf.grad) < 2 * TOLERANCES[dtype]


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
@pytest.mark.parametrize("tokens,head_dim", [(256, 64), (128, 64), (512, 32), (256, 32)])
def test_bf16_on_the_cpu_takes_the_flash_kernel_where_amx_makes_it_the_faster(megatron_world, monkeypatch, amx,
                                                                               tokens, head_dim):
    """bf16 on a CPU keeps Megatron's path, except on AMX CPUs from AMX_FLASH_TOKENS(_BY_HEAD_DIM) tokens on;
    either way the result is Megatron's function (float64 reference). The CPU's flag is what is varied."""
    from ascendspeed.features.fused_attention import attention as fused_attention

    monkeypatch.setattr(fused_attention, "cpu_has_amx_bf16", lambda: amx)
    q, k, v = (torch.randn(tokens, 1, 2, head_dim).bfloat16() for _ in range(3))
    grad = torch.randn(tokens, 1, 2 * head_dim).bfloat16()
    module = attention(2, 2, head_dim, torch.bfloat16)
    out, grads, fused_ran = run(module, q, k, v, None, grad)
    threshold = fused_attention.AMX_FLASH_TOKENS_BY_HEAD_DIM.get(head_dim, fused_attention.AMX_FLASH_TOKENS)
    assert fused_ran == (amx and tokens >= threshold)

    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    expected = reference(*leaves, causal(tokens, tokens), module.softmax_scale)
    expected.backward(grad.double())
    assert mu.relative_error(out, expected) < TOLERANCES[torch.bfloat16]
    for actual, leaf in zip(grads, leaves):
        assert mu.relative_error(actual, leaf.grad) < 2 * TOLERANCES[torch.bfloat16]
