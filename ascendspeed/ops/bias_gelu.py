"""Bias-GeLU: ``bias_gelu(y, bias) = gelu_tanh(y + bias)``, megatron-core's default MLP activation with a bias.

GeLU's tanh approximation with Megatron's constants (``megatron.core.fusions.fused_bias_gelu``), the bias
broadcast along the last dimension, computed as ``x * sigmoid(2u)`` (``0.5 * (1 + tanh(u)) = sigmoid(2u)``,
``u = 0.79788456 * x * (1 + 0.044715 * x^2)``): the same function, which vectorises (``tanh`` does not in
torch's CPU build). Two operators:

* ``torch.ops.ascendspeed.bias_gelu(y, bias)``: CPU, the C++ kernel in ``ascendspeed/csrc/bias_gelu``
  (vectorised per instruction set, one pass over memory, fp32 math for bfloat16 / float16, rounded once);
  CUDA (and the NPU where torch_npu imports): the same math as torch ops (``cpu_fusions``' sigmoid form, which
  also serves Megatron's functions where these operators do not apply); Meta: the C++ Meta kernel, so
  ``torch.compile`` keeps the operator in its graph.
* ``torch.ops.ascendspeed.bias_gelu_backward(grad, y, bias)``: the gradient of ``y`` (the bias's is its sum
  over the leading dimensions), from the same sigmoid: ``grad * (s + 2 x s (1 - s) (k + 3 c k x^2))``.

Megatron's ``GeLUFunction`` calls its forward and backward functions separately; on CPU tensors the adaptor
routes them to these operators (``ascendspeed/accelerator/cpu_fusions.py``). :func:`bias_gelu` is the
differentiable operator, saving only ``y`` and ``bias``.
"""
from __future__ import annotations

import torch

from ascendspeed.accelerator.cpu_fusions import (
    CUBIC,
    SQRT_2_OVER_PI,
    bias_gelu_back_sigmoid_form,
    bias_gelu_sigmoid_form,
)
from ascendspeed.ops._autograd import refuse_autograd, register_autograd
from ascendspeed.ops._extension import composite_kernel_devices, load_extension

__all__ = ["bias_gelu", "bias_gelu_reference"]

load_extension()  # defines the two operators and their CPU and Meta kernels

def bias_gelu(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(y + bias)``, ``bias`` of shape ``y.shape[-1:]`` and the dtype of ``y`` (float32, bfloat16,
    float16 or float64); differentiable in both. Reduced precision is computed in fp32 and rounded once."""
    return torch.ops.ascendspeed.bias_gelu(y, bias)


def bias_gelu_reference(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Megatron's formula, ``x * 0.5 * (1 + tanh(u))`` of ``x = y + bias``, in the inputs' dtype."""
    x = y + bias
    return x * 0.5 * (1.0 + torch.tanh(SQRT_2_OVER_PI * x * (1 + CUBIC * x * x)))


def _checked(op: str, *args: torch.Tensor) -> None:
    """The C++ argument check, through the Meta kernel on meta stand-ins of ``args``."""
    getattr(torch.ops.ascendspeed, op)(*(torch.empty_like(a, device="meta") for a in args))


def _composite_bias_gelu_kernel(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    _checked("bias_gelu", y, bias)
    return bias_gelu_sigmoid_form(bias, y)


def _composite_bias_gelu_backward_kernel(grad: torch.Tensor, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    _checked("bias_gelu_backward", grad, y, bias)
    return bias_gelu_back_sigmoid_form(grad, bias, y)


for _device in composite_kernel_devices():
    torch.library.register_kernel("ascendspeed::bias_gelu", _device, _composite_bias_gelu_kernel)
    torch.library.register_kernel("ascendspeed::bias_gelu_backward", _device, _composite_bias_gelu_backward_kernel)


# -- autograd ---------------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor):
    """The C++ backward operator; under ``create_graph`` (double backward, torch.func) the differentiable
    composition of the same formula."""
    y, bias = ctx.saved_tensors
    if torch.is_grad_enabled() and any(t.requires_grad for t in (grad, y, bias)):
        grad_y = bias_gelu_back_sigmoid_form(grad, bias, y)
    else:
        grad_y = torch.ops.ascendspeed.bias_gelu_backward(grad, y, bias)
    grad_bias = grad_y.sum(tuple(range(grad_y.dim() - 1))) if ctx.needs_input_grad[1] else None
    return grad_y, grad_bias


register_autograd("bias_gelu", _backward, _setup_context)
refuse_autograd("bias_gelu_backward", "differentiate bias_gelu itself (its backward is differentiable under "
                                      "create_graph)")
