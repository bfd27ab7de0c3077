"""Fused rotary position embedding with the semantics of Megatron's ``_apply_rotary_pos_emb_bshd``.

``rotary_embedding(t, freqs, interleaved)`` rotates the first ``d_rot = freqs.size(-1)`` features of
``t`` [seq, batch, heads, head_dim] by the angles ``freqs`` [seq, 1, 1, d_rot]:
``t * cos(freqs) + rotate_half(t) * sin(freqs)``, and passes the other features through. Feature
pairs are ``(i, i + d_rot/2)``, or ``(2i, 2i + 1)`` when ``interleaved`` (Megatron's
``rotary_interleaved``). One operator, ``torch.ops.ascendspeed.rotary_embedding``, has one kernel per
device:

* CPU: the C++ kernel in ``ascendspeed/csrc/rotary`` (vectorized for AVX2 / AVX-512, multi-threaded,
  one pass over memory, cos and sin computed once per position, fp32 math for bfloat16 / float16);
* NPU (only where ``torch_npu`` imports): torch_npu's ``npu_rotary_mul``;
* CUDA: a reference composition computed in fp32;
* Meta / FakeTensor: the C++ Meta kernel (shapes only, the same argument checks), so ``torch.compile``
  keeps the operator in its graph.

The map is linear in ``t``; its backward ``ascendspeed::rotary_embedding_backward(grad_out, freqs,
interleaved)`` is the transpose (the rotation by ``-freqs`` for Megatron's paired angles), so autograd
saves only ``freqs``. ``freqs`` gets no gradient (Megatron's are not trained): passing one that
requires grad is an error rather than a silently missing gradient.
"""
from __future__ import annotations

import importlib

import torch

from ascendspeed.ops._autograd import register_autograd
from ascendspeed.ops._extension import load_extension

__all__ = ["rotary_embedding", "rotary_embedding_reference", "NPU_KERNELS"]

load_extension()  # defines the operators, their CPU and Meta kernels and argument checks


