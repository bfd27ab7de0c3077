"""Core attention on the device's fused kernel wherever it computes exactly Megatron's function.

megatron-core's local ``DotProductAttention`` materialises the [b, heads, sq, sk] scores (``baddbmm``),
masks them in place, normalises them and multiplies by the values: on a CPU that is half again the
time of torch's flash attention, which never forms the scores and skips the masked-out blocks of a
causal mask. Both compute softmax(q k^T * scale + mask) v; Megatron fills masked scores with -10000
where the fused kernels use -inf, which differ only for a row whose every key is masked (Megatron then
averages all values, the kernels do not): such rows keep Megatron's path.

The fused kernel runs when the layer's ``config.attention_backend`` is ``auto`` (Megatron's default),
``flash`` or ``fused`` and the call needs nothing the kernel lacks; otherwise Megatron's own forward
runs: ALiBi layers (their bias is added by the alibi feature's paths), an ``attention_bias``, packs
other than THD packs without padding, dropout that would draw a mask (training with ``attention_dropout > 0``: Megatron draws it
from its RNG tracker, element by element, in a layout the kernels do not reproduce), sliding windows,
softmax offsets, query-key layer scaling, a causal mask between different query and key lengths, and
masks that are not boolean; and on the CPU, bf16 and fp16, where torch's flash kernel is the slower one
(``CPU_REDUCED_PRECISION``).

A THD pack (``packed_seq_params``, Transformer Engine's format: [tokens, heads, d], sequences one after
another) attends within each sequence, which Megatron's local path refuses: the pack's block-diagonal
mask goes to the kernel.

Kernels: torch's ``scaled_dot_product_attention`` (flash attention on CPU and CUDA) and, on Ascend NPUs,
torch_npu's ``npu_fusion_attention``.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Optional

import torch
import torch.nn.functional as F

from ascendspeed.features.attention_masks import is_plain_causal
from ascendspeed.features.megatron_flags import FUSED_ATTENTION_BACKENDS, attention_backend_name
from ascendspeed.patching import Patch, wrap


@dataclasses.dataclass(frozen=True)
class FusedAttentionSettings:
    """The fused core attention has no options: ``config.attention_backend`` chooses per model."""


@dataclasses.dataclass(frozen=True)
class MaskPlan:
    """How the fused kernel applies a call's mask: the causal triangle, a boolean mask (True: may attend), or
    nothing."""

    causal: bool
    allowed: Optional[torch.Tensor] = None


def mask_plan(causal_type: bool, attention_mask: Optional[torch.Tensor], sq: int, sk: int) -> Optional[MaskPlan]:
    """The fused kernel's form of Megatron's masking, or None where only Megatron's path is exact.

    Megatron applies a given mask whatever the layer's mask type, and makes the causal one itself for a
    causal layer called without a mask (``FusedScaleMaskSoftmax``)."""
    if attention_mask is None:
        if not causal_type or sq == 1:
            return MaskPlan(causal=False)
        return MaskPlan(causal=True) if sq == sk else None
    if attention_mask.dtype != torch.bool:
        return None
    if sq == sk and is_plain_causal(attention_mask, sq, sk):
        return MaskPlan(causal=True)
    if bool(attention_mask.all(dim=-1).any()):
        return None
    return MaskPlan(causal=False, allowed=attention_mask.logical_not())


def _same_bounds(first: Optional[torch.Tensor], second: Optional[torch.Tensor]) -> bool:
    return first is None or second is None or torch.equal(first.cpu(), second.cpu())


def packed_plan(causal_type: bool, packed_seq_params, total: int, device: torch.device) -> Optional[MaskPlan]:
    """The mask of a THD pack (sequences one after another, no batch dimension): each token attends to the
    tokens of its own sequence (the earlier ones, in a causal layer); tokens after the last boundary form
    one more sequence. None (Megatron's path, which refuses packs) where the pack has padding between its
    sequences or different query and key boundaries."""
    bounds = packed_seq_params.cu_seqlens_q
    if bounds is None or not (_same_bounds(packed_seq_params.cu_seqlens_q_padded, bounds)
                              and _same_bounds(packed_seq_params.cu_seqlens_kv_padded, packed_seq_params.cu_seqlens_kv)
                              and _same_bounds(packed_seq_params.cu_seqlens_kv, bounds)):
        return None
    positions = torch.arange(total, device=device)
    sequence = torch.searchsorted(bounds.to(device=device, dtype=torch.long)[1:], positions, right=True)
    allowed = sequence[:, None] == sequence[None, :]
    if causal_type:
        allowed &= positions[:, None] >= positions[None, :]
    return MaskPlan(causal=False, allowed=allowed.view(1, 1, total, total))


def why_unfused(layer, attention_mask, attention_bias, packed_seq_params) -> Optional[str]:
    """Why this call of ``layer`` (a ``DotProductAttention``) keeps Megatron's path; None: it need not."""
    backend = attention_backend_name(getattr(layer.config, "attention_backend", "auto"))
    if backend not in FUSED_ATTENTION_BACKENDS:
        return f"attention_backend {backend}"
    if layer.__dict__.get("alibi") is not None:
        return "ALiBi adds its bias in its own paths"
    if attention_bias is not None:
        return "an attention bias"
    if packed_seq_params is not None and packed_seq_params.qkv_format != "thd":
        return f"packed sequences in the {packed_seq_params.qkv_format!r} format"
    if layer.training and layer.attention_dropout.p > 0:
        return "attention dropout draws its mask from Megatron's RNG tracker"
    if layer.softmax_offset is not None or layer.scale_mask_softmax.window_size is not None:
        return "a softmax offset or a sliding window"
    if layer.config.apply_query_key_layer_scaling:
        return "query-key layer scaling"
    return None


def _npu_fusion_attention(query, key, value, plan: MaskPlan, scale: float) -> torch.Tensor:
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
        atten_mask=masked, scale=scale, keep_prob=1.0, sparse_mode=0)[0]


