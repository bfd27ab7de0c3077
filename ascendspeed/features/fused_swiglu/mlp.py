"""The replacements installed by ``--use-fused-swiglu``: both of megatron-core's SwiGLU paths on the
fused operator. Nothing here reads global arguments; each call sees only its MLP's own config."""
from __future__ import annotations

import functools

import torch.nn.functional as F

from ascendspeed.ops.swiglu import swiglu


def fused_bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
    """megatron-core's ``bias_swiglu_impl`` on the fused operator: ``swiglu(input + bias)`` over the last dim.

    The bias is added first, so autograd saves the biased input once (Megatron saves input and bias and
    adds them again in backward). ``cpu_offload_input`` marks that saved tensor for Transformer
    Engine's activation offloading, as Megatron does.
    """
    if fp8_input_store:
        raise ValueError(
            "ascendspeed fused SwiGLU keeps its saved input in the activation dtype; it cannot run with "
            "activation_func_fp8_input_store=True. Turn that off in the TransformerConfig or drop "
            "--use-fused-swiglu."
        )
    x = input if bias is None else input + bias
    if cpu_offload_input:
        x.activation_offloading = True
    return swiglu(x, -1)


def runs_plain_gated_silu(config) -> bool:
    """Whether ``MLP.forward`` would take its unfused gated path with plain SiLU for this config: the
    ``glu`` closure computing ``silu(a) * b`` with no clamp and no linear offset."""
    return (
        config.gated_linear_unit
        and config.activation_func is F.silu
        and not config.bias_activation_fusion
        and not config.use_te_activation_func
        and config.activation_func_clamp_value is None
        and config.glu_linear_offset == 0
    )


def wrap_mlp_forward(original):
    """``MLP.forward`` with the unfused gated path on the fused operator.

    Every other case, including a per-token scale (MoE experts) and the fusion path (which goes
    through ``fused_bias_swiglu_impl``), runs megatron-core's own forward.
    """

    @functools.wraps(original)
    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None or not runs_plain_gated_silu(self.config):
            return original(self, hidden_states, per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        return self.linear_fc2(swiglu(intermediate, -1))

    return forward

