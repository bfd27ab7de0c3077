"""Grouped linear layers: a mixture-of-experts layer's local experts as one operator over the permuted tokens.

After permutation the tokens of local expert ``g`` are the ``m_splits[g]`` consecutive rows starting where
expert ``g - 1``'s end. megatron-core's ``SequentialMLP`` runs a ``ColumnParallelLinear`` /
``RowParallelLinear`` per expert on ``torch.split`` pieces and concatenates the results; Transformer Engine's
``GroupedLinear`` runs one grouped GEMM. These operators are ascendspeed's grouped GEMM:

* ``torch.ops.ascendspeed.grouped_linear(x, weights, biases, m_splits)``: ``y[rows of g] = x[rows of g] @
  weights[g].T (+ biases[g])``, every group written into one output (``biases``: ``[]`` for none);
* ``grouped_linear_input_grad(grad_y, weights, m_splits)`` and ``grouped_linear_weight_grad(grad_y, x,
  m_splits, bias)``: its gradients, registered as its autograd.

Each group's product is the one megatron-core's parallel linears take for one expert, so the result is
``SequentialMLP``'s up to the last bit of fp32 (a BLAS matmul's rounding can depend on where a group's rows start
in memory; see ``docs/ops/grouped_linear.md``). Kernels: C++ on the CPU
(``ascendspeed/csrc/grouped_linear``); elsewhere (CUDA, NPU) the same products as torch ops on the device.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ascendspeed.ops._autograd import register_autograd
from ascendspeed.ops._extension import composite_kernel_devices, load_extension

__all__ = ["grouped_linear", "grouped_linear_reference"]

load_extension()  # defines the operators and their CPU and Meta kernels


def grouped_linear(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    m_splits: Sequence[int],
    biases: Optional[Sequence[torch.Tensor]] = None,
    fp32_products: bool = False,
) -> torch.Tensor:
    """``x`` (``[..., in]``, its rows grouped as ``m_splits`` says) through one linear layer per group
    (``weights[g]``: ``[out, in]``, ``biases[g]``: ``[out]``): ``[..., out]``. Differentiable in all three.

    ``fp32_products``: multiply half-precision operands in fp32 and round the output once, for CPUs without a
    fast GEMM for their dtype (``ascendspeed.accelerator.cpu_half_gemm``); backward gets the originals back."""
    rows = x.reshape(-1, x.size(-1))
    weights, biases, m_splits = list(weights), list(biases or ()), [int(m) for m in m_splits]
    if fp32_products and rows.dtype in (torch.bfloat16, torch.float16):
        from ascendspeed.accelerator.cpu_half_gemm import fp32_copies

        with fp32_copies(rows, *weights, *biases) as wide:
            wide_weights = wide[1:1 + len(weights)]
            y = torch.ops.ascendspeed.grouped_linear(wide[0], wide_weights, wide[1 + len(weights):], m_splits)
        y = y.to(rows.dtype)
    else:
        y = torch.ops.ascendspeed.grouped_linear(rows, weights, biases, m_splits)
    return y.view(*x.shape[:-1], y.size(-1))


def grouped_linear_reference(x, weights, m_splits, biases=None):
    """Plain torch: one ``x @ w.T (+ b)`` per group on ``torch.split`` pieces, concatenated."""
    pieces = torch.split(x.reshape(-1, x.size(-1)), [int(m) for m in m_splits])
    biases = biases or [None] * len(weights)
    out = torch.cat([
        piece @ w.t() if b is None else piece @ w.t() + b for piece, w, b in zip(pieces, weights, biases)
    ])
    return out.view(*x.shape[:-1], out.size(-1))


def _setup_context(ctx, inputs, output) -> None:
    x, weights, biases, m_splits = inputs
    ctx.m_splits = m_splits
    ctx.with_bias = bool(biases)
    ctx.save_for_backward(x, *weights)


def _backward(ctx, grad_y):
    x, *weights = ctx.saved_tensors
    needs_x, needs_weights, needs_biases, _ = ctx.input_needs_grad
    grad_y = grad_y.contiguous()
    grad_x = grad_weights = grad_biases = None
    if needs_x:
        grad_x = torch.ops.ascendspeed.grouped_linear_input_grad(grad_y, weights, ctx.m_splits)
    if any(needs_weights) or any(needs_biases):
        grad_weights, grad_biases = torch.ops.ascendspeed.grouped_linear_weight_grad(
            grad_y, x, ctx.m_splits, ctx.with_bias)
    return grad_x, grad_weights, grad_biases or None, None


register_autograd("grouped_linear", _backward, _setup_context)


# -- kernels of devices without a C++ kernel here (CUDA, NPU): the same products as torch ops on the device ----
def _checked_on_meta(op, *args):
    op(*(torch.empty_like(a, device="meta") if isinstance(a, torch.Tensor)
         else [torch.empty_like(t, device="meta") for t in a] if isinstance(a, list) and a and
         isinstance(a[0], torch.Tensor) else a for a in args))


def _composite_grouped_linear(x, weights, biases, m_splits):
    _checked_on_meta(torch.ops.ascendspeed.grouped_linear, x, weights, biases, m_splits)
    y = x.new_empty(x.size(0), weights[0].size(0))
    for rows, piece, g in zip(torch.split(y, m_splits), torch.split(x, m_splits), range(len(weights))):
        torch.mm(piece, weights[g].t(), out=rows)
        if biases:
            rows.add_(biases[g])
    return y


def _composite_input_grad(grad_y, weights, m_splits):
    _checked_on_meta(torch.ops.ascendspeed.grouped_linear_input_grad, grad_y, weights, m_splits)
    grad_x = grad_y.new_empty(grad_y.size(0), weights[0].size(1))
    for rows, piece, w in zip(torch.split(grad_x, m_splits), torch.split(grad_y, m_splits), weights):
        torch.mm(piece, w, out=rows)
    return grad_x


def _composite_weight_grad(grad_y, x, m_splits, bias):
    _checked_on_meta(torch.ops.ascendspeed.grouped_linear_weight_grad, grad_y, x, m_splits, bias)
    pieces = list(zip(torch.split(grad_y, m_splits), torch.split(x, m_splits)))
    grad_weights = [g.t() @ piece for g, piece in pieces]
    grad_biases = [g.sum(0) for g, _ in pieces] if bias else []
    return grad_weights, grad_biases


for _device in composite_kernel_devices():
    torch.library.register_kernel("ascendspeed::grouped_linear", _device, _composite_grouped_linear)
    torch.library.register_kernel("ascendspeed::grouped_linear_input_grad", _device, _composite_input_grad)
    torch.library.register_kernel("ascendspeed::grouped_linear_weight_grad", _device, _composite_weight_grad)
