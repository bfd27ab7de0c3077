"""Fused RMSNorm: ``rms_norm(x, weight) = x * rsqrt(mean(x^2, -1) + eps) * weight`` over the last dim.

With ``zero_centered_gamma`` the factor is ``weight + 1``, as Megatron's
``layernorm_zero_centered_gamma`` defines it (weights initialised to 0 stand for a factor of 1).
One operator, ``torch.ops.ascendspeed.rms_norm(x, weight, eps, zero_centered_gamma) -> (y, rstd)``,
has one kernel per device:

* CPU: the C++ kernel in ``ascendspeed/csrc/rms_norm`` (vectorized for AVX2 / AVX-512, multi-threaded,
  one pass over memory, fp32 math for bfloat16 / float16);
* NPU (only where ``torch_npu`` imports): torch_npu's ``npu_rms_norm`` and its backward;
* CUDA: a reference composition computed in fp32;
* Meta / FakeTensor: the C++ Meta kernel (shapes only, the same argument checks), so ``torch.compile``
  keeps the operator in its graph.

Autograd saves ``x`` and the per-row ``rstd`` (one fp32 value per row) only: the backward operator
``ascendspeed::rms_norm_backward(grad_y, x, rstd, weight, zero_centered_gamma)`` recomputes the
normalized input, and sums the weight gradient over rows in per-thread partial sums.
"""
from __future__ import annotations

import importlib

import torch

from ascendspeed.ops._autograd import refuse_autograd, register_autograd
from ascendspeed.ops._extension import load_extension

__all__ = ["rms_norm", "rms_norm_reference", "NPU_KERNELS"]

load_extension()  # defines the operators, their CPU and Meta kernels and argument checks


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, zero_centered_gamma: bool = False
) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * gamma`` with ``gamma = weight (+ 1 if zero_centered_gamma)``.

    ``x`` is float32, bfloat16, float16 or float64 of any shape; ``weight`` has ``x.size(-1)``
    elements of one of those dtypes. The result has the dtype of ``x``; reduced precision is computed
    in fp32 and rounded once. Differentiable in ``x`` and ``weight``.
    """
    return torch.ops.ascendspeed.rms_norm(x, weight, eps, zero_centered_gamma)[0]


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, zero_centered_gamma: bool = False
) -> torch.Tensor:
    """The same math in eager torch ops, computed in (at least) fp32 and rounded to ``x.dtype``."""
    opmath = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(opmath)
    gamma = weight.to(opmath) + 1 if zero_centered_gamma else weight.to(opmath)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * gamma).to(x.dtype)


# -- autograd ---------------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output) -> None:
    x, weight, eps, zero_centered_gamma = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, rstd, weight)
    ctx.eps, ctx.zero_centered_gamma = eps, zero_centered_gamma


def _backward(ctx, grad_y: torch.Tensor, _grad_rstd):
    """The C++ backward operator; under ``create_graph`` (double backward, torch.func) a differentiable
    composition instead, which recomputes ``rstd`` from ``x`` so that its dependence on ``x`` is seen."""
    x, rstd, weight = ctx.saved_tensors
    if torch.is_grad_enabled() and any(t.requires_grad for t in (grad_y, x, weight)):
        grad_x, grad_weight = _differentiable_backward(grad_y, x, weight, ctx.eps, ctx.zero_centered_gamma)
    else:
        grad_x, grad_weight = torch.ops.ascendspeed.rms_norm_backward(
            grad_y, x, rstd, weight, ctx.zero_centered_gamma
        )
    return grad_x, grad_weight, None, None


def _differentiable_backward(grad_y, x, weight, eps, zero_centered_gamma):
    """``rms_norm``'s gradients in differentiable torch ops, computed in (at least) fp32."""
    opmath = torch.promote_types(x.dtype, torch.float32)
    xf, g = x.to(opmath), grad_y.to(opmath)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    gw = g * _gamma(weight, opmath, zero_centered_gamma)
    grad_x = rstd * gw - xf * rstd.pow(3) * (gw * xf).mean(-1, keepdim=True)
    grad_weight = (g * xf * rstd).reshape(-1, x.size(-1)).sum(0)
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


