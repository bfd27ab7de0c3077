"""Megatron's linear layers in bf16 / fp16 with their GEMMs in fp32 (``ascendspeed.accelerator.cpu_half_gemm``),
forced on whatever CPU runs the tests: the same values as one fp32 GEMM rounded once, gradients against float64,
nothing but fp32 matrix products left in a GPT step, and the saved tensors kept in half precision."""
import pytest
import torch
from megatron.core.tensor_parallel import layers
from megatron.core.transformer.module import Float16Module

from ascendspeed import accelerator
from ascendspeed.accelerator import cpu_half_gemm
from ascendspeed.patching import MANAGER
from tests.helpers import megatron as mu

HALF = (torch.bfloat16, torch.float16)


@pytest.fixture
def fp32_half_gemm():
    """The feature applied for bf16 and fp16 whatever this CPU has; afterwards as ``install()`` leaves it."""
    MANAGER.revert(accelerator.CPU_HALF_GEMM_FEATURE)
    MANAGER.apply(accelerator.CPU_HALF_GEMM_FEATURE, accelerator.cpu_half_gemm_patches(cpu_half_gemm.HALF_DTYPES))
    try:
        yield
    finally:
        MANAGER.revert(accelerator.CPU_HALF_GEMM_FEATURE)
        MANAGER.apply(accelerator.CPU_HALF_GEMM_FEATURE, accelerator.cpu_half_gemm_patches())


@pytest.fixture
def world():
    with mu.one_process_world():
        yield


DTYPE_NAMES = {torch.float32: "float", torch.bfloat16: "c10::BFloat16", torch.float16: "c10::Half"}


def gemm_operand_dtypes(profile) -> set:
    """The dtypes of the matrix operands of every aten::mm / addmm the profile recorded."""
    return {dtype for event in profile.events() if event.name in ("aten::mm", "aten::addmm")
            for dtype in event.input_dtypes if dtype}


def sample_inputs(dtype):
    """(input, weight, bias) of a linear layer: 3-D activations as Megatron's [s, b, h], odd sizes included."""
    for tokens, batch, hidden, out in ((16, 2, 64, 96), (7, 3, 33, 17), (1, 1, 128, 256)):
        yield (torch.randn(tokens, batch, hidden).to(dtype), torch.randn(out, hidden).to(dtype) / hidden ** 0.5,
               torch.randn(out).to(dtype))


def linear(function, x, w, b, frozen=False):
    """``function`` (one of Megatron's linear functions) with TP 1's arguments, on leaves made from x, w, b."""
    x, w, b = (t.clone().requires_grad_(not (frozen and t is w)) for t in (x, w, b))
    if frozen:
        out = function(x, w, b, gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False,
                       tp_group=None)
    else:
        out = function(x, w, b, gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False)
    return out, (x, w, b)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_half_precision_linear_is_one_fp32_gemm_rounded_once(fp32_half_gemm, world, dtype, frozen):
    function = layers.linear_with_frozen_weight if frozen else layers.linear_with_grad_accumulation_and_async_allreduce
    for x, w, b in sample_inputs(dtype):
        out, leaves = linear(function, x, w, b, frozen)
        grad = torch.randn(out.shape).to(dtype)
        out.backward(grad)
        assert out.dtype == dtype
        # the products are the fp32 GEMM of the same values, bit for bit (same torch kernels, rounded once)
        wide = [t.float().requires_grad_() for t in (x, w, b)]
        expected = torch.matmul(wide[0], wide[1].t()) + wide[2]
        expected.backward(grad.float())
        assert torch.equal(out, expected.to(dtype))
        trained = (0,) if frozen else (0, 1, 2)  # Megatron's frozen-weight function gives the bias no gradient
        for index in trained:
            assert torch.equal(leaves[index].grad, wide[index].grad.to(dtype)), index
        if frozen:
            assert leaves[1].grad is None and leaves[2].grad is None
        # and within one rounding of float64
        exact = [t.double().requires_grad_() for t in (x, w, b)]
        reference = torch.matmul(exact[0], exact[1].t()) + exact[2]
        reference.backward(grad.double())
        tolerance = 8e-3 if dtype == torch.bfloat16 else 1e-3
        assert mu.relative_error(out, reference) < tolerance
        for index in trained:
            assert mu.relative_error(leaves[index].grad, exact[index].grad) < tolerance, index


@pytest.fixture
def native_half_gemm():
    """Megatron's linear functions as they are; afterwards as ``install()`` leaves them."""
    MANAGER.revert(accelerator.CPU_HALF_GEMM_FEATURE)
    try:
        yield
    finally:
        MANAGER.apply(accelerator.CPU_HALF_GEMM_FEATURE, accelerator.cpu_half_gemm_patches())


def test_fp32_and_unlisted_dtypes_pass_through(native_half_gemm, world):
    """The wrapper leaves fp32 alone, and any dtype it was not told to widen."""
    original = layers.linear_with_grad_accumulation_and_async_allreduce
    only_fp16 = cpu_half_gemm.wrap_in_fp32_gemm(original, frozenset({torch.float16}))
    for dtype in (torch.float32, torch.bfloat16):
        x, w, b = next(sample_inputs(dtype))
        with torch.profiler.profile(record_shapes=True) as profile:
            out, _ = linear(only_fp16, x, w, b)
        assert out.dtype == dtype
        assert gemm_operand_dtypes(profile) == {DTYPE_NAMES[dtype]}


