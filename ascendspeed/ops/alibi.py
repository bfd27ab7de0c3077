"""ALiBi, attention with linear biases (Press et al., "Train Short, Test Long", arXiv 2108.12409).

Head ``h`` adds ``-m_h * (q_pos - k_pos)`` to its scaled attention scores, with fixed slopes ``m_h``
forming a geometric sequence. Two ways to apply it:

* :func:`alibi_bias_` adds the bias in place to a score buffer with the C++ operator
  ``torch.ops.ascendspeed.alibi_bias_`` (fp32 bias math, nothing of size [heads, sq, sk] allocated).
  This is what Megatron's local attention path uses, between its ``baddbmm`` and its softmax.
* :func:`alibi_attention` is a fused attention: on CPU ascendspeed's own flash-attention kernel
  (``ascendspeed.ops.alibi_flash_attention``) that generates the bias inside its blockwise softmax, in
  fp32, saving only the output and one logsumexp per query row; ``npu_fusion_attention`` with its
  kernel-generated ALiBi on Ascend NPUs.

Positions are absolute: query row ``i`` is at position ``i + q_offset``, key column ``j`` at ``j``.
The default ``q_offset = sk - sq`` puts the query block at the end of the keys, as in decoding
with a KV cache or chunked prefill.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import operator
from typing import Optional

import torch
import torch.nn.functional as F

from ascendspeed.ops._extension import load_extension

__all__ = ["alibi_slopes", "local_alibi_slopes", "alibi_bias_", "alibi_attention"]

load_extension()  # defines ascendspeed::alibi_bias_ and its CPU kernel


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The paper's slopes for ``num_heads`` heads, as a new fp32 CPU tensor.

    For a power of two ``n`` they are ``2^(-8/n), 2^(-16/n), ..., 2^-8``. Otherwise the first
    ``c = 2^floor(log2 n)`` of those are followed by every other slope of the ``2c`` series,
    which keeps the slopes spread between 2^-8 and 1 (the paper's reference code does the same).
    """
    num_heads = _integer("alibi_slopes", "num_heads", num_heads)
    if num_heads < 1:
        raise ValueError(f"ALiBi needs at least one attention head, got {num_heads}")
    return torch.tensor(_slopes(num_heads), dtype=torch.float32)


def _integer(function: str, name: str, value) -> int:
    """``value`` as an int; a bool or a float (even a whole one) is refused rather than converted."""
    if isinstance(value, (bool, float)) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{function}: {name} must be an int, got {type(value).__name__} {value!r}")
    return operator.index(value)


def default_scale(function: str, query: torch.Tensor) -> float:
    """``1 / sqrt(head_dim)``; a head dimension of 0 is refused here, before the division fails."""
    head_dim = query.size(-1) if query.dim() else 0
    if head_dim == 0:
        raise ValueError(
            f"{function}: query has head_dim 0 (query.size(-1), shape {list(query.shape)}): attention needs "
            "at least one feature per head (and the default scale 1/sqrt(head_dim) is undefined)"
        )
    return head_dim**-0.5


def _geometric_slopes(count: int) -> list[float]:
    ratio = 2.0 ** (-8.0 / count)
    return [ratio * ratio**k for k in range(count)]


def _slopes(num_heads: int) -> list[float]:
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = _geometric_slopes(closest)
    if closest < num_heads:
        slopes += _slopes(2 * closest)[0::2][: num_heads - closest]
    return slopes


def local_alibi_slopes(
    num_heads: int, tp_rank: int = 0, tp_size: int = 1, device: Optional[torch.device | str] = None
) -> torch.Tensor:
    """The slopes of the heads tensor-parallel rank ``tp_rank`` owns, on ``device``.

    Megatron gives rank ``r`` the contiguous heads ``[r * n / tp, (r + 1) * n / tp)``. The result
    is cached per (heads, rank, tp size, device) and shared by every layer and step: treat it as
    read-only.
    """
    if num_heads % tp_size:
        raise ValueError(f"{num_heads} attention heads do not split over tensor parallel size {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor parallel rank {tp_rank} outside [0, {tp_size})")
    return _cached_local_slopes(num_heads, tp_rank, tp_size, torch.device(device or "cpu"))


@functools.lru_cache(maxsize=None)
def _cached_local_slopes(num_heads: int, tp_rank: int, tp_size: int, device: torch.device) -> torch.Tensor:
    per_rank = num_heads // tp_size
    return alibi_slopes(num_heads)[tp_rank * per_rank : (tp_rank + 1) * per_rank].to(device)


