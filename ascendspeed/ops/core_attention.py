"""Core attention on the device's fused kernel: torch's ``scaled_dot_product_attention`` (flash attention on
CPU and CUDA) or, on Ascend NPUs, torch_npu's ``npu_fusion_attention``, in megatron-core's layouts, with the
mask given as a ``MaskPlan``. Used by the fused-attention feature (``ascendspeed.features.fused_attention``)
and by the Transformer Engine stand-in's attention for THD packs (``accelerator.te_fallback``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Optional

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class MaskPlan:
    """How the fused kernel applies a call's mask: the causal triangle, a boolean mask (True: may attend), or
    nothing; and which query rows are tokens (False: padding between a pack's sequences, whose output is zero
    and which pass no gradient back), None for every row."""

    causal: bool
    allowed: Optional[torch.Tensor] = None
    query_rows: Optional[torch.Tensor] = None


def _same_bounds(first: Optional[torch.Tensor], second: Optional[torch.Tensor]) -> bool:
    return first is None or second is None or torch.equal(first.cpu(), second.cpu())


def packed_plan(causal_type: bool, packed_seq_params, total: int, device: torch.device) -> Optional[MaskPlan]:
    """The mask of a THD pack (sequences one after another, no batch dimension): each token attends to the
    tokens of its own sequence (the earlier ones, in a causal layer). Without padding, tokens after the last
    boundary form one more sequence. With padding between the sequences (``cu_seqlens_*_padded``, TE's
    layout: sequence ``i`` starts at ``padded[i]`` and holds ``cu_seqlens[i+1] - cu_seqlens[i]`` tokens), the
    rest of each slot and everything after the last slot is padding: attended by nobody, its output zero.
    None (Megatron's path, which refuses packs) where queries and keys are packed differently."""
    bounds, padded = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded
    kv_bounds, kv_padded = packed_seq_params.cu_seqlens_kv, packed_seq_params.cu_seqlens_kv_padded
    if bounds is None or not (_same_bounds(kv_bounds, bounds) and _same_bounds(kv_padded, padded)):
        return None
    bounds = bounds.to(device=device, dtype=torch.long)
    positions = torch.arange(total, device=device)
    if padded is None or torch.equal(padded.to(device=device, dtype=torch.long), bounds):
        sequence = torch.searchsorted(bounds[1:], positions, right=True)
        token = None
    else:
        padded = padded.to(device=device, dtype=torch.long)
        if padded.shape != bounds.shape or bool((padded.diff() < bounds.diff()).any()) or int(padded[-1]) > total:
            raise ValueError(f"a THD pack's padded boundaries {padded.tolist()} must hold its sequences "
                             f"{bounds.tolist()} within its {total} tokens")
        sequence = torch.searchsorted(padded[1:], positions, right=True)
        slot = sequence.clamp(max=padded.numel() - 2)
        token = (sequence < padded.numel() - 1) & (positions - padded[slot] < bounds.diff()[slot])
    allowed = sequence[:, None] == sequence[None, :]
    if causal_type:
        allowed &= positions[:, None] >= positions[None, :]
    if token is not None:
        # padding attends to itself only, so that no row is empty; its output is zeroed (query_rows)
        allowed &= token[None, :] & token[:, None]
        allowed |= torch.diag(~token)
    return MaskPlan(causal=False, allowed=allowed.view(1, 1, total, total), query_rows=token)


def _npu_fusion_attention(query, key, value, plan: MaskPlan, scale: float, dropout_p: float) -> torch.Tensor:
    """torch_npu's fused attention in its [s, b, heads * d] layout (grouped keys and values included)."""
    torch_npu = importlib.import_module("torch_npu")
    sq, batch, heads, _ = query.shape
    sk = key.shape[0]
    if plan.causal:
        masked = torch.ones(sq, sk, dtype=torch.bool, device=query.device).triu(diagonal=1)
    else:
        masked = None if plan.allowed is None else plan.allowed.logical_not()
    return torch_npu.npu_fusion_attention(
        query.reshape(sq, batch, -1), key.reshape(sk, batch, -1), value.reshape(sk, batch, -1), heads, "SBH",
        atten_mask=masked, scale=scale, keep_prob=1.0 - dropout_p, sparse_mode=0)[0]


def unsupported_by_kernel(layer) -> Optional[str]:
    """What of ``layer`` (a ``DotProductAttention``) a fused kernel here does not compute, or None."""
    if layer.softmax_offset is not None or layer.scale_mask_softmax.window_size is not None:
        return "a softmax offset or a sliding window"
    if layer.config.apply_query_key_layer_scaling:
        return "query-key layer scaling"
    return None


def attention_dropout(layer) -> tuple[float, contextlib.AbstractContextManager]:
    """The dropout probability of this call of ``layer`` and the RNG stream to draw it in: Megatron's forked
    model-parallel stream, except with sequence parallelism (as Megatron's DotProductAttention chooses)."""
    dropout_p = layer.attention_dropout.p if layer.training else 0.0
    if dropout_p > 0 and not layer.config.sequence_parallel:
        from megatron.core import tensor_parallel

        return dropout_p, tensor_parallel.get_cuda_rng_tracker().fork()
    return dropout_p, contextlib.nullcontext()


def _attention_with_fp32_products(q, k, v, plan: MaskPlan, scale: float, dropout_p: float) -> torch.Tensor:
    """[b, heads, s, d] attention in a half-precision dtype this CPU has no fast GEMM for (torch's flash kernel
    would multiply its blocks with the scalar fallback GEMM): a causal call without dropout on ascendspeed's flash
    kernel (``alibi_flash_attention`` with zero slopes: products of the half-precision values summed in fp32,
    softmax in fp32, the output rounded once), anything else on torch's kernel over fp32 copies, which backward
    gets back from the half-precision originals (``fp32_copies``); the output rounded once."""
    if plan.causal and plan.allowed is None and dropout_p == 0 and q.shape[2] == k.shape[2]:
        from ascendspeed.ops.alibi_flash_attention import alibi_flash_attention

        slopes = torch.zeros(q.shape[1], dtype=torch.float32, device=q.device)
        return alibi_flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), slopes, scale=scale)
    from ascendspeed.accelerator.cpu_half_gemm import fp32_copies

    with fp32_copies(q, k, v) as wide:
        out = F.scaled_dot_product_attention(*wide, attn_mask=plan.allowed, is_causal=plan.causal,
                                             dropout_p=dropout_p, scale=scale)
    return out.to(q.dtype)


