"""The bias-GeLU operators against Megatron's tanh form in float64, forward and backward.

Inputs are fresh random draws each run (``sample_inputs``). Tolerances per element: one rounding of the exact
value to the output dtype, plus a few fp32 ulps of what one relative rounding of the input moves the result
(GeLU's tail is ill-conditioned: ``x f'(x) / f(x)`` grows like ``x^2``, so the fp32 sum ``y + bias`` alone moves
the result by that much).
"""
import textwrap

import pytest
import torch

from tests.helpers.isa import check_under_isa

from ascendspeed.ops import bias_gelu
from ascendspeed.ops.bias_gelu import (
    _composite_bias_gelu_backward_kernel,
    _composite_bias_gelu_kernel,
    bias_gelu_reference,
)

pytestmark = pytest.mark.megatron_independent  # one release covers it: .ci/run runs it on the newest only

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 2.0**-53}
#: Half the spacing of the subnormal numbers of each dtype: the rounding error of a result that small.
SUBNORMAL_HALF_ULP = {torch.float32: 2.0**-150, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25, torch.float64: 0.0}
MATH_EPS = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-23, torch.float16: 2.0**-23, torch.float64: 2.0**-52}

# 1-D to 4-D, odd sizes, a row longer than the parallel grain (32768 outputs) and many short rows.
SHAPES = [(1,), (30,), (7, 10), (5, 3, 24), (2, 3, 4, 6), (3, 40003), (5000, 8)]


def sample_inputs(shape, dtype, non_contiguous=False):
    """``(grad, y, bias)``: y spread over GeLU's tail and its linear part, as an MLP's pre-activations are."""
    y = 3 * torch.randn(shape, dtype=torch.float64)
    if non_contiguous and len(shape) >= 2:
        y = y.transpose(0, -2).contiguous().transpose(0, -2)
    return (torch.randn(shape, dtype=torch.float64).to(dtype), y.to(dtype),
            torch.randn(shape[-1], dtype=torch.float64).to(dtype))


def sigmoid_form(x):
    """GeLU's tanh approximation as ``x * sigmoid(2u)``, in float64: the same function as Megatron's
    ``x * 0.5 * (1 + tanh(u))``, without the cancellation of ``1 + tanh(u)`` that makes that form 0 below
    x = -5.2 in float64 (the value there is tiny, not 0)."""
    return x * torch.sigmoid(2 * 0.79788456 * x * (1 + 0.044715 * x * x))


def megatron_derivative(x):
    """Megatron's ``bias_gelu_back`` formula (its constant 0.1070322243 for 3 * 0.044715 * 0.79788456, which
    is 4e-11 from the exact derivative of its forward), from the same sigmoid, in float64."""
    s = torch.sigmoid(2 * 0.79788456 * x * (1 + 0.044715 * x * x))
    return s + 2 * x * s * (1 - s) * (0.79788456 + 0.1070322243 * x * x)


def reference(grad, y, bias):
    """Float64 value and gradient of y; the sensitivities of both to one relative rounding of x; and the
    absolute slack of a sigmoid that underflows the kernel's math type (its smallest normal number, times the
    factors that multiply it)."""
    x = (y.double() + bias.double()).requires_grad_()
    derivative = megatron_derivative(x)
    (second,) = torch.autograd.grad(derivative.sum(), x)
    x, derivative = x.detach(), derivative.detach()
    value = sigmoid_form(x)
    g = grad.double()
    tiny = torch.finfo(torch.promote_types(y.dtype, torch.float32)).tiny
    slack = 4 * tiny * (1 + x.abs()) ** 3 * (1 + g.abs())
    return (value, g * derivative, value.abs() + (x * derivative).abs(),
            g.abs() * (derivative.abs() + 2 + (x * second).abs()), slack)


def test_the_sigmoid_form_is_megatrons_function():
    x = torch.linspace(-5, 8, 1001, dtype=torch.float64)
    torch.testing.assert_close(sigmoid_form(x), bias_gelu_reference(x, torch.zeros((), dtype=torch.float64)),
                               rtol=1e-12, atol=1e-14)


def assert_within(actual, expected, sensitivity, slack, dtype, what):
    assert actual.dtype == dtype and actual.shape == expected.shape, what
    tolerance = (HALF_ULP[dtype] * 1.01 * expected.abs() + SUBNORMAL_HALF_ULP[dtype] + 32 * MATH_EPS[dtype] * sensitivity
                 + slack)
    error = (actual.double() - expected).abs()
    worst = int(torch.argmax(error - tolerance))
    assert torch.isfinite(actual).all() and (error <= tolerance).all(), (
        f"{what}: |error| {error.flatten()[worst]:.3g} > tolerance {tolerance.flatten()[worst]:.3g} "
        f"where the expected value is {expected.flatten()[worst].item():.6g}")


