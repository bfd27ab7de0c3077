"""Megatron's bias-GeLU fusion on the CPU (``ascendspeed.accelerator.cpu_fusions``): the sigmoid form against
Megatron's own tanh form and the float64 function, forward and backward, through ``GeLUFunction``."""
import pytest
import torch

from tests.helpers import megatron as mu  # noqa: F401  installs ascendspeed (CPU shims) before megatron is used
from megatron.core.fusions import fused_bias_gelu

from ascendspeed.accelerator.cpu_fusions import bias_gelu_back_sigmoid_form, bias_gelu_sigmoid_form

#: dtype -> relative tolerance against float64.
TOLERANCES = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def megatron_tanh_form(bias, y):
    """Megatron's formula (fused_bias_gelu.bias_gelu before the shim), evaluated in float64."""
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def test_megatron_s_fusion_is_the_sigmoid_form_on_the_cpu():
    assert fused_bias_gelu.bias_gelu.__wrapped__ is bias_gelu_sigmoid_form
    assert fused_bias_gelu.bias_gelu_back.__wrapped__ is bias_gelu_back_sigmoid_form


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("shape", [(7, 3, 48), (128, 2, 256), (1, 1, 5)])
def test_gelu_function_matches_float64_forward_and_backward(dtype, shape):
    y = (torch.randn(shape) * 3).to(dtype).requires_grad_()
    bias = torch.randn(shape[-1]).to(dtype).requires_grad_()
    out = fused_bias_gelu.bias_gelu_impl(y, bias)
    grad = torch.randn(shape).to(dtype)
    out.backward(grad)

    y64, bias64 = (t.detach().double().requires_grad_() for t in (y, bias))
    expected = megatron_tanh_form(bias64, y64)
    expected.backward(grad.double())
    tolerance = TOLERANCES[dtype]
    assert out.dtype == dtype
    assert mu.relative_error(out, expected) < tolerance
    # backward rounds more often than forward (the derivative's terms, then the product with grad); fp16 inputs
    # have measured 2.7e-3 relative (2.7 fp16 epsilons) in the input gradient
    backward_tolerance = 4 * tolerance if dtype == torch.float16 else 2 * tolerance
    assert mu.relative_error(y.grad, y64.grad) < backward_tolerance
    assert mu.relative_error(bias.grad, bias64.grad) < backward_tolerance


def test_the_derivative_is_the_tanh_form_s():
    """The backward formula is Megatron's derivative rewritten, not another function: float64, to 1e-12."""
    x = torch.linspace(-12, 12, 2001, dtype=torch.float64)
    zero = torch.zeros((), dtype=torch.float64)
    t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    megatron = 0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t)
    torch.testing.assert_close(bias_gelu_back_sigmoid_form(torch.ones_like(x), zero, x), megatron, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bias_gelu_sigmoid_form(zero, x), megatron_tanh_form(zero, x), rtol=1e-12, atol=1e-12)