def rotary_embedding(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``freqs.size(-1)`` features of ``t`` [s, b, h, d] by ``freqs`` [s, 1, 1, d_rot].

    ``t`` and ``freqs`` are float32, bfloat16, float16 or float64 (``freqs`` usually fp32, as
    Megatron's RotaryEmbedding makes it); the result has the dtype of ``t``, computed in fp32 for
    reduced precision and rounded once, and is contiguous. ``t`` is read in place when its last
    dimension is contiguous (Megatron's query/key views of the fused QKV projection are).
    Differentiable in ``t``.
    """
    return torch.ops.ascendspeed.rotary_embedding(t, freqs, interleaved)


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def rotary_embedding_reference(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """The same math in eager torch ops, computed in (at least) fp32 and rounded to ``t.dtype``."""
    opmath = torch.promote_types(t.dtype, torch.float32)
    d_rot = freqs.size(-1)
    rot, rest = t[..., :d_rot].to(opmath), t[..., d_rot:]
    angles = freqs.to(opmath)
    out = rot * torch.cos(angles) + _rotate_half(rot, interleaved) * torch.sin(angles)
    return torch.cat((out.to(t.dtype), rest), dim=-1)


# -- autograd ---------------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output) -> None:
    _, freqs, interleaved = inputs
    if freqs.requires_grad:
        raise ValueError(
            "rotary_embedding: freqs requires grad, but the operator has no gradient for freqs "
            "(rotary angles are not trained); pass freqs.detach()"
        )
    ctx.save_for_backward(freqs)
    ctx.interleaved = interleaved


def _backward(ctx, grad_out: torch.Tensor):
    (freqs,) = ctx.saved_tensors
    return torch.ops.ascendspeed.rotary_embedding_backward(grad_out, freqs, ctx.interleaved), None, None


def _double_backward(ctx, grad_grad_t: torch.Tensor):
    """The transpose of the transpose: the forward rotation."""
    (freqs,) = ctx.saved_tensors
    return torch.ops.ascendspeed.rotary_embedding(grad_grad_t, freqs, ctx.interleaved), None, None


register_autograd("rotary_embedding", _backward, _setup_context)
register_autograd("rotary_embedding_backward", _double_backward, _setup_context)


# -- kernels of other devices -----------------------------------------------------------------------------
def _check_on_meta(op, t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> None:
    """Run the C++ argument check (the Meta kernel) on meta tensors of the same shapes and dtypes."""
    op(t.to("meta"), freqs.to("meta"), interleaved)


def _swap_pairs(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The features of each rotated pair (a, b) exchanged."""
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((x2, x1), dim=-1)
    return torch.stack((x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``t * cos + rotate_half(t) * sin`` on the first d_rot features, the rest passed, in fp32."""
    opmath = torch.promote_types(t.dtype, torch.float32)
    d_rot = cos.size(-1)
    rot, rest = t[..., :d_rot].to(opmath), t[..., d_rot:]
    out = rot * cos.to(opmath) + _rotate_half(rot, interleaved) * sin.to(opmath)
    return torch.cat((out.to(t.dtype), rest), dim=-1)


def _composite_forward(t, freqs, interleaved=False):
    _check_on_meta(torch.ops.ascendspeed.rotary_embedding, t, freqs, interleaved)
    angles = freqs.to(torch.promote_types(t.dtype, torch.float32))
    return _rotate(t, torch.cos(angles), torch.sin(angles), interleaved)


# The transpose: grad_a = g_a cos f_a + g_b sin f_b and grad_b = g_b cos f_b - g_a sin f_a, i.e. the
# forward with sin replaced by -swap_pairs(sin).
def _composite_backward(grad_out, freqs, interleaved=False):
    _check_on_meta(torch.ops.ascendspeed.rotary_embedding_backward, grad_out, freqs, interleaved)
    angles = freqs.to(torch.promote_types(grad_out.dtype, torch.float32))
    return _rotate(grad_out, torch.cos(angles), -_swap_pairs(torch.sin(angles), interleaved), interleaved)


torch.library.register_kernel("ascendspeed::rotary_embedding", "cuda", _composite_forward)
torch.library.register_kernel("ascendspeed::rotary_embedding_backward", "cuda", _composite_backward)


def _register_npu_kernels() -> bool:
    """torch_npu is optional: the NPU kernels exist only where it imports.

    ``npu_rotary_mul(x, r1, r2, rotary_mode)`` computes ``x * r1 + rotate_half(x) * r2`` over the whole
    last dimension ("half" or "interleave" pairs); the pass-through features are concatenated here.
    """
    try:
        torch_npu = importlib.import_module("torch_npu")
    except ImportError:
        return False

    def npu_rotate(t, cos, sin, interleaved):
        d_rot = cos.size(-1)
        mode = "interleave" if interleaved else "half"
        rot = t[..., :d_rot]
        out = torch_npu.npu_rotary_mul(rot, cos.to(t.dtype), sin.to(t.dtype), rotary_mode=mode)
        return torch.cat((out, t[..., d_rot:]), dim=-1) if d_rot < t.size(-1) else out.contiguous()

    def npu_forward(t, freqs, interleaved=False):
        _check_on_meta(torch.ops.ascendspeed.rotary_embedding, t, freqs, interleaved)
        angles = freqs.float()
        return npu_rotate(t, torch.cos(angles), torch.sin(angles), interleaved)

    def npu_backward(grad_out, freqs, interleaved=False):
        _check_on_meta(torch.ops.ascendspeed.rotary_embedding_backward, grad_out, freqs, interleaved)
        angles = freqs.float()
        return npu_rotate(grad_out, torch.cos(angles), -_swap_pairs(torch.sin(angles), interleaved), interleaved)

    torch.library.register_kernel("ascendspeed::rotary_embedding", "npu", npu_forward)
    torch.library.register_kernel("ascendspeed::rotary_embedding_backward", "npu", npu_backward)
    return True


NPU_KERNELS: bool = _register_npu_kernels()
"""Whether torch_npu imported and ``rotary_embedding`` runs ``npu_rotary_mul`` on NPU tensors."""