def check(grad, y, bias):
    value, input_grad, value_sensitivity, grad_sensitivity, slack = reference(grad, y, bias)
    assert_within(torch.ops.ascendspeed.bias_gelu(y, bias), value, value_sensitivity, slack, y.dtype, "forward")
    assert_within(torch.ops.ascendspeed.bias_gelu_backward(grad, y, bias), input_grad, grad_sensitivity, slack,
                  y.dtype, "backward")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_float64_forward_and_backward(shape, dtype):
    check(*sample_inputs(shape, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_autograd_gives_both_gradients(dtype):
    grad, y, bias = sample_inputs((6, 2, 40), dtype)
    y, bias = y.requires_grad_(), bias.requires_grad_()
    bias_gelu(y, bias).backward(grad)
    expected = torch.ops.ascendspeed.bias_gelu_backward(grad, y.detach(), bias.detach())
    assert torch.equal(y.grad, expected)
    torch.testing.assert_close(bias.grad, expected.sum((0, 1)))


def test_non_contiguous_inputs_and_large_magnitudes():
    grad, y, bias = sample_inputs((40, 3, 17), torch.float32, non_contiguous=True)
    assert not y.is_contiguous()
    y = y * torch.tensor([1.0, 30.0, 1e4]).view(1, 3, 1)  # deep in both tails: exp overflows, never NaN
    check(grad, y, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_composite_kernels_match_the_cpu_kernel(dtype):
    """The CUDA / NPU kernels (a torch-op composition of the same formula)."""
    grad, y, bias = sample_inputs((9, 4, 33), dtype)
    torch.testing.assert_close(_composite_bias_gelu_kernel(y, bias), torch.ops.ascendspeed.bias_gelu(y, bias))
    torch.testing.assert_close(_composite_bias_gelu_backward_kernel(grad, y, bias),
                               torch.ops.ascendspeed.bias_gelu_backward(grad, y, bias))


def test_gradcheck_float64():
    _, y, bias = sample_inputs((3, 5), torch.float64)
    assert torch.autograd.gradcheck(bias_gelu, (y.requires_grad_(), bias.requires_grad_()))


def test_opcheck():
    """torch.library's own consistency checks: schema, fake kernel, autograd registration."""
    grad, y, bias = sample_inputs((4, 3, 6), torch.float32)
    torch.library.opcheck(torch.ops.ascendspeed.bias_gelu.default, (y.requires_grad_(), bias.requires_grad_()))
    torch.library.opcheck(torch.ops.ascendspeed.bias_gelu_backward.default, (grad, y.detach(), bias.detach()))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_bad_inputs_name_the_argument(device):
    y, bias = torch.randn(4, 6, device=device), torch.randn(6, device=device)
    with pytest.raises(ValueError, match="bias must be one-dimensional with y.size\\(-1\\) = 6"):
        torch.ops.ascendspeed.bias_gelu(y, torch.randn(5, device=device))
    with pytest.raises(TypeError, match="bias must have the dtype of y"):
        torch.ops.ascendspeed.bias_gelu(y, bias.double())
    with pytest.raises(TypeError, match="y must be float32, bfloat16, float16 or float64"):
        torch.ops.ascendspeed.bias_gelu(y.int(), bias.int())
    with pytest.raises(ValueError, match="y must have at least one dimension"):
        torch.ops.ascendspeed.bias_gelu(torch.randn((), device=device), bias)
    with pytest.raises(ValueError, match="grad must have the shape of y"):
        torch.ops.ascendspeed.bias_gelu_backward(torch.randn(4, 5, device=device), y, bias)
    with pytest.raises(TypeError, match="grad must have the dtype of y"):
        torch.ops.ascendspeed.bias_gelu_backward(y.double(), y, bias)


def test_kernels_are_multi_threaded():
    kernel = torch.ops.ascendspeed._bias_gelu_cpu_kernel()
    assert "multi-threaded" in kernel, f"{kernel}: add -fopenmp to the extension's compile and link flags"


ISA_CHECK = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from ops.test_bias_gelu import DTYPES, check, sample_inputs
    isa = torch.ops.ascendspeed._bias_gelu_cpu_kernel().split(",")[0]
    if isa != {isa!r}:
        print("unsupported", isa)
        raise SystemExit(0)
    for dtype in DTYPES:
        for shape in ((7, 10), (3, 40003)):
            check(*sample_inputs(shape, dtype))
    print("ok", isa)
    """
)


@pytest.mark.parametrize("isa", ["DEFAULT", "AVX2"])
def test_narrower_instruction_sets(isa):
    """The kernels built for older CPUs are correct too (torch picks them via ATEN_CPU_CAPABILITY)."""
    check_under_isa(ISA_CHECK, isa)
