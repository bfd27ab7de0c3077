"""ALiBi attention of our own: causal flash attention with the ALiBi bias generated inside the kernel.

``torch.ops.ascendspeed.alibi_flash_attention(q, k, v, slopes, scale, q_offset) -> (out, logsumexp)``
computes ``softmax(q k^T * scale - slopes[h] * (q_pos - k_pos)) v`` over [batch, heads, seq, head_dim]
tensors, keys after each query's position hidden, query row ``i`` at position ``i + q_offset``. The CPU
kernel (ascendspeed/csrc/alibi_attention) works block by block with an online softmax: forward keeps
only the output and one fp32 logsumexp per query row, backward
(``ascendspeed::alibi_flash_attention_backward``) recomputes the probabilities from them. Extra memory
is O(batch * heads * sq); bias and softmax math are fp32 (fp64 for fp64 inputs) whatever the input
dtype. See docs/ops/alibi_attention.md.

This module registers autograd and the CUDA kernels (a reference composition in fp32); the argument
checks and the Meta kernels are the C++ ones.
"""
from __future__ import annotations

from typing import Optional

import torch

from ascendspeed.ops.alibi import _integer, default_scale
from ascendspeed.ops._autograd import refuse_autograd, register_autograd
from ascendspeed.ops._extension import load_extension

__all__ = ["alibi_flash_attention"]

load_extension()  # defines ascendspeed::alibi_flash_attention(_backward), their CPU and Meta kernels


def alibi_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slopes: torch.Tensor,
    *,
    scale: Optional[float] = None,
    q_offset: int = 0,
) -> torch.Tensor:
    """Causal ALiBi attention output, [batch, heads, sq, head_dim] like ``query``.

    ``slopes``: fp32, one per head. ``scale`` defaults to ``1 / sqrt(head_dim)``; the bias is never
    scaled. ``q_offset`` >= 0 (an int) is the absolute position of query row 0 (keys start at position 0).
    Key and value need query's number of heads: repeat them per group for grouped-query attention.
    Differentiable in query, key, value and slopes, twice too (see docs/ops/alibi_attention.md).
    """
    q_offset = _integer("alibi_flash_attention", "q_offset", q_offset)
    if scale is None:
        scale = default_scale("alibi_flash_attention", query)
    out, _ = torch.ops.ascendspeed.alibi_flash_attention(query, key, value, slopes, float(scale), q_offset)
    return out


def _setup_context(ctx, inputs, output):
    query, key, value, slopes, scale, q_offset = inputs
    out, logsumexp = output
    ctx.mark_non_differentiable(logsumexp)
    ctx.save_for_backward(query, key, value, slopes, out, logsumexp)
    ctx.scale, ctx.q_offset = scale, q_offset


def _backward(ctx, grad_out, _grad_logsumexp):
    """The C++ backward operator; for slopes that require grad, and under ``create_graph`` (double
    backward, torch.func), a differentiable composition that materialises [batch, heads, sq, sk]."""
    query, key, value, slopes, out, logsumexp = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None, None, None
    if ctx.needs_input_grad[3] or (
        torch.is_grad_enabled() and any(t.requires_grad for t in (grad_out, query, key, value))
    ):
        return (*_differentiable_backward(grad_out, query, key, value, slopes, ctx.scale, ctx.q_offset), None, None)
    grad_q, grad_k, grad_v = torch.ops.ascendspeed.alibi_flash_attention_backward(
        grad_out, query, key, value, out, logsumexp, slopes, ctx.scale, ctx.q_offset
    )
    return grad_q, grad_k, grad_v, None, None, None


def _differentiable_backward(grad_out, query, key, value, slopes, scale, q_offset):
    """The gradients of query, key, value and slopes in differentiable torch ops (fp32, fp64 for fp64)."""
    scores, distance = _reference_scores(query, key, slopes, scale, q_offset)
    probs = torch.softmax(scores, dim=-1)
    v, g = value.to(probs.dtype), grad_out.to(probs.dtype)
    out = probs @ v
    grad_value = probs.transpose(-1, -2) @ g
    grad_scores = probs * (g @ v.transpose(-1, -2) - (g * out).sum(-1, keepdim=True))
    grad_query = grad_scores @ key.to(probs.dtype) * scale
    grad_key = grad_scores.transpose(-1, -2) @ query.to(probs.dtype) * scale
    grad_slopes = -(grad_scores * distance).sum((0, 2, 3))
    return (grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype),
            grad_slopes.to(slopes.dtype))


register_autograd("alibi_flash_attention", _backward, _setup_context)
refuse_autograd("alibi_flash_attention_backward", "differentiate alibi_flash_attention itself (its backward is "
                "differentiable under create_graph=True) instead of calling the backward operator")


def _reference_scores(query, key, slopes, scale, q_offset):
    """fp32 (fp64 for fp64) biased, causally masked scores and the distances ``q_pos - k_pos``: the
    composition the CUDA kernels and the differentiable backward use."""
    opmath = torch.float64 if query.dtype == torch.float64 else torch.float32
    sq, sk = query.size(-2), key.size(-2)
    distance = (
        torch.arange(q_offset, q_offset + sq, device=query.device, dtype=opmath)[:, None]
        - torch.arange(sk, device=query.device, dtype=opmath)
    )
    scores = query.to(opmath) @ key.to(opmath).transpose(-1, -2) * scale
    scores = scores - slopes.to(opmath)[:, None, None] * distance
    return scores.masked_fill(distance < 0, float("-inf")), distance


def _check_on_meta(*tensors_and_scalars):
    """The C++ argument check, run on meta tensors of the same shapes and dtypes."""
    return [t.to("meta") if isinstance(t, torch.Tensor) else t for t in tensors_and_scalars]


@torch.library.register_kernel("ascendspeed::alibi_flash_attention", "cuda")
def _forward_cuda(query, key, value, slopes, scale, q_offset=0):
    torch.ops.ascendspeed.alibi_flash_attention(*_check_on_meta(query, key, value, slopes, scale, q_offset))
    scores, _ = _reference_scores(query, key, slopes, scale, q_offset)
    logsumexp = torch.logsumexp(scores, dim=-1)
    out = (scores - logsumexp[..., None]).exp() @ value.to(scores.dtype)
    return out.to(query.dtype), logsumexp


@torch.library.register_kernel("ascendspeed::alibi_flash_attention_backward", "cuda")
def _backward_cuda(grad_out, query, key, value, out, logsumexp, slopes, scale, q_offset):
    torch.ops.ascendspeed.alibi_flash_attention_backward(
        *_check_on_meta(grad_out, query, key, value, out, logsumexp, slopes, scale, q_offset)
    )
    probs = (_reference_scores(query, key, slopes, scale, q_offset)[0] - logsumexp[..., None]).exp()
    grad_out = grad_out.to(probs.dtype)
    grad_value = probs.transpose(-1, -2) @ grad_out
    grad_probs = grad_out @ value.to(probs.dtype).transpose(-1, -2)
    grad_scores = probs * (grad_probs - (grad_out * out.to(probs.dtype)).sum(-1, keepdim=True))
    grad_query = grad_scores @ key.to(probs.dtype) * scale
    grad_key = grad_scores.transpose(-1, -2) @ query.to(probs.dtype) * scale
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)
