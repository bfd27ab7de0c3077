"""Mamba-2's state-space duality (SSD) layer in torch: the causal depthwise convolution and the chunked scan.

``mamba_ssm`` computes these with triton kernels and ``causal_conv1d`` with CUDA ones; megatron-core's
``MambaMixer`` calls them (``mamba_split_conv1d_scan_combined`` in training, ``mamba_chunk_scan_combined`` in
prefill). The functions here keep those contracts on any device, in torch ops under autograd.

The scan: per head ``h``, with ``dt = softplus(dt + dt_bias)`` clamped to ``dt_limit`` and the input ``x_t``
(``[headdim]``), ``B_t`` and ``C_t`` (``[d_state]``, of the head's group),

    state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * x_t B_t^T,        y_t = state_t C_t + D_h * x_t,

and ``y_t * silu(z_t)`` with a gate ``z``. The chunked form (Dao and Gu, arXiv 2405.21060): within a chunk of
``chunk_size`` tokens the output is a masked matrix product, ``(C B^T * L) (dt x)`` with ``L[i, j] = exp(sum of
dt A over (j, i])``; each chunk's final state is carried to the next by one recurrence over chunks. A new
packed sequence (``seq_idx`` changes) sets the decay at its first token to ``exp(-inf) = 0``, which drops the
state before it, and the convolution reads no tap across the boundary. Sums of decays are formed by cumulative
sums of masked copies, never by subtracting cumulative sums, so a ``-inf`` never meets another one.

Scores, decays and states are float32 (float64 for float64 inputs); outputs are rounded to the input dtype once.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _sequence_starts(seq_idx: torch.Tensor) -> torch.Tensor:
    """[b, l] True at every token whose packed sequence differs from the previous token's (never at t = 0)."""
    starts = torch.zeros_like(seq_idx, dtype=torch.bool)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return starts


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  seq_idx: Optional[torch.Tensor] = None, activation: Optional[str] = None) -> torch.Tensor:
    """``causal_conv1d_fn``'s contract on [batch, length, channels] (``x``): ``y_t = bias + sum_k weight[:, k] *
    x_{t - (width - 1) + k}``, taps before the start of ``x`` or of the token's packed sequence (``seq_idx``
    [batch, length]) reading zero; then SiLU for ``activation`` "silu" / "swish"."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d: activation must be None, 'silu' or 'swish', got {activation!r}")
    acc = accumulator_dtype(x.dtype)
    length, width = x.size(1), weight.size(-1)
    source = x.to(acc)
    out = torch.zeros_like(source) if bias is None else bias.to(acc).expand_as(source).clone()
    for tap in range(width):
        shift = width - 1 - tap
        shifted = F.pad(source, (0, 0, shift, 0))[:, :length] if shift else source
        if seq_idx is not None and shift:
            same = F.pad(seq_idx, (shift, 0), value=-1)[:, :length] == seq_idx
            shifted = shifted * same[..., None].to(acc)
        out = out + shifted * weight[:, tap].to(acc)
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)


def segment_sums(values: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: ``out[i, j]`` the sum of ``values`` over ``(j, i]`` for ``j <= i``, -inf above."""
    size = values.size(-1)
    below = torch.ones(size, size, dtype=torch.bool, device=values.device).tril(-1)
    spread = values[..., :, None].expand(*values.shape, size).masked_fill(~below, 0)
    sums = spread.cumsum(dim=-2)
    return sums.masked_fill(~below.logical_or(torch.eye(size, dtype=torch.bool, device=values.device)), float("-inf"))