def fused_core_attention(layer, query, key, value, plan: MaskPlan, fp32_gemms: bool = False) -> torch.Tensor:
    """[sq, b, heads, d] query, [sk, b, groups, d] key and value in; [sq, b, heads * d_v] out, like Megatron.
    ``fp32_gemms``: the dtype has no fast GEMM on this CPU (``_attention_with_fp32_products``)."""
    sq, batch = query.shape[:2]
    dropout_p, rng = attention_dropout(layer)
    if query.device.type == "npu":
        with rng:
            context = _npu_fusion_attention(query, key, value, plan, layer.softmax_scale, dropout_p)
    else:
        groups = query.shape[2] // key.shape[2]
        q, k, v = (tensor.permute(1, 2, 0, 3) for tensor in (query, key, value))
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        with rng:
            if fp32_gemms:
                context = _attention_with_fp32_products(q, k, v, plan, layer.softmax_scale, dropout_p)
            else:
                context = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.allowed, is_causal=plan.causal,
                                                         dropout_p=dropout_p, scale=layer.softmax_scale)
        context = context.permute(2, 0, 1, 3).reshape(sq, batch, -1)
    if plan.query_rows is not None:
        context = context * plan.query_rows.view(sq, 1, 1).to(context.dtype)
    return context


def packed_core_attention(layer, query, key, value, packed_seq_params,
                          fp32_gemms: bool = False) -> Optional[torch.Tensor]:
    """A THD pack's attention ([t, heads, d] in, [t, heads * d] out, as Transformer Engine takes and returns
    it), or None where the kernel would not compute what the layer asks (a sliding window, a softmax offset,
    query-key layer scaling) or ``packed_plan`` leaves the pack to Megatron's path (which refuses it)."""
    if unsupported_by_kernel(layer) is not None:
        return None
    plan = packed_plan(layer.attn_mask_type.name == "causal", packed_seq_params, query.shape[0], query.device)
    if plan is None:
        return None
    query, key, value = (tensor.unsqueeze(1) for tensor in (query, key, value))
    return fused_core_attention(layer, query, key, value, plan, fp32_gemms).squeeze(1)