def fused_core_attention(layer, query, key, value, plan: MaskPlan) -> torch.Tensor:
    """[sq, b, heads, d] query, [sk, b, groups, d] key and value in; [sq, b, heads * d_v] out, like Megatron."""
    sq, batch = query.shape[:2]
    if query.device.type == "npu":
        return _npu_fusion_attention(query, key, value, plan, layer.softmax_scale)
    groups = query.shape[2] // key.shape[2]
    q, k, v = (tensor.permute(1, 2, 0, 3) for tensor in (query, key, value))
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.allowed, is_causal=plan.causal,
                                             scale=layer.softmax_scale)
    return context.permute(2, 0, 1, 3).reshape(sq, batch, -1)


#: Dtypes in which torch's CPU flash attention (forward + backward, causal) is slower than Megatron's
#: materialised scores: bf16 2.7x (b8 h4 s128 d32) and 1.6x (b4 h8 s256 d64) of them on a 2-vCPU AMD EPYC
#: (AVX-512 with avx512_bf16, torch 2.13); fp32 is 0.59x and 0.80x. There Megatron's path runs, except for the
#: packs it cannot run.
CPU_REDUCED_PRECISION = (torch.bfloat16, torch.float16)


def _megatron_is_faster(query: torch.Tensor) -> bool:
    return query.device.type == "cpu" and query.dtype in CPU_REDUCED_PRECISION


def wrap_attention_forward(original):
    """Megatron's forward where the fused kernel would differ from it, the fused kernel everywhere else."""

    @functools.wraps(original)
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        plan = None
        causal_type = self.attn_mask_type.name == "causal"
        packed = packed_seq_params is not None and query.dim() == 3
        if why_unfused(self, attention_mask, attention_bias, packed_seq_params) is None:
            if packed:
                plan = packed_plan(causal_type, packed_seq_params, query.shape[0], query.device)
            elif packed_seq_params is None and not _megatron_is_faster(query):
                plan = mask_plan(causal_type, attention_mask, query.shape[0], key.shape[0])
        if plan is None:
            return original(self, query, key, value, attention_mask, attn_mask_type, attention_bias,
                            packed_seq_params)
        if packed:  # [t, heads, d], as TE takes a THD pack; [t, heads * d] out, as TE returns it
            query, key, value = (tensor.unsqueeze(1) for tensor in (query, key, value))
            return fused_core_attention(self, query, key, value, plan).squeeze(1)
        return fused_core_attention(self, query, key, value, plan)

    return forward


def patches(settings: FusedAttentionSettings) -> list[Patch]:
    return [
        wrap("megatron.core.transformer.dot_product_attention:DotProductAttention.forward", wrap_attention_forward,
             expect="(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, "
                    "packed_seq_params=None)",
             name="fused_attention: core attention on the fused kernel where it computes Megatron's function"),
    ]