def _heads_of_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, l, groups, n] -> [b, l, heads, n]: head ``h`` reads group ``h // (heads / groups)``."""
    groups = t.size(2)
    if heads % groups:
        raise ValueError(f"the number of heads ({heads}) must be a multiple of the number of groups ({groups})")
    return t.repeat_interleave(heads // groups, dim=2) if groups != heads else t


def chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               chunk_size: int, D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None,
               dt_bias: Optional[torch.Tensor] = None, initial_states: Optional[torch.Tensor] = None,
               seq_idx: Optional[torch.Tensor] = None, dt_softplus: bool = False,
               dt_limit: tuple[float, float] = (0.0, float("inf"))) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan of the module docstring: ``x`` [b, l, heads, headdim], ``dt`` [b, l, heads], ``A`` [heads],
    ``B``/``C`` [b, l, groups, d_state], ``D`` [heads] or [heads, headdim], ``z`` like ``x``,
    ``initial_states`` [b, heads, headdim, d_state]. Returns (y like ``x`` in its dtype, the final states
    [b, heads, headdim, d_state] in the accumulator dtype)."""
    batch, length, heads, headdim = x.shape
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    acc = accumulator_dtype(x.dtype)
    dt = dt.to(acc)
    if dt_bias is not None:
        dt = dt + dt_bias.to(acc)
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    decay = dt * A.to(acc)                                                         # [b, l, h]
    if seq_idx is not None:
        decay = decay.masked_fill(_sequence_starts(seq_idx)[..., None], float("-inf"))
    chunks = math.ceil(length / chunk_size)
    padding = chunks * chunk_size - length

    def chunked(t):  # [b, l, ...] -> [b, chunks, chunk_size, ...], zero-padded
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, padding)) if padding else t
        return t.reshape(batch, chunks, chunk_size, *t.shape[2:])

    x_dt = chunked(x.to(acc) * dt[..., None])                                      # [b, c, q, h, p]
    B_heads = chunked(_heads_of_groups(B.to(acc), heads))                          # [b, c, q, h, n]
    C_heads = chunked(_heads_of_groups(C.to(acc), heads))
    decay = chunked(decay).permute(0, 3, 1, 2)                                     # [b, h, c, q]

    within = torch.exp(segment_sums(decay))                                        # [b, h, c, q, q]
    scores = torch.einsum("bclhn,bcshn->bhcls", C_heads, B_heads) * within
    y = torch.einsum("bhcls,bcshp->bclhp", scores, x_dt)

    to_chunk_end = within[..., -1, :]                                              # [b, h, c, q]
    chunk_states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B_heads, to_chunk_end, x_dt)
    start = (torch.zeros_like(chunk_states[:, :1]) if initial_states is None
             else initial_states.to(acc)[:, None])
    states = torch.cat([start, chunk_states], dim=1)                               # [b, c + 1, h, p, n]
    across = torch.exp(segment_sums(F.pad(decay.sum(dim=-1), (1, 0))))            # [b, h, c + 1, c + 1]
    states = torch.einsum("bhzc,bchpn->bzhpn", across, states)
    from_chunk_start = torch.exp(decay.cumsum(dim=-1))                             # [b, h, c, q]
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", C_heads, states[:, :-1], from_chunk_start)

    y = y.reshape(batch, chunks * chunk_size, heads, headdim)[:, :length]
    if D is not None:
        skip = D.to(acc)[:, None] if D.dim() == 1 else D.to(acc)
        y = y + x.to(acc) * skip
    if z is not None:
        y = y * F.silu(z.to(acc))
    return y.to(x.dtype), states[:, -1]


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    """``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``'s contract (``chunk_scan``)."""
    if cu_seqlens is not None or return_varlen_states:
        raise NotImplementedError("mamba_chunk_scan_combined: per-sequence final states (cu_seqlens, "
                                  "return_varlen_states) have no torch path in ascendspeed")
    y, final_states = chunk_scan(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                                 initial_states=initial_states, seq_idx=seq_idx, dt_softplus=dt_softplus,
                                 dt_limit=dt_limit)
    return (y, final_states.to(x.dtype)) if return_final_states else y


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, z: Optional[torch.Tensor] = None, eps: float = 1e-6,
                   group_size: Optional[int] = None, norm_before_gate: bool = True) -> torch.Tensor:
    """RMSNorm over groups of ``group_size`` features (all, by default), scaled by ``weight``, gated by
    ``silu(z)`` after the norm (``norm_before_gate``) or before it; in the accumulator dtype, rounded once."""
    acc = accumulator_dtype(x.dtype)
    features = x.size(-1)
    group_size = features if group_size is None else group_size
    if features % group_size:
        raise ValueError(f"gated RMSNorm: {features} features do not split into groups of {group_size}")
    values = x.to(acc)
    gate = None if z is None else F.silu(z.to(acc))
    if gate is not None and not norm_before_gate:
        values = values * gate
    grouped = values.reshape(*values.shape[:-1], features // group_size, group_size)
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = normed.reshape(values.shape) * weight.to(acc)
    if gate is not None and norm_before_gate:
        out = out * gate
    return out.to(x.dtype)


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True, state_dtype=None):
    """``mamba_ssm``'s training kernel: ``zxbcdt`` [b, l, 2 d_nonssm + 2 dim + 2 ngroups d_state + heads] split
    into (the non-SSM SwiGLU part, ``z``, ``xBC``, ``dt``); ``xBC`` through ``causal_conv1d``; the scan with
    ``dt_softplus``; the gate ``z`` in the scan, or in a gated RMSNorm with ``rmsnorm_weight``; then the
    optional output projection. ``state_dtype`` (newer mamba_ssm) only sets the dtype of kept states."""
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("mamba_split_conv1d_scan_combined: headdim is required when D is [heads]")
        heads = D.size(0)
    else:
        heads, headdim = D.shape
    dim = heads * headdim
    d_state = (conv1d_weight.size(0) - dim) // ngroups // 2
    d_nonssm = (zxbcdt.size(-1) - 2 * dim - 2 * ngroups * d_state - heads) // 2
    if d_nonssm < 0 or zxbcdt.size(-1) != 2 * d_nonssm + 2 * dim + 2 * ngroups * d_state + heads:
        raise ValueError(f"mamba_split_conv1d_scan_combined: zxbcdt's last dimension {zxbcdt.size(-1)} does not "
                         f"split into z, xBC ({conv1d_weight.size(0)}) and dt ({heads})")
    zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * d_state, heads], dim=-1)
    xBC = causal_conv1d(xBC, conv1d_weight, conv1d_bias, seq_idx=seq_idx, activation=activation)
    x, B, C = torch.split(xBC, [dim, ngroups * d_state, ngroups * d_state], dim=-1)
    batch, length = x.shape[:2]
    x = x.reshape(batch, length, heads, headdim)
    B = B.reshape(batch, length, ngroups, d_state)
    C = C.reshape(batch, length, ngroups, d_state)
    z = z.reshape(batch, length, heads, headdim)
    y, final_states = chunk_scan(x, dt, A, B, C, chunk_size, D=D, z=z if rmsnorm_weight is None else None,
                                 dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True,
                                 dt_limit=dt_limit)
    y = y.reshape(batch, length, dim)
    if rmsnorm_weight is not None:
        y = gated_rms_norm(y, rmsnorm_weight, z.reshape(batch, length, dim), eps=rmsnorm_eps,
                           group_size=dim // ngroups, norm_before_gate=norm_before_gate)
    if d_nonssm:
        gate, up = zx0.chunk(2, dim=-1)
        y = torch.cat([F.silu(gate) * up, y], dim=-1)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    if not return_final_states:
        return y
    return y, final_states.to(state_dtype or x.dtype)