register_autograd("rms_norm", _backward, _setup_context)
refuse_autograd("rms_norm_backward", "differentiate rms_norm itself (its backward is differentiable "
                "under create_graph=True) instead of calling the backward operator")


# -- kernels of other devices -----------------------------------------------------------------------------
def _check_on_meta(op, *tensors_and_args):
    """Run the C++ argument check (the Meta kernel) on meta tensors of the same shapes and dtypes."""
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in tensors_and_args]
    op(*meta)


def _gamma(weight: torch.Tensor, opmath: torch.dtype, zero_centered_gamma: bool) -> torch.Tensor:
    gamma = weight.to(opmath)
    return gamma + 1 if zero_centered_gamma else gamma


def _composite_forward(x, weight, eps=1e-5, zero_centered_gamma=False):
    _check_on_meta(torch.ops.ascendspeed.rms_norm, x, weight, eps, zero_centered_gamma)
    opmath = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(opmath)
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    y = xf * rstd.unsqueeze(-1) * _gamma(weight, opmath, zero_centered_gamma)
    return y.to(x.dtype).contiguous(), rstd


def _composite_backward(grad_y, x, rstd, weight, zero_centered_gamma=False):
    _check_on_meta(torch.ops.ascendspeed.rms_norm_backward, grad_y, x, rstd, weight, zero_centered_gamma)
    opmath = rstd.dtype
    xf, g = x.to(opmath), grad_y.to(opmath)
    r = rstd.unsqueeze(-1)
    gw = g * _gamma(weight, opmath, zero_centered_gamma)
    grad_x = r * gw - xf * (r**3) * (gw * xf).mean(-1, keepdim=True)
    grad_weight = (g * xf * r).reshape(-1, x.size(-1)).sum(0)
    return grad_x.to(x.dtype).contiguous(), grad_weight.to(weight.dtype)


torch.library.register_kernel("ascendspeed::rms_norm", "cuda", _composite_forward)
torch.library.register_kernel("ascendspeed::rms_norm_backward", "cuda", _composite_backward)


def _register_npu_kernels() -> bool:
    """torch_npu is optional: the NPU (PrivateUse1) kernels exist only where it imports.

    ``npu_rms_norm(x, gamma, epsilon)`` returns ``(y, rstd)`` with ``rstd`` of the shape of ``x`` with a
    last dimension of 1; ``npu_rms_norm_backward(dy, x, gamma, rstd)`` returns ``(dx, dgamma)``.
    The zero-centred factor ``weight + 1`` is passed as ``gamma``; its gradient is the weight's.
    """
    try:
        torch_npu = importlib.import_module("torch_npu")
    except ImportError:
        return False

    def npu_forward(x, weight, eps=1e-5, zero_centered_gamma=False):
        _check_on_meta(torch.ops.ascendspeed.rms_norm, x, weight, eps, zero_centered_gamma)
        gamma = weight + 1 if zero_centered_gamma else weight
        y, rstd = torch_npu.npu_rms_norm(x, gamma.to(x.dtype), epsilon=eps)
        return y.contiguous(), rstd.reshape(x.shape[:-1]).to(torch.promote_types(x.dtype, torch.float32))

    def npu_backward(grad_y, x, rstd, weight, zero_centered_gamma=False):
        _check_on_meta(torch.ops.ascendspeed.rms_norm_backward, grad_y, x, rstd, weight, zero_centered_gamma)
        gamma = weight + 1 if zero_centered_gamma else weight
        grad_x, grad_gamma = torch.ops.npu.npu_rms_norm_backward(
            grad_y, x, gamma.to(x.dtype), rstd.to(torch.float32).unsqueeze(-1)
        )
        return grad_x.contiguous(), grad_gamma.to(weight.dtype)

    torch.library.register_kernel("ascendspeed::rms_norm", "npu", npu_forward)
    torch.library.register_kernel("ascendspeed::rms_norm_backward", "npu", npu_backward)
    return True


NPU_KERNELS: bool = _register_npu_kernels()
"""Whether torch_npu imported and ``rms_norm`` runs ``npu_rms_norm`` on NPU tensors."""
