"""Fused SwiGLU: ``swiglu(x, dim) = silu(a) * b`` where ``x = [a | b]`` is split in halves along ``dim``.

The gate ``a`` is the first half, as in Megatron's ``torch.chunk(x, 2, -1)``. One operator,
``torch.ops.ascendspeed.swiglu``, has one kernel per device:

* CPU: the C++ kernel in ``ascendspeed/csrc/swiglu`` (vectorized, multi-threaded, one pass over memory,
  fp32 math for bfloat16 / float16);
* NPU (only where ``torch_npu`` imports): torch_npu's ``npu_swiglu`` and its backward;
* CUDA: the reference composition, computed in fp32 for reduced precision;
* Meta / FakeTensor: the C++ Meta kernel (shapes and strides only), so ``torch.compile`` keeps the
  operator in its graph.

Arguments are checked in one place, the C++ ``check_swiglu`` / ``check_swiglu_backward``, which both the
CPU and the Meta kernel call; the CUDA and NPU kernels here run the Meta kernel on meta stand-ins of
their arguments first, and take the output's layout from it.

``torch.ops.ascendspeed.weighted_swiglu(x, weights)`` is megatron-core's expert SwiGLU scaled by the
routing probabilities, ``silu(a) * b * weights`` over the last dimension with one weight per row, in the
same single pass; its backward returns the gradients of ``x`` and ``weights`` from one pass too.

Autograd of ``swiglu`` saves only ``x``: the backward operator ``ascendspeed::swiglu_backward(grad_y, x, dim)``
recomputes the sigmoid instead of keeping it (Megatron's eager composition keeps half an input more).
The output is laid out in the memory order of ``x`` when ``x`` is dense (transposed or channels-last
inputs are not copied); other non-contiguous inputs are copied once.
"""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from ascendspeed.ops._autograd import register_autograd
from ascendspeed.ops._extension import load_extension

__all__ = ["swiglu", "swiglu_reference", "weighted_swiglu", "weighted_swiglu_reference", "NPU_KERNELS"]

load_extension()  # defines the two operators and their CPU kernels

def swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``silu(a) * b`` for ``a, b = x.chunk(2, dim)``; differentiable, saving only ``x`` for backward.

    ``x`` is float32, bfloat16, float16 or float64 with an even size along ``dim``. Reduced precision
    is computed in fp32 and rounded once.
    """
    return torch.ops.ascendspeed.swiglu(x, dim)


def swiglu_reference(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Megatron's composition, which the fused operator replaces (and must match)."""
    a, b = torch.chunk(x, 2, dim)
    return F.silu(a) * b


