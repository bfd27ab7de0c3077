"""``fla``'s functions that megatron-core's ``GatedDeltaNet`` calls, in torch, and the patches that install them.

The gated delta rule, per head, with a state ``S`` [key dim, value dim], decay ``g_t`` (log space) and write
strength ``beta_t``: ``S = exp(g_t) S``, ``S += beta_t k_t (v_t - S^T k_t)^T``, ``o_t = S^T q_t * scale``.
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch

from ascendspeed.accelerator.mamba_fallback import ssd
from ascendspeed.features.context_parallel.layout import segment_ids
from ascendspeed.patching import EXISTS, replace


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6, output_dtype: Optional[torch.dtype] = None):
    """``fla.modules.l2norm.l2norm``: ``x / sqrt(sum(x^2) + eps)`` over ``dim``, in fp32 (float64 for float64)."""
    acc = ssd.accumulator_dtype(x.dtype)
    values = x.to(acc)
    normed = values * torch.rsqrt(values.pow(2).sum(dim=dim, keepdim=True) + eps)
    return normed.to(output_dtype or x.dtype)


def _sequence_ids(cu_seqlens: Optional[torch.Tensor], batch: int, length: int) -> Optional[torch.Tensor]:
    """[batch, length] sequence index of every token of a pack (``fla``'s packs have batch 1), or None."""
    if cu_seqlens is None:
        return None
    if batch != 1:
        raise ValueError(f"fla's packed sequences (cu_seqlens) have batch 1, got batch {batch}")
    bounds = cu_seqlens.to(torch.int64)
    if int(bounds[-1]) != length:
        raise ValueError(f"cu_seqlens {bounds.tolist()} must end at the pack's {length} tokens")
    return segment_ids(torch.arange(length, device=bounds.device), bounds)[None]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  activation: Optional[str] = None, initial_state=None, output_final_state: bool = False,
                  cu_seqlens: Optional[torch.Tensor] = None, **unused):
    """``fla.modules.convolution.causal_conv1d`` on [batch, length, channels]: returns (output, None); a
    convolution state carried in or out (inference) has no torch path here."""
    if initial_state is not None or output_final_state:
        raise NotImplementedError("causal_conv1d: convolution states (inference) have no torch path in ascendspeed")
    seq_idx = _sequence_ids(cu_seqlens, x.size(0), x.size(1))
    return ssd.causal_conv1d(x, weight, bias, seq_idx=None if seq_idx is None else seq_idx.to(x.device),
                             activation=activation), None


def _megatron_torch_rule():
    """megatron-core's own torch chunked gated delta rule (what its deterministic mode runs)."""
    for module in ("megatron.core.ssm.gated_delta_net.common", "megatron.core.ssm.gated_delta_net"):
        try:
            return importlib.import_module(module).torch_chunk_gated_delta_rule
        except (ImportError, AttributeError):
            continue
    raise ImportError("megatron-core's torch_chunk_gated_delta_rule is not found")


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **unused):
    """``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` on [batch, length, heads, dim] q/k/v: megatron-core's
    torch chunked rule (fp32), once per sequence of a pack (``cu_seqlens``, batch 1). Returns (output,
    final states or None)."""
    if scale is not None and abs(scale - q.size(-1) ** -0.5) > 1e-12:
        raise NotImplementedError("chunk_gated_delta_rule: only the default scale 1/sqrt(key dim) has a torch path")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    rule = _megatron_torch_rule()
    if cu_seqlens is None:
        return rule(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state)
    if q.size(0) != 1:
        raise ValueError(f"fla's packed sequences (cu_seqlens) have batch 1, got batch {q.size(0)}")
    if initial_state is not None:
        raise NotImplementedError("chunk_gated_delta_rule: initial states per packed sequence have no torch path")
    bounds = cu_seqlens.to("cpu", torch.int64).tolist()
    outputs, finals = [], []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        out, final = rule(q[:, start:end], k[:, start:end], v[:, start:end], g=g[:, start:end],
                          beta=beta[:, start:end], output_final_state=output_final_state)
        outputs.append(out)
        finals.append(final)
    out = torch.cat(outputs, dim=1)
    return out, (torch.cat(finals) if output_final_state else None)


def patches():
    """0.18: one module ``megatron.core.ssm.gated_delta_net``; 0.19: a package of that name re-exporting the names
    of its ``common`` module (where the layer reads them), ``gdn`` holding copies of two of them."""
    why = "(None without fla)"
    return [
        replace("megatron.core.ssm.gated_delta_net:HAVE_FLA", True, expect=EXISTS, sweep=False,
                megatron=">=0.18", name="GDN fallback: replace gated_delta_net.HAVE_FLA: torch kernels serve it"),
        replace("megatron.core.ssm.gated_delta_net:l2norm", l2norm, expect=EXISTS, sweep=False,
                megatron=">=0.18", name=f"GDN fallback: replace gated_delta_net.l2norm {why}"),
        replace("megatron.core.ssm.gated_delta_net:causal_conv1d", causal_conv1d, expect=EXISTS, sweep=False,
                megatron=">=0.18", name=f"GDN fallback: replace gated_delta_net.causal_conv1d {why}"),
        replace("megatron.core.ssm.gated_delta_net:chunk_gated_delta_rule", chunk_gated_delta_rule, expect=EXISTS,
                sweep=False, megatron=">=0.18",
                name=f"GDN fallback: replace gated_delta_net.chunk_gated_delta_rule {why}"),
        replace("megatron.core.ssm.gated_delta_net.common:HAVE_FLA", True, expect=EXISTS, sweep=False,
                megatron=">=0.19", name="GDN fallback: replace gated_delta_net.common.HAVE_FLA: torch kernels serve it"),
        replace("megatron.core.ssm.gated_delta_net.common:l2norm", l2norm, expect=EXISTS, sweep=False,
                megatron=">=0.19", name=f"GDN fallback: replace gated_delta_net.common.l2norm {why}"),
        replace("megatron.core.ssm.gated_delta_net.common:causal_conv1d", causal_conv1d, expect=EXISTS, sweep=False,
                megatron=">=0.19", name=f"GDN fallback: replace gated_delta_net.common.causal_conv1d {why}"),
        replace("megatron.core.ssm.gated_delta_net.common:chunk_gated_delta_rule", chunk_gated_delta_rule,
                expect=EXISTS, sweep=False, megatron=">=0.19",
                name=f"GDN fallback: replace gated_delta_net.common.chunk_gated_delta_rule {why}"),
        replace("megatron.core.ssm.gated_delta_net.gdn:causal_conv1d", causal_conv1d, expect=EXISTS, sweep=False,
                megatron=">=0.19", name=f"GDN fallback: replace gated_delta_net.gdn.causal_conv1d {why}"),
        replace("megatron.core.ssm.gated_delta_net.gdn:chunk_gated_delta_rule", chunk_gated_delta_rule,
                expect=EXISTS, sweep=False, megatron=">=0.19",
                name=f"GDN fallback: replace gated_delta_net.gdn.chunk_gated_delta_rule {why}"),
    ]
