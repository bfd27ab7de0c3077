"""Mamba-2's single-step (decode) kernels in torch: the state updates megatron-core's inference runs per token.

megatron-core 0.17+ ships them as triton kernels (``megatron.core.ssm.ops.causal_conv1d_triton.
causal_conv1d_update`` and ``ops.mamba_ssm.selective_state_update``), which ``MambaMixer._ssm_decode`` calls
for every generated token (and for speculative drafts, several tokens a step). These functions keep their
contracts on any device:

* ``causal_conv1d_update``: per token, the convolution state (the last ``state_len`` inputs of each channel)
  shifts left by one and takes the token; the output is the bias plus the last ``width`` state columns times
  the weight, then SiLU;
* ``selective_state_update``: per token, ``state = exp(dt A) state + dt B x^T`` and
  ``y = state C + D x``, gated by ``silu(z)``, with ``dt = softplus(dt + dt_bias)``.

Both update the states in place, take a slot per batch entry (``*_indices``; a negative slot is padding:
output zero, no state touched) and can write the state after every token into ``intermediate_*`` (speculative
decoding rolls back to one of them). The arithmetic is float32 (float64 for float64 inputs) as in the triton
kernels; outputs are rounded to the input dtype, states to theirs.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ascendspeed.accelerator.mamba_fallback.ssd import accumulator_dtype


def _slots(batch: int, indices: Optional[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the batch entries that are not padding, their state slots)."""
    if indices is None:
        entries = torch.arange(batch, device=device)
        return entries, entries
    indices = indices.to(device=device, dtype=torch.long).reshape(-1)
    if indices.numel() != batch:
        raise ValueError(f"state indices: one slot per batch entry ({batch}), got {indices.numel()}")
    entries = torch.nonzero(indices >= 0).flatten()
    return entries, indices[entries]


def _silu_flag(activation) -> bool:
    """megatron-core passes a bool (``silu_activation``), its mixer the activation's name."""
    if activation in (None, False, True):
        return bool(activation)
    if activation not in ("silu", "swish"):
        raise ValueError(f"causal_conv1d_update: activation must be None, 'silu' or 'swish', got {activation!r}")
    return True


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor], silu_activation, conv_state_indices: Optional[torch.Tensor],
                         intermediate_conv_states: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` [batch, dim] or [batch, seqlen, dim] through the causal depthwise convolution whose history is
    ``conv_state`` [slots, dim, state_len] (``weight`` [dim, width], ``width <= state_len``), updated in place;
    ``intermediate_conv_states`` [slots, seqlen, dim, state_len] gets the state after each token."""
    flat = x.dim() == 2
    tokens = x.unsqueeze(1) if flat else x
    batch, length, dim = tokens.shape
    state_len, width = conv_state.size(-1), weight.size(-1)
    if width > state_len:
        raise ValueError(f"causal_conv1d_update: the weight's width ({width}) exceeds the state's length "
                         f"({state_len})")
    silu = _silu_flag(silu_activation)
    entries, slots = _slots(batch, conv_state_indices, x.device)
    acc = accumulator_dtype(x.dtype)
    out = torch.zeros_like(tokens)
    window = conv_state[slots]                                                     # [n, dim, state_len]
    taps, shift = weight.to(acc), None if bias is None else bias.to(acc)
    for step in range(length):
        window = torch.cat([window[..., 1:], tokens[entries, step].to(window.dtype)[..., None]], dim=-1)
        if intermediate_conv_states is not None:
            intermediate_conv_states[slots, step] = window.to(intermediate_conv_states.dtype)
        value = (window[..., state_len - width:].to(acc) * taps).sum(-1)
        if shift is not None:
            value = value + shift
        out[entries, step] = (F.silu(value) if silu else value).to(out.dtype)
    conv_state[slots] = window
    return out.squeeze(1) if flat else out


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: Optional[torch.Tensor] = None,
                           z: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
                           dt_softplus: bool = False, state_batch_indices: Optional[torch.Tensor] = None,
                           intermediate_ssm_states: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One or more decode steps of the SSM. Shapes as the triton kernel takes them: ``state`` [slots, heads,
    dim, dstate] (or without heads); ``x``, ``dt``, ``z`` [batch, (seqlen,) (heads,) dim]; ``A`` [(heads,) dim,
    dstate]; ``B``, ``C`` [batch, (seqlen,) (groups,) dstate]; ``D``, ``dt_bias`` [(heads,) dim];
    ``intermediate_ssm_states`` [slots, seqlen, (heads,) dim, dstate]. Returns ``y`` shaped like ``x``."""
    has_heads = state.dim() > 3
    token_dims = 3 if has_heads else 2                                            # dims of one step's x
    single = x.dim() == token_dims
    stepped = x.dim() == token_dims + 1

    def standard(t):  # -> [batch, seqlen, heads, ...]
        if t is None:
            return None
        if single:
            t = t.unsqueeze(1)
        return t if has_heads else t.unsqueeze(2)

    if not (single or stepped):
        raise ValueError(f"selective_state_update: x must have {token_dims} or {token_dims + 1} dimensions for a "
                         f"state of {state.dim()}, got {x.dim()}")
    xs, dts, Bs, Cs, zs = (standard(t) for t in (x, dt, B, C, z))
    states = state if has_heads else state.unsqueeze(1)
    heads_A = A if has_heads else A.unsqueeze(0)
    heads_D = None if D is None else (D if has_heads else D.unsqueeze(0))
    heads_bias = None if dt_bias is None else (dt_bias if has_heads else dt_bias.unsqueeze(0))
    intermediate = intermediate_ssm_states
    if intermediate is not None and not has_heads:
        intermediate = intermediate.unsqueeze(2)
    batch, length, heads, dim = xs.shape
    groups = Bs.size(2)
    if heads % groups:
        raise ValueError(f"selective_state_update: {heads} heads do not split into {groups} groups")
    entries, slots = _slots(batch, state_batch_indices, x.device)
    acc = accumulator_dtype(x.dtype)
    out = torch.zeros(xs.shape, dtype=x.dtype, device=x.device)
    current = states[slots].to(acc)                                                # [n, heads, dim, dstate]
    A_acc = heads_A.to(acc).expand(heads, dim, states.size(-1))
    for step in range(length):
        step_dt = dts[entries, step].to(acc)
        if heads_bias is not None:
            step_dt = step_dt + heads_bias.to(acc)
        if dt_softplus:
            step_dt = F.softplus(step_dt)                                         # linear above 20, as the kernel
        step_x = xs[entries, step].to(acc)
        step_B = Bs[entries, step].to(acc).repeat_interleave(heads // groups, dim=1)  # [n, heads, dstate]
        step_C = Cs[entries, step].to(acc).repeat_interleave(heads // groups, dim=1)
        current = (current * torch.exp(A_acc * step_dt[..., None])
                   + step_dt[..., None] * step_B[:, :, None, :] * step_x[..., None])
        if intermediate is not None:
            intermediate[slots, step] = current.to(intermediate.dtype)
        y = (current * step_C[:, :, None, :]).sum(-1)
        if heads_D is not None:
            y = y + step_x * heads_D.to(acc)
        if zs is not None:
            y = y * F.silu(zs[entries, step].to(acc))
        out[entries, step] = y.to(out.dtype)
    states[slots] = current.to(states.dtype)
    if not has_heads:
        out = out.squeeze(2)
    return out.squeeze(1) if single else out
