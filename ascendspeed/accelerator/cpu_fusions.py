"""megatron-core's fused elementwise functions in forms the CPU compiles well.

``fusions.fused_bias_gelu`` (Megatron's default MLP activation with a bias: ``bias_gelu_fusion``) computes
GeLU's tanh approximation with ``torch.tanh``, compiled by ``megatron.core.jit.jit_fuser``. On a CPU the
compiled ``tanh`` is not vectorised and the pair costs 2.5x torch's exact GeLU. The same function is
``x * sigmoid(2u)`` (``0.5 * (1 + tanh(u)) = sigmoid(2u)``), and its derivative ``s + 2 x s (1 - s) u'``
with ``s = sigmoid(2u)`` (``1 - tanh(u)^2 = 4 s (1 - s)``), with Megatron's constants; the compiler
vectorises ``sigmoid``, and the pair runs in 0.4x the time. The two forms differ by rounding only (both
within 6e-7 of the float64 function in fp32; tests/accelerator/test_cpu_fusions.py). Half-precision inputs
are summed and evaluated in fp32 and rounded once, so the result is within one rounding of the float64
function at every x (Megatron's form rounds ``bias + y`` first, which GeLU's tail amplifies).
"""
from __future__ import annotations

import functools

import torch

from ascendspeed.patching import replace

#: Megatron's constants: sqrt(2 / pi) and 3 * 0.044715 * sqrt(2 / pi).
SQRT_2_OVER_PI = 0.79788456
CUBIC_SLOPE = 0.1070322243


def _exact_sum(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``bias + y`` in fp32 (fp64 for fp64). A bf16 sum rounds x by 2^-9, and GeLU's tail multiplies
    a relative error in x by about x^2: at x = -4, 3 % in the output."""
    compute = torch.float64 if torch.promote_types(bias.dtype, y.dtype) == torch.float64 else torch.float32
    return bias.to(compute) + y.to(compute)


def bias_gelu_sigmoid_form(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(bias + y)`` as ``x * sigmoid(2u)``, computed in fp32 and rounded once."""
    x = _exact_sum(bias, y)
    out = x * torch.sigmoid(2.0 * SQRT_2_OVER_PI * x * (1 + 0.044715 * x * x))
    return out.to(torch.promote_types(bias.dtype, y.dtype))


def bias_gelu_back_sigmoid_form(g: torch.Tensor, bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of ``gelu_tanh(bias + y)`` times ``g``, from ``s = sigmoid(2u)``, computed in fp32 and
    rounded once."""
    x = _exact_sum(bias, y)
    s = torch.sigmoid(2.0 * SQRT_2_OVER_PI * x * (1 + 0.044715 * x * x))
    grad = (s + 2.0 * x * s * (1 - s) * (SQRT_2_OVER_PI + CUBIC_SLOPE * x * x)) * g.to(x.dtype)
    return grad.to(torch.promote_types(g.dtype, y.dtype))


def _fused_on_first_call(function):
    """``function`` under Megatron's compile policy (``megatron.core.jit.jit_fuser``, read when first called:
    the shims are made before megatron-core is imported)."""
    fused = None

    @functools.wraps(function)
    def call(*args):
        nonlocal fused
        if fused is None:
            from megatron.core.jit import jit_fuser

            fused = jit_fuser(function)
        return fused(*args)

    return call


def patches():
    return [
        replace("megatron.core.fusions.fused_bias_gelu:bias_gelu", _fused_on_first_call(bias_gelu_sigmoid_form),
                expect="(bias, y)", name="cpu fusions: bias-GeLU (tanh form) as x * sigmoid(2u)"),
        replace("megatron.core.fusions.fused_bias_gelu:bias_gelu_back",
                _fused_on_first_call(bias_gelu_back_sigmoid_form),
                expect="(g, bias, y)", name="cpu fusions: its gradient from the same sigmoid"),
    ]
