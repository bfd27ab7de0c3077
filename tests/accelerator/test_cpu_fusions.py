"""Megatron's fusions on the CPU (``ascendspeed.accelerator.cpu_fusions``): bias-GeLU's sigmoid form (the C++
operator, or compiled) against Megatron's own tanh form and the float64 function, forward and backward, through
``GeLUFunction``; the fused
bias-dropout-add as Megatron's eager function; the cross-entropy of one tensor-parallel rank."""
import pytest
import torch

from tests.helpers import megatron as mu  # noqa: F401  installs ascendspeed (CPU shims) before megatron is used
from megatron.core.fusions import fused_bias_gelu

from ascendspeed.accelerator import cpu_fusions
from ascendspeed.accelerator.cpu_fusions import bias_gelu_back_sigmoid_form, bias_gelu_sigmoid_form

#: dtype -> relative tolerance against float64.
TOLERANCES = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def megatron_tanh_form(bias, y):
    """Megatron's formula (fused_bias_gelu.bias_gelu before the shim), evaluated in float64."""
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def test_megatron_s_fusion_is_the_cpp_operator_on_cpu_tensors_and_the_sigmoid_form_otherwise():
    """One dtype on the CPU: the C++ operators' bits. Mixed dtypes (which the operators refuse): the sigmoid form,
    summed and evaluated in fp32."""
    y, bias, grad = torch.randn(5, 3, 24), torch.randn(24), torch.randn(5, 3, 24)
    assert torch.equal(fused_bias_gelu.bias_gelu(bias, y), torch.ops.ascendspeed.bias_gelu(y, bias))
    assert torch.equal(fused_bias_gelu.bias_gelu_back(grad, bias, y),
                       torch.ops.ascendspeed.bias_gelu_backward(grad, y, bias))
    half = y.bfloat16()
    assert torch.equal(fused_bias_gelu.bias_gelu(bias, half), bias_gelu_sigmoid_form(bias, half))
    assert torch.equal(fused_bias_gelu.bias_gelu_back(grad, bias, half), bias_gelu_back_sigmoid_form(grad, bias, half))


def conditioned_error(actual: torch.Tensor, expected: torch.Tensor, sensitivity: torch.Tensor) -> float:
    """``||actual - expected|| / ||sensitivity||``: the error in units of what one relative rounding of the input
    moves the result. GeLU's tail is ill-conditioned (``x f'(x) / f(x)`` grows like ``x^2``), so a plain relative
    error there measures the input's last bit, not the implementation."""
    return ((actual.double() - expected).norm() / sensitivity.norm()).item()


def gelu_derivatives(x: torch.Tensor):
    """``f(x)``, ``f'(x)`` and ``f''(x)`` of Megatron's tanh form, float64, by autograd."""
    x = x.detach().requires_grad_()
    value = megatron_tanh_form(torch.zeros((), dtype=x.dtype), x)
    (first,) = torch.autograd.grad(value.sum(), x, create_graph=True)
    (second,) = torch.autograd.grad(first.sum(), x)
    return value.detach(), first.detach(), second


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("shape", [(7, 3, 48), (128, 2, 256), (1, 1, 5)])
def test_gelu_function_matches_float64_forward_and_backward(dtype, shape):
    y = (torch.randn(shape) * 3).to(dtype).requires_grad_()
    bias = torch.randn(shape[-1]).to(dtype).requires_grad_()
    out = fused_bias_gelu.bias_gelu_impl(y, bias)
    grad = torch.randn(shape).to(dtype)
    out.backward(grad)

    x = bias.detach().double() + y.detach().double()
    value, first, second = gelu_derivatives(x)
    g = grad.double()
    input_grad, input_grad_sensitivity = g * first, g.abs() * (first.abs() + (x * second).abs())
    tolerance = TOLERANCES[dtype]
    assert out.dtype == dtype
    assert conditioned_error(out, value, value.abs() + (x * first).abs()) < tolerance
    # backward rounds more often than forward (the derivative's terms, then the product with grad)
    backward_tolerance = 4 * tolerance if dtype == torch.float16 else 2 * tolerance
    assert conditioned_error(y.grad, input_grad, input_grad_sensitivity) < backward_tolerance
    assert conditioned_error(bias.grad, input_grad.flatten(0, -2).sum(0),
                             input_grad_sensitivity.flatten(0, -2).sum(0)) < backward_tolerance
    # where GeLU is well conditioned (|x| < 2) the plain relative error meets the same tolerance
    well_conditioned = x.abs() < 2
    if well_conditioned.any():
        assert mu.relative_error(out.double()[well_conditioned], value[well_conditioned]) < tolerance


def test_the_derivative_is_the_tanh_form_s():
    """The backward formula is Megatron's derivative rewritten, not another function: float64, to 1e-12."""
    x = torch.linspace(-12, 12, 2001, dtype=torch.float64)
    zero = torch.zeros((), dtype=torch.float64)
    t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    megatron = 0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t)
    torch.testing.assert_close(bias_gelu_back_sigmoid_form(torch.ones_like(x), zero, x), megatron, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bias_gelu_sigmoid_form(zero, x), megatron_tanh_form(zero, x), rtol=1e-12, atol=1e-12)


CROSS_ENTROPY_TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-6, torch.float16: 2e-6}  # all in fp32