def weighted_swiglu(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b * weights`` for ``a, b = x.chunk(2, -1)``: an expert's SwiGLU scaled by its tokens'
    routing probabilities (``weights``, shape ``x.shape[:-1] + (1,)``) in one pass, computed in fp32 (fp64
    for fp64) and rounded once to the dtype of ``x``. Differentiable in both, saving ``x`` and ``weights``;
    the gradient of ``weights`` is summed in fp32 and returned in the dtype of ``weights``.
    """
    return torch.ops.ascendspeed.weighted_swiglu(x, weights)


def weighted_swiglu_reference(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The math of :func:`weighted_swiglu` as a composition: SwiGLU and scale in the promoted math type."""
    opmath = torch.promote_types(x.dtype, torch.float32)
    a, b = (t.to(opmath) for t in torch.chunk(x, 2, -1))
    return (F.silu(a) * b * weights.to(opmath)).to(x.dtype)


# -- autograd ---------------------------------------------------------------------------------------------
# ``inputs`` holds every argument, defaults filled in (ascendspeed.ops._autograd.register_autograd).
def _setup_context(ctx, inputs, output) -> None:
    x, dim = inputs
    ctx.save_for_backward(x)
    ctx.dim = dim


def _backward(ctx, grad_y: torch.Tensor):
    (x,) = ctx.saved_tensors
    return torch.ops.ascendspeed.swiglu_backward(grad_y, x, ctx.dim), None


def _setup_backward_context(ctx, inputs, output) -> None:
    grad_y, x, dim = inputs
    ctx.save_for_backward(grad_y, x)
    ctx.dim = dim


def _double_backward(ctx, grad_grad_x: torch.Tensor):
    """Gradients of ``grad_x = [g * b * ds(a) | g * silu(a)]`` (ds = silu'), in differentiable torch ops."""
    grad_y, x = ctx.saved_tensors
    dim = ctx.dim
    opmath = torch.promote_types(x.dtype, torch.float32)
    a, b = (t.to(opmath) for t in torch.chunk(x, 2, dim))
    u, v = (t.to(opmath) for t in torch.chunk(grad_grad_x, 2, dim))
    g = grad_y.to(opmath)
    s = torch.sigmoid(a)
    silu = a * s
    dsilu = s + silu * (1 - s)
    ddsilu = s * (1 - s) * (2 + a * (1 - 2 * s))
    grad_g = u * b * dsilu + v * silu
    grad_a = g * (u * b * ddsilu + v * dsilu)
    grad_b = g * u * dsilu
    return grad_g.to(grad_y.dtype), torch.cat((grad_a, grad_b), dim).to(x.dtype), None


def _setup_weighted_context(ctx, inputs, output) -> None:
    x, weights = inputs
    ctx.save_for_backward(x, weights)


def _weighted_backward(ctx, grad_y: torch.Tensor):
    x, weights = ctx.saved_tensors
    return torch.ops.ascendspeed.weighted_swiglu_backward(grad_y, x, weights)


def _setup_weighted_backward_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _weighted_double_backward(ctx, grad_grad_x: torch.Tensor, grad_grad_weights: torch.Tensor):
    """Gradients of ``grad_x = w * [g * b * ds(a) | g * silu(a)]`` and ``grad_w = sum(g * silu(a) * b)``
    (ds = silu'), in differentiable torch ops."""
    grad_y, x, weights = ctx.saved_tensors
    opmath = torch.promote_types(x.dtype, torch.float32)
    a, b = (t.to(opmath) for t in torch.chunk(x, 2, -1))
    u, v = (t.to(opmath) for t in torch.chunk(grad_grad_x, 2, -1))
    q = grad_grad_weights.to(opmath)
    w = weights.to(opmath)
    g = grad_y.to(opmath)
    s = torch.sigmoid(a)
    silu = a * s
    dsilu = s + silu * (1 - s)
    ddsilu = s * (1 - s) * (2 + a * (1 - 2 * s))
    grad_g = w * (u * b * dsilu + v * silu) + q * silu * b
    grad_a = g * (w * (u * b * ddsilu + v * dsilu) + q * b * dsilu)
    grad_b = g * (w * u * dsilu + q * silu)
    grad_w = (g * (u * b * dsilu + v * silu)).sum(-1, keepdim=True)
    return (grad_g.to(grad_y.dtype), torch.cat((grad_a, grad_b), -1).to(x.dtype), grad_w.to(weights.dtype))


register_autograd("swiglu", _backward, _setup_context)
register_autograd("swiglu_backward", _double_backward, _setup_backward_context)
register_autograd("weighted_swiglu", _weighted_backward, _setup_weighted_context)
register_autograd("weighted_swiglu_backward", _weighted_double_backward, _setup_weighted_backward_context)


# -- kernels of other devices -----------------------------------------------------------------------------
# These kernels run the Meta kernel on meta stand-ins of their arguments: the one argument check, and the
# output layout. (A grad_y on another device than x fails in torch's own ops below.)
def _meta(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with the sizes, strides and dtype of ``t``."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _into_layout(layout: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` in a new tensor with the strides of ``layout`` (the Meta kernel's answer)."""
    out = torch.empty_strided(layout.shape, layout.stride(), dtype=values.dtype, device=values.device)
    return out.copy_(values)


def _composite_forward(x: torch.Tensor, dim: int) -> torch.Tensor:
    opmath = torch.promote_types(x.dtype, torch.float32)
    a, b = (t.to(opmath) for t in torch.chunk(x, 2, dim))
    return (F.silu(a) * b).to(x.dtype)


def _composite_backward(grad_y: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
    opmath = torch.promote_types(x.dtype, torch.float32)
    a, b = (t.to(opmath) for t in torch.chunk(x, 2, dim))
    g = grad_y.to(opmath)
    s = torch.sigmoid(a)
    silu = a * s
    return torch.cat((g * b * (s + silu * (1 - s)), g * silu), dim).to(x.dtype)


def _reference_swiglu_kernel(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    layout = torch.ops.ascendspeed.swiglu(_meta(x), dim)
    return _into_layout(layout, _composite_forward(x, dim))


def _reference_swiglu_backward_kernel(grad_y: torch.Tensor, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    layout = torch.ops.ascendspeed.swiglu_backward(_meta(grad_y), _meta(x), dim)
    return _into_layout(layout, _composite_backward(grad_y, x, dim))


def _composite_weighted_backward(grad_y: torch.Tensor, x: torch.Tensor, weights: torch.Tensor):
    opmath = torch.promote_types(x.dtype, torch.float32)
    a, b = (t.to(opmath) for t in torch.chunk(x, 2, -1))
    g = grad_y.to(opmath)
    w = weights.to(opmath)
    s = torch.sigmoid(a)
    silu = a * s
    grad_x = torch.cat((g * w * b * (s + silu * (1 - s)), g * w * silu), -1)
    return grad_x.to(x.dtype), (g * silu * b).sum(-1, keepdim=True).to(weights.dtype)


def _reference_weighted_swiglu_kernel(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    torch.ops.ascendspeed.weighted_swiglu(_meta(x), _meta(weights))
    return weighted_swiglu_reference(x, weights).contiguous()


def _reference_weighted_swiglu_backward_kernel(grad_y: torch.Tensor, x: torch.Tensor, weights: torch.Tensor):
    torch.ops.ascendspeed.weighted_swiglu_backward(_meta(grad_y), _meta(x), _meta(weights))
    grad_x, grad_weights = _composite_weighted_backward(grad_y, x, weights)
    return grad_x.contiguous(), grad_weights.contiguous()


torch.library.register_kernel("ascendspeed::swiglu", "cuda", _reference_swiglu_kernel)
torch.library.register_kernel("ascendspeed::swiglu_backward", "cuda", _reference_swiglu_backward_kernel)
torch.library.register_kernel("ascendspeed::weighted_swiglu", "cuda", _reference_weighted_swiglu_kernel)
torch.library.register_kernel(
    "ascendspeed::weighted_swiglu_backward", "cuda", _reference_weighted_swiglu_backward_kernel
)


def _register_npu_kernels() -> bool:
    """torch_npu is optional: the NPU kernels exist only where it imports (it names the device "npu")."""
    try:
        torch_npu = importlib.import_module("torch_npu")
    except ImportError:
        return False

    def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        layout = torch.ops.ascendspeed.swiglu(_meta(x), dim)
        return _into_layout(layout, torch_npu.npu_swiglu(x.contiguous(), dim=dim))

    def npu_swiglu_backward(grad_y: torch.Tensor, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        layout = torch.ops.ascendspeed.swiglu_backward(_meta(grad_y), _meta(x), dim)
        grad_x = torch.ops.npu.npu_swiglu_backward(grad_y.contiguous(), x.contiguous(), dim)
        return _into_layout(layout, grad_x)

    torch.library.register_kernel("ascendspeed::swiglu", "npu", npu_swiglu)
    torch.library.register_kernel("ascendspeed::swiglu_backward", "npu", npu_swiglu_backward)
    # torch_npu has no weighted SwiGLU kernel: the composition runs as NPU operators.
    torch.library.register_kernel("ascendspeed::weighted_swiglu", "npu", _reference_weighted_swiglu_kernel)
    torch.library.register_kernel(
        "ascendspeed::weighted_swiglu_backward", "npu", _reference_weighted_swiglu_backward_kernel
    )
    return True


NPU_KERNELS: bool = _register_npu_kernels()
"""Whether torch_npu imported and ``swiglu`` runs ``npu_swiglu`` on NPU tensors."""
