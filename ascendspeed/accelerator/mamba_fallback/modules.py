"""The patches of ``accelerator.mamba_fallback``: ``mamba_ssm``'s names in ``megatron.core.ssm.mamba_mixer``."""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from ascendspeed.accelerator.mamba_fallback import decode, ssd
from ascendspeed.accelerator.triton_guard import triton_on_cuda_only
from ascendspeed.patching import ABSENT, EXISTS, replace, wrap

class GatedRMSNorm(torch.nn.Module):
    """``ExtendedRMSNorm``: ``mamba_ssm``'s gated RMSNorm (``layernorm_gated.RMSNorm``: groups of
    ``group_size`` features, ``silu(z)`` gate before or after the norm) with megatron-core's sharded state dict
    (the weight split along dimension 0 over the tensor-parallel group)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: Optional[int] = None,
                 norm_before_gate: bool = True, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        return ssd.gated_rms_norm(x, self.weight, z, eps=self.eps, group_size=self.group_size,
                                  norm_before_gate=self.norm_before_gate)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        accepted = inspect.signature(make_sharded_tensors_for_checkpoint).parameters
        groups = {}
        if "tp_group" in accepted:  # megatron-core 0.16+
            groups["tp_group"] = getattr(self, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
        if "dp_cp_group" in accepted and metadata is not None and "dp_cp_group" in metadata:
            groups["dp_cp_group"] = metadata["dp_cp_group"]
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets, **groups)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}, group_size={self.group_size}, " \
               f"norm_before_gate={self.norm_before_gate}"


_CONV_UPDATE = ("(x, conv_state, weight, bias, silu_activation, conv_state_indices, "
                "intermediate_conv_states=None)")
_STATE_UPDATE = ("(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, "
                 "state_batch_indices=None, intermediate_ssm_states=None)")


def patches():
    kernels = "TE-less Mamba: torch SSD scan for mamba_ssm's triton kernel"
    return [
        replace("megatron.core.ssm.mamba_mixer:HAVE_MAMBA_SSM", True, expect=EXISTS, sweep=False,
                name="Mamba fallback: replace mamba_mixer.HAVE_MAMBA_SSM (False without mamba_ssm): the torch "
                     "kernels below serve MambaMixer"),
        replace("megatron.core.ssm.mamba_mixer:ExtendedRMSNorm", GatedRMSNorm, expect=EXISTS, sweep=False,
                name="Mamba fallback: replace mamba_mixer.ExtendedRMSNorm (a MagicMock without mamba_ssm) by a "
                     "torch gated RMSNorm"),
        replace("megatron.core.ssm.mamba_mixer:mamba_split_conv1d_scan_combined", ssd.mamba_split_conv1d_scan_combined,
                expect=ABSENT, megatron="<0.17", name=f"Mamba fallback: {kernels} (training path)"),
        replace("megatron.core.ssm.mamba_mixer:mamba_split_conv1d_scan_combined", ssd.mamba_split_conv1d_scan_combined,
                expect=EXISTS, sweep=False, megatron=">=0.17", name=f"Mamba fallback: {kernels} (training path)"),
        replace("megatron.core.ssm.mamba_mixer:mamba_chunk_scan_combined", ssd.mamba_chunk_scan_combined,
                expect=ABSENT, megatron="<0.17", name=f"Mamba fallback: {kernels} (prefill path)"),
        replace("megatron.core.ssm.mamba_mixer:mamba_chunk_scan_combined", ssd.mamba_chunk_scan_combined,
                expect=EXISTS, sweep=False, megatron=">=0.17", name=f"Mamba fallback: {kernels} (prefill path)"),
        wrap("megatron.core.ssm.mamba_mixer:causal_conv1d_update", triton_on_cuda_only(decode.causal_conv1d_update),
             expect=_CONV_UPDATE, sweep=False, megatron=">=0.17",
             name="Mamba fallback: wrap causal_conv1d_update (triton), off CUDA the torch convolution step (decode)"),
        wrap("megatron.core.ssm.mamba_mixer:selective_state_update", triton_on_cuda_only(decode.selective_state_update),
             expect=_STATE_UPDATE, sweep=False, megatron=">=0.17",
             name="Mamba fallback: wrap selective_state_update (triton), off CUDA the torch SSM step (decode)"),
    ]