def alibi_bias_(
    scores: torch.Tensor,
    slopes: torch.Tensor,
    q_offset: Optional[int] = None,
    *,
    symmetric: bool = False,
) -> torch.Tensor:
    """Add the ALiBi bias to ``scores`` ([heads, sq, sk] or [batch, heads, sq, sk]) in place.

    ``scores`` must already be scaled by the softmax scale: the bias is never scaled. The causal form
    adds ``-m * (q_pos - k_pos)`` (its values above the causal diagonal are masked later anyway);
    ``symmetric=True`` adds ``-m * |q_pos - k_pos|`` for non-causal attention. Autograd sees an
    identity: the bias is a constant, so the gradient flows to ``scores`` unchanged, and ``slopes``
    get none. Returns ``scores``.
    """
    if q_offset is None:
        q_offset = scores.size(-1) - scores.size(-2)
    else:
        q_offset = _integer("alibi_bias_", "q_offset", q_offset)
    torch.ops.ascendspeed.alibi_bias_(scores, slopes, q_offset, bool(symmetric))
    return scores


# register_autograd only takes functional operators, and this one writes to ``scores``; so its
# Autograd kernel is registered with the low-level Library.impl. d(scores + bias)/d(scores) is the
# identity, so the autograd graph stays as it is: scores keep their grad_fn, and only the version counter
# moves, so that anything saved for backward and overwritten here is reported by autograd instead of
# silently used. What torch's own in-place ops refuse under autograd is refused here too.
def _alibi_bias_autograd(scores, slopes, q_offset=0, symmetric=False):
    if torch.is_grad_enabled():
        if slopes.requires_grad:
            raise RuntimeError("alibi_bias_: ALiBi slopes are fixed, they cannot require grad; pass slopes.detach()")
        if scores.is_leaf and scores.requires_grad:
            raise RuntimeError("alibi_bias_: a leaf tensor that requires grad cannot be modified in place; "
                               "add the bias to a computed tensor (e.g. scores * scale) or clone() it first")
        base = scores._base if scores._is_view() else None
        if base is not None and base.is_leaf and base.requires_grad:
            raise RuntimeError("alibi_bias_: scores is a view of a leaf tensor that requires grad, which cannot be "
                               "modified in place; clone() it first")
    with torch._C._AutoDispatchBelowAutograd():
        torch.ops.ascendspeed.alibi_bias_(scores, slopes, q_offset, symmetric)
    torch.autograd.graph.increment_version(scores)


