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
other than THD packs without padding, dropout that would draw a mask (training with
``attention_dropout > 0``: Megatron draws it from its RNG tracker, element by element, in a layout the
kernels do not reproduce), sliding windows,
softmax offsets, query-key layer scaling, a causal mask between different query and key lengths, and
masks that are not boolean; and on the CPU, bf16 and fp16, where torch's flash kernel is the slower one
(``CPU_REDUCED_PRECISION``) except bf16 on CPUs with AMX from a few hundred tokens on
(``AMX_FLASH_TOKENS_BY_HEAD_DIM``), and except on CPUs without a fast GEMM for the dtype (no AVX-512 for bf16),
where Megatron's path runs torch's scalar half-precision GEMM: there the fused path computes in fp32
(``fused_core_attention(..., fp32_gemms=True)``).

A THD pack (``packed_seq_params``, Transformer Engine's format: [tokens, heads, d], sequences one after
another) attends within each sequence, which Megatron's local path refuses: the pack's block-diagonal
mask goes to the kernel.

Kernels: torch's ``scaled_dot_product_attention`` (flash attention on CPU and CUDA) and, on Ascend NPUs,
torch_npu's ``npu_fusion_attention``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from ascendspeed.accelerator.cpu_features import cpu_flags
from ascendspeed.accelerator.cpu_half_gemm import multiplies_in_fp32
from ascendspeed.features.attention_masks import is_plain_causal
from ascendspeed.features.megatron_flags import FUSED_ATTENTION_BACKENDS, attention_backend_name
from ascendspeed.ops.core_attention import MaskPlan, fused_core_attention, packed_core_attention, unsupported_by_kernel
from ascendspeed.patching import Patch, wrap


@dataclasses.dataclass(frozen=True)
class FusedAttentionSettings:
    """``config.attention_backend`` chooses per model. ``cpu_fp32_gemm_dtypes``: the dtypes this CPU has no fast
    GEMM for (``ascendspeed.accelerator.cpu_half_gemm``): there Megatron's materialised scores run torch's
    scalar half-precision GEMM, and the fused path computes in fp32 instead (``fused_core_attention``)."""

    cpu_fp32_gemm_dtypes: frozenset = frozenset()


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
    if layer.training and layer.attention_dropout.p > 0 and packed_seq_params is None:
        # Megatron's path cannot run a pack at all: there the kernel draws the dropout mask (as TE's does).
        return "attention dropout draws its mask from Megatron's RNG tracker"
    return unsupported_by_kernel(layer)


#: Dtypes in which torch's CPU flash attention (forward + backward, causal) is slower than Megatron's
#: materialised scores: bf16 2.7x (b8 h4 s128 d32) and 1.6x (b4 h8 s256 d64) of them on a 2-vCPU AMD EPYC
#: (AVX-512 with avx512_bf16, torch 2.13); fp32 is 0.59x and 0.80x. There Megatron's path runs, except for the
#: packs it cannot run, and except where AMX makes the flash kernel the faster one (below).
CPU_REDUCED_PRECISION = (torch.bfloat16, torch.float16)

#: On CPUs with AMX-BF16 (Intel Xeon from Sapphire Rapids) torch's bf16 flash kernel multiplies its blocks on
#: AMX and is the faster one from these many tokens on (head_dim -> tokens; other head dims: AMX_FLASH_TOKENS).
#: Forward + backward, causal, one thread, an Intel Xeon with AMX, flash / Megatron: d64 s256 0.68-0.72x, s512
#: 0.54x; d32 s512 0.37x (s256 0.97x); d128 s256 1.04x; at 128 tokens and below flash is 1.5-3x slower.
AMX_FLASH_TOKENS_BY_HEAD_DIM = {64: 256}
AMX_FLASH_TOKENS = 512


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU lists AMX-BF16 (False where its flags cannot be read)."""
    return "amx_bf16" in cpu_flags()


def _megatron_is_faster(query: torch.Tensor, key: torch.Tensor, settings: FusedAttentionSettings) -> bool:
    """Megatron's [s, b, heads, d] query and key: whether its materialised path beats the flash kernel here."""
    if (query.device.type != "cpu" or query.dtype not in CPU_REDUCED_PRECISION
            or query.dtype in settings.cpu_fp32_gemm_dtypes):
        return False
    if query.dtype == torch.bfloat16 and cpu_has_amx_bf16():
        tokens = min(query.shape[0], key.shape[0])
        return tokens < AMX_FLASH_TOKENS_BY_HEAD_DIM.get(query.shape[-1], AMX_FLASH_TOKENS)
    return True


def fused_plan(layer, query, key, attention_mask, attention_bias,
               settings: FusedAttentionSettings) -> Optional[MaskPlan]:
    """The fused kernel's mask plan for an unpacked call of ``layer`` (a ``DotProductAttention``), or None where
    Megatron's path runs: the kernel would differ from it, or Megatron's is the faster here."""
    if (why_unfused(layer, attention_mask, attention_bias, None) is not None
            or _megatron_is_faster(query, key, settings)):
        return None
    return mask_plan(layer.attn_mask_type.name == "causal", attention_mask, query.shape[0], key.shape[0])


def wrap_attention_forward(original, settings: FusedAttentionSettings):
    """Megatron's forward where the fused kernel would differ from it, the fused kernel everywhere else."""

    @functools.wraps(original)
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        fp32 = multiplies_in_fp32(query, settings.cpu_fp32_gemm_dtypes)
        if (packed_seq_params is not None and query.dim() == 3
                and why_unfused(self, attention_mask, attention_bias, packed_seq_params) is None):
            context = packed_core_attention(self, query, key, value, packed_seq_params, fp32_gemms=fp32)
            if context is not None:
                return context
        plan = fused_plan(self, query, key, attention_mask, attention_bias, settings) if packed_seq_params is None \
            else None
        if plan is None:
            return original(self, query, key, value, attention_mask, attn_mask_type, attention_bias,
                            packed_seq_params)
        return fused_core_attention(self, query, key, value, plan, fp32_gemms=fp32)

    return forward


def patches(settings: FusedAttentionSettings) -> list[Patch]:
    return [
        wrap("megatron.core.transformer.dot_product_attention:DotProductAttention.forward",
             functools.partial(wrap_attention_forward, settings=settings),
             expect="(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, "
                    "packed_seq_params=None)",
             name="fused_attention: core attention on the fused kernel where it computes Megatron's function"),
    ]