def test_a_saved_input_modified_in_place_is_refused(fp32_half_gemm, world):
    """The saved tensors are the half-precision originals (the widened copies are not kept); modifying one after
    the forward is refused at backward, as torch refuses it for any saved tensor."""
    x, w, b = next(sample_inputs(torch.bfloat16))
    out, (x_leaf, _, _) = linear(layers.linear_with_grad_accumulation_and_async_allreduce, x, w, b)
    with torch.no_grad():
        x_leaf.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place after the forward"):
        out.sum().backward()


def test_policy_variable_names_its_values(monkeypatch):
    monkeypatch.setenv(cpu_half_gemm.ENVIRONMENT_VARIABLE, "fp32")
    assert cpu_half_gemm.widened_dtypes() == cpu_half_gemm.HALF_DTYPES
    monkeypatch.setenv(cpu_half_gemm.ENVIRONMENT_VARIABLE, "native")
    assert cpu_half_gemm.widened_dtypes() == frozenset()
    monkeypatch.setenv(cpu_half_gemm.ENVIRONMENT_VARIABLE, "auto")
    assert cpu_half_gemm.widened_dtypes() == cpu_half_gemm.slow_half_gemm_dtypes()
    monkeypatch.setenv(cpu_half_gemm.ENVIRONMENT_VARIABLE, "bf16")
    with pytest.raises(ValueError, match="ASCENDSPEED_CPU_HALF_GEMM='bf16': use one of auto, fp32, native"):
        cpu_half_gemm.widened_dtypes()


def test_applied_by_install_exactly_where_this_cpu_has_no_fast_half_gemm():
    applied = accelerator.CPU_HALF_GEMM_FEATURE in MANAGER.features()
    assert applied == bool(cpu_half_gemm.widened_dtypes())


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_gpt_step_multiplies_only_in_fp32_and_matches_float64(fp32_half_gemm, world, dtype):
    """A bf16 / fp16 GPT (Megatron's local spec) forward and backward: every aten::mm / addmm of the step has fp32
    operands, and the loss and every parameter gradient are within the dtype's tolerance of float64."""
    shape = mu.TinyGPT()
    config = shape.config(bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
                          pipeline_dtype=dtype)
    model = mu.build_gpt_model(config, shape)
    batch = mu.make_batch(shape)
    with torch.profiler.profile(record_shapes=True) as profile:
        losses = mu.reference_forward_backward(Float16Module(config, model), batch, shape)
    assert gemm_operand_dtypes(profile) == {"float"}

    params = {name: p.detach().double().requires_grad_() for name, p in mu.full_parameters(model).items()}
    micro_batches = mu.split_batch(batch, batch["tokens"].shape[0] // shape.micro_batch_size)
    reference = torch.stack([mu.reference_gpt_loss(params, micro, config) for micro in micro_batches]).mean()
    expected = torch.autograd.grad(reference, list(params.values()))
    tolerance = 2e-2 if dtype == torch.bfloat16 else 3e-3
    assert abs(torch.stack(losses).mean().item() - reference.item()) < tolerance * reference.item()
    actual = {name: p.grad for name, p in mu.named_parameters_full([model])}
    for (name, _), grad in zip(params.items(), expected):
        assert mu.relative_error(actual[name], grad) < tolerance, name


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_grouped_experts_multiply_in_fp32(dtype):
    """The grouped-experts operator (``--moe-grouped-gemm`` without TE) with ``fp32_products``: the fp32 grouped
    GEMM of the same values, rounded once, forward and backward; only fp32 products run."""
    from ascendspeed.ops.grouped_linear import grouped_linear

    m_splits, hidden, out_features = [5, 0, 11, 3], 24, 40
    x = torch.randn(sum(m_splits), hidden).to(dtype)
    weights = [(torch.randn(out_features, hidden) / hidden ** 0.5).to(dtype) for _ in m_splits]
    biases = [torch.randn(out_features).to(dtype) for _ in m_splits]
    grad = torch.randn(sum(m_splits), out_features).to(dtype)

    leaves = [t.clone().requires_grad_() for t in (x, *weights, *biases)]
    with torch.profiler.profile(record_shapes=True) as profile:
        out = grouped_linear(leaves[0], leaves[1:5], m_splits, leaves[5:], fp32_products=True)
        out.backward(grad)
    assert gemm_operand_dtypes(profile) == {"float"}
    wide = [t.float().requires_grad_() for t in (x, *weights, *biases)]
    expected = grouped_linear(wide[0], wide[1:5], m_splits, wide[5:])
    expected.backward(grad.float())
    assert out.dtype == dtype and torch.equal(out, expected.to(dtype))
    for leaf, reference in zip(leaves, wide):
        assert torch.equal(leaf.grad, reference.grad.to(dtype))