def _meta(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with the sizes, strides and dtype of ``t`` (so overlapping scores stay overlapping)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _alibi_bias_reference(scores, slopes, q_offset=0, symmetric=False):
    """Devices without a C++ kernel (CUDA, NPU): the C++ argument check through the Meta kernel, then the
    bias one head at a time, so only a [sq, sk] distance table is built. (Slopes on the CPU serve any
    device here: they are read as Python floats.)"""
    torch.ops.ascendspeed.alibi_bias_(_meta(scores), _meta(slopes), q_offset, symmetric)
    sq, sk = scores.shape[-2:]
    distance = (
        torch.arange(q_offset, q_offset + sq, device=scores.device, dtype=torch.float32)[:, None]
        - torch.arange(sk, device=scores.device, dtype=torch.float32)
    )
    if symmetric:
        distance = distance.abs()
    opmath = torch.float64 if scores.dtype == torch.float64 else torch.float32
    for head, slope in enumerate(slopes.tolist()):
        head_scores = scores[..., head, :, :]
        head_scores.copy_(head_scores.to(opmath) - slope * distance.to(opmath))


_LIBRARY = torch.library.Library("ascendspeed", "IMPL")
_LIBRARY.impl("alibi_bias_", _alibi_bias_autograd, "Autograd")
for _device in ("cuda", "npu") if importlib.util.find_spec("torch_npu") else ("cuda",):
    torch.library.register_kernel("ascendspeed::alibi_bias_", _device, _alibi_bias_reference)


def alibi_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slopes: torch.Tensor,
    *,
    causal: bool = True,
    q_offset: Optional[int] = None,
    masked_out: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Fused softmax(q k^T * scale + alibi) v over [batch, heads, seq, head_dim] tensors.

    ``masked_out`` (optional, bool, True where a query must not see a key) broadcasts to
    [batch, heads, sq, sk]; ``causal`` hides keys after each query's absolute position.

    On CPU, causal attention with ``q_offset >= 0`` and neither mask nor dropout (training, prefill,
    decoding with a KV cache) runs ascendspeed's own flash kernel, ``ascendspeed::alibi_flash_attention``
    (ascendspeed/ops/alibi_flash_attention.py): the bias is generated inside its blockwise softmax in
    fp32 and the extra memory is one fp32 logsumexp per query row. Other cases (dropout, a mask,
    non-causal, a query block that starts before the keys) build a [heads, sq, sk] bias and call
    ``scaled_dot_product_attention``. On NPU the kernel generates ALiBi itself. An empty query block
    gives an empty result; queries without any key are refused.
    """
    sq, sk = query.size(-2), key.size(-2)
    if q_offset is None:
        q_offset = sk - sq
    else:
        q_offset = _integer("alibi_attention", "q_offset", q_offset)
    if scale is None:
        scale = default_scale("alibi_attention", query)
    if sk == 0 and sq > 0:
        raise ValueError(
            f"alibi_attention: key and value are empty (sk=0) but there are {sq} queries; "
            "every query needs at least one key to attend to"
        )
    if query.device.type == "npu":
        return _npu_alibi_attention(query, key, value, slopes, causal, q_offset, masked_out, scale, dropout_p)
    slopes = slopes.to(device=query.device, dtype=torch.float32)
    if query.device.type == "cpu" and causal and q_offset >= 0 and masked_out is None and dropout_p == 0.0:
        from ascendspeed.ops.alibi_flash_attention import alibi_flash_attention

        return alibi_flash_attention(query, key, value, slopes, scale=scale, q_offset=q_offset)
    if sq == 0:
        # torch's CPU attention kernels divide by the sequence length: answer the empty block here.
        return query[..., :0, :1].expand(*query.shape[:-2], 0, value.size(-1)).clone()
    # CPU kernels take an fp32 mask for any query dtype; GPU kernels want the query dtype. Rounding this
    # exact relative form costs little: the entries that carry attention weight (near the diagonal) are small.
    dtype = torch.float32 if query.device.type == "cpu" else query.dtype
    bias = _materialised_bias(slopes, sq, sk, q_offset, causal, masked_out, dtype)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, dropout_p=dropout_p, scale=scale)


def _materialised_bias(slopes, sq, sk, q_offset, causal, masked_out, dtype) -> torch.Tensor:
    """The full [1 or batch, heads, sq, sk] bias, computed in fp32, masked positions at ``dtype``'s minimum."""
    distance = (
        torch.arange(q_offset, q_offset + sq, device=slopes.device, dtype=torch.float32)[:, None]
        - torch.arange(sk, device=slopes.device, dtype=torch.float32)
    )
    bias = (-slopes[:, None, None] * (distance if causal else distance.abs())).to(dtype)
    hidden = distance < 0 if causal else None
    if masked_out is not None:
        hidden = masked_out if hidden is None else hidden | masked_out
    if hidden is not None:
        bias = bias.masked_fill(hidden, torch.finfo(dtype).min)
    return bias if bias.dim() == 4 else bias[None]


def _npu_alibi_attention(query, key, value, slopes, causal, q_offset, masked_out, scale, dropout_p):
    """Ascend: ``npu_fusion_attention_v2`` generates the ALiBi bias from fp32 slopes (pse_type 2)."""
    import torch_npu  # optional dependency, present only on Ascend machines

    if masked_out is not None or not causal or q_offset not in (0, key.size(-2) - query.size(-2)):
        raise NotImplementedError(
            "alibi_attention on NPU supports causal attention with the query block at the start "
            "(q_offset=0) or at the end (q_offset=sk-sq) of the keys, without an extra mask"
        )
    # sparse_mode 2 aligns the causal mask top-left, 3 bottom-right; both take this compressed mask.
    causal_mask = torch.ones(2048, 2048, dtype=torch.bool, device=query.device).triu_(1)
    return torch_npu.npu_fusion_attention_v2(
        query,
        key,
        value,
        query.size(1),
        "BNSD",
        pse=slopes.to(device=query.device, dtype=torch.float32),
        atten_mask=causal_mask,
        scale=scale,
        keep_prob=1.0 - dropout_p,
        sparse_mode=2 if q_offset == 0 else 3,
        pse_type=2,
        q_start_idx=[q_offset],
        kv_start_idx=[0],
    )[0]
