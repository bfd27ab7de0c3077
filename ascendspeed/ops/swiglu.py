"""Fused SwiGLU: ``swiglu(x, dim) = silu(a) * b`` where ``x = [a | b]`` is split in halves along ``dim``.

The gate ``a`` is the first half, as in Megatron's ``torch.chunk(x, 2, -1)``. One operator,
``torch.ops.ascendspeed.swiglu``, has one kernel per device:

* CPU: the C++ kernel in ``ascendspeed/csrc/swiglu`` (vectorized, multi-threaded, one pass over memory,
  fp32 math for bfloat16 / float16);
* NPU (only where ``torch_npu`` imports): torch_npu's ``npu_swiglu`` and its backward;
* CUDA: the reference composition, computed in fp32 for reduced precision;
* Meta / FakeTensor: shapes and strides only, so ``torch.compile`` keeps the operator in its graph.

Autograd saves only ``x``: the backward operator ``ascendspeed::swiglu_backward(grad_y, x, dim)``
recomputes the sigmoid instead of keeping it (Megatron's eager composition keeps half an input more).
The output is laid out in the memory order of ``x`` when ``x`` is dense (transposed or channels-last
inputs are not copied); other non-contiguous inputs are copied once.
"""
from __future__ import annotations

import importlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ascendspeed.ops._extension import load_extension

__all__ = ["swiglu", "swiglu_reference", "NPU_KERNELS"]

load_extension()  # defines the two operators and their CPU kernels

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


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


# -- argument checks and layout, mirroring ascendspeed/csrc/swiglu/swiglu.cpp --------------------------
def _check(x: torch.Tensor, dim: int) -> int:
    """The wrapped split dimension; the same errors as the C++ kernel, for the Python kernels."""
    if x.dim() == 0:
        raise ValueError("swiglu: x must have at least one dimension, got a 0-d tensor")
    if x.dtype not in _DTYPES:
        raise TypeError(f"swiglu: x must be float32, bfloat16, float16 or float64, got {x.dtype}")
    if not -x.dim() <= dim < x.dim():
        raise IndexError(
            f"swiglu: dim={dim} is out of range for x with {x.dim()} dimension(s) "
            f"(expected {-x.dim()} <= dim <= {x.dim() - 1})"
        )
    wrapped = dim % x.dim()
    if x.shape[wrapped] % 2:
        raise ValueError(
            "swiglu: x.size(dim) must be even to split x into gate and value halves, "
            f"got x.size({dim}) = {x.shape[wrapped]}"
        )
    return wrapped


def _memory_order(x: torch.Tensor) -> Optional[list[int]]:
    """Dimensions of ``x`` from outermost to innermost in memory if ``x`` is dense in that order."""
    order = list(range(x.dim()))
    if x.is_contiguous():
        return order
    order.sort(key=lambda d: -x.stride(d))  # stable, like the C++ std::stable_sort
    return order if x.permute(order).is_contiguous() else None


def _dense_strides(sizes, order: list[int]) -> list[int]:
    strides = [0] * len(sizes)
    stride = 1
    for d in reversed(order):
        strides[d] = stride
        stride *= max(sizes[d], 1)
    return strides


def _layout(x: torch.Tensor, dim: int) -> tuple[int, list[int]]:
    """The wrapped dim and the memory order outputs get (row-major when ``x`` is not dense)."""
    wrapped = _check(x, dim)
    return wrapped, _memory_order(x) or list(range(x.dim()))


def _check_grad(grad_y: torch.Tensor, x: torch.Tensor, wrapped: int) -> None:
    expected = list(x.shape)
    expected[wrapped] //= 2
    if list(grad_y.shape) != expected:
        raise ValueError(
            f"swiglu_backward: grad_y must have the shape of swiglu(x, dim) {expected}, got {list(grad_y.shape)}"
        )
    if grad_y.dtype != x.dtype:
        raise TypeError(f"swiglu_backward: grad_y must have the dtype of x ({x.dtype}), got {grad_y.dtype}")


# -- fake kernels: what torch.compile and the meta device see -------------------------------------------
@torch.library.register_fake("ascendspeed::swiglu")
def _swiglu_fake(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    wrapped, order = _layout(x, dim)
    sizes = list(x.shape)
    sizes[wrapped] //= 2
    return x.new_empty_strided(sizes, _dense_strides(sizes, order))


@torch.library.register_fake("ascendspeed::swiglu_backward")
def _swiglu_backward_fake(grad_y: torch.Tensor, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    wrapped, order = _layout(x, dim)
    _check_grad(grad_y, x, wrapped)
    return x.new_empty_strided(x.shape, _dense_strides(x.shape, order))


# -- autograd ---------------------------------------------------------------------------------------------
# ``inputs`` holds the arguments as called: ``dim`` is absent when a caller relies on its default (-1).
def _setup_context(ctx, inputs, output) -> None:
    x, dim = (*inputs, -1)[:2]
    ctx.save_for_backward(x)
    ctx.dim = dim


def _backward(ctx, grad_y: torch.Tensor):
    (x,) = ctx.saved_tensors
    return torch.ops.ascendspeed.swiglu_backward(grad_y, x, ctx.dim), None


def _setup_backward_context(ctx, inputs, output) -> None:
    grad_y, x, dim = (*inputs, -1)[:3]
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


torch.library.register_autograd("ascendspeed::swiglu", _backward, setup_context=_setup_context)
torch.library.register_autograd(
    "ascendspeed::swiglu_backward", _double_backward, setup_context=_setup_backward_context
)


# -- kernels of other devices -----------------------------------------------------------------------------
def _in_memory_order(kernel: Callable, x: torch.Tensor, dim: int, grad_y: Optional[torch.Tensor] = None):
    """Run a kernel for contiguous inputs on ``x`` seen in its memory order, so its result has the
    layout the fake kernel promises (and a dense ``x`` is not copied)."""
    wrapped, order = _layout(x, dim)
    if grad_y is not None:
        _check_grad(grad_y, x, wrapped)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    xp = x.permute(order).contiguous()
    dp = order.index(wrapped)
    if grad_y is None:
        return kernel(xp, dp).permute(inverse)
    return kernel(grad_y.permute(order).contiguous(), xp, dp).permute(inverse)


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
    return _in_memory_order(_composite_forward, x, dim)


def _reference_swiglu_backward_kernel(grad_y: torch.Tensor, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _in_memory_order(_composite_backward, x, dim, grad_y)


_LIB = torch.library.Library("ascendspeed", "IMPL")  # keeps the Python kernels registered
_LIB.impl("swiglu", _reference_swiglu_kernel, "CUDA")
_LIB.impl("swiglu_backward", _reference_swiglu_backward_kernel, "CUDA")


def _register_npu_kernels() -> bool:
    """torch_npu is optional: the NPU (PrivateUse1) kernels exist only where it imports."""
    try:
        torch_npu = importlib.import_module("torch_npu")
    except ImportError:
        return False

    def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return _in_memory_order(lambda xp, d: torch_npu.npu_swiglu(xp, dim=d), x, dim)

    def npu_swiglu_backward(grad_y: torch.Tensor, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return _in_memory_order(lambda g, xp, d: torch.ops.npu.npu_swiglu_backward(g, xp, d), x, dim, grad_y)

    _LIB.impl("swiglu", npu_swiglu, "PrivateUse1")
    _LIB.impl("swiglu_backward", npu_swiglu_backward, "PrivateUse1")
    return True


NPU_KERNELS: bool = _register_npu_kernels()
"""Whether torch_npu imported and ``swiglu`` runs ``npu_swiglu`` on NPU tensors."""