@pytest.mark.parametrize("dtype", list(CROSS_ENTROPY_TOLERANCE), ids=str)
@pytest.mark.parametrize("shape", [(7, 3, 48), (16, 2, 256), (1, 1, 5)])
def test_cross_entropy_of_one_tensor_parallel_rank_matches_float64_forward_and_backward(dtype, shape):
    """Megatron's loss entry on one tensor-parallel rank: torch's fused cross-entropy of the fp32 logits (its exact
    bits), within fp32 rounding of the float64 loss and gradient (softmax minus the one-hot target)."""
    from megatron.core import tensor_parallel

    generator = torch.Generator().manual_seed(sum(shape))
    logits = (4 * torch.randn(shape, generator=generator)).to(dtype).requires_grad_()
    target = torch.randint(0, shape[-1], shape[:-1], generator=generator)
    grad_output = torch.rand(shape[:-1], generator=generator)
    with mu.one_process_world():
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits, target)
    loss.backward(grad_output)
    fused = torch.nn.functional.cross_entropy(logits.detach().float().view(-1, shape[-1]), target.view(-1),
                                              reduction="none").view_as(target)
    assert loss.dtype == torch.float32 and torch.equal(loss, fused)
    exact = logits.detach().double()
    expected = torch.logsumexp(exact, -1) - exact.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(loss.double(), expected, rtol=CROSS_ENTROPY_TOLERANCE[dtype], atol=1e-6)
    one_hot = torch.nn.functional.one_hot(target, shape[-1]).double()
    expected_grad = (torch.softmax(exact, -1) - one_hot) * grad_output.double().unsqueeze(-1)
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad.double(), expected_grad.to(dtype).double(),
                               rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6 if dtype == torch.float32 else 1e-2)


def test_label_smoothing_keeps_megatrons_cross_entropy():
    """Megatron's label smoothing spreads alpha over the K - 1 other tokens (torch's over all K): it stays Megatron's."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.cross_entropy import _VocabParallelCrossEntropy

    generator = torch.Generator().manual_seed(5)
    logits, target = torch.randn(6, 2, 32, generator=generator), torch.randint(0, 32, (6, 2), generator=generator)
    with mu.one_process_world():
        smoothed = tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), target, 0.1)
        megatrons = _VocabParallelCrossEntropy.apply(logits.clone(), target, 0.1)
    assert torch.equal(smoothed, megatrons)




@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(7, 3, 48), (64, 2, 256)])
@pytest.mark.parametrize("training", [True, False], ids=["train", "inference"])
def test_fused_bias_dropout_add_is_megatrons_eager_function_on_the_cpu(dtype, shape, training):
    """What the transformer layer calls with ``bias_dropout_fusion`` (``get_bias_dropout_add(training, True)``):
    on CPU tensors Megatron's eager function, bit for bit and with the same dropout mask from the same generator
    state, within one rounding of ``residual + dropout(x + bias)`` in float64, forward and backward."""
    from megatron.core.fusions import fused_bias_dropout

    function = fused_bias_dropout.get_bias_dropout_add(training, True)
    assert function.__code__ is cpu_fusions.wrap_bias_dropout_add_eager_on_cpu(None, training=training).__code__
    generator = torch.Generator().manual_seed(sum(shape))
    x, residual, grad = ((torch.randn(shape, generator=generator) * 2).to(dtype) for _ in range(3))
    bias = torch.randn(shape[-1], generator=generator).to(dtype)
    for prob in (0.0, 0.25):
        leaves = [tensor.clone().requires_grad_() for tensor in (x, bias, residual)]
        eager_leaves = [tensor.clone().requires_grad_() for tensor in (x, bias, residual)]
        torch.manual_seed(prob * 100)
        out = function((leaves[0], leaves[1]), leaves[2], prob)
        torch.manual_seed(prob * 100)
        eager = fused_bias_dropout._bias_dropout_add_func((eager_leaves[0], eager_leaves[1]), eager_leaves[2], prob,
                                                          training)
        out.backward(grad)
        eager.backward(grad)
        assert out.dtype == dtype and torch.equal(out, eager)
        assert all(torch.equal(ours.grad, theirs.grad) for ours, theirs in zip(leaves, eager_leaves))

        x64, bias64, residual64 = (tensor.double() for tensor in (x, bias, residual))
        scale = 1 / (1 - prob) if training and prob else 1.0
        torch.manual_seed(prob * 100)  # the same draw on a tensor of ones gives the mask
        mask = (torch.nn.functional.dropout(torch.ones(shape, dtype=dtype), prob, training) != 0).double()
        expected = residual64 + mask * (x64 + bias64) * scale
        # three roundings (the sum with the bias, the dropout scale, the residual sum), each within eps / 2 of
        # what it rounds: bounded by eps times the magnitudes summed
        magnitude = residual64.abs() + mask * (x64.abs() + bias64.abs()) * scale
        assert ((out.double() - expected).abs() <= torch.finfo(dtype).eps * 1.5 * magnitude).all()
        torch.testing.assert_close(leaves[0].grad.double(), grad.double() * mask * scale,
                                   rtol=torch.finfo(dtype).eps, atol=0)
        assert torch.equal(leaves[2].grad, grad)
        if training and prob:
            assert 0.1 < 1 - mask.mean().item() < 0.4  # about prob of the elements dropped


def test_bias_dropout_add_leaves_other_devices_to_the_compiled_function():
    """The suite runs with torch.compile off, so the wrapper's dispatch is checked with a stand-in for the compiled
    function: never called for CPU tensors, called with the arguments as given for any other device."""
    calls = []

    def compiled(x_with_bias, residual, prob):
        calls.append((x_with_bias, residual, prob))
        return residual

    function = cpu_fusions.wrap_bias_dropout_add_eager_on_cpu(compiled, training=True)
    x, residual = torch.ones(2, 3), torch.zeros(2, 3)
    torch.testing.assert_close(function((x, None), residual, 0.0), x)
    assert calls == []
    meta = torch.empty(2, 3, device="meta")
    assert function((meta, None), meta, 0.5) is meta and calls == [((meta, None), meta, 0.5)]
