"""The patches of ``--use-fused-swiglu``: megatron-core's SwiGLU on ``ascendspeed.ops.swiglu``.

megatron-core's ``MLP.forward`` computes a SwiGLU one of two ways: with ``bias_activation_fusion`` it
calls ``bias_swiglu_impl`` (bound by name in ``mlp.py``; experts called with routing probabilities call
``weighted_bias_swiglu_impl``), otherwise an unfused ``glu`` closure local to ``forward``. Two replacements
cover every path: both functions become the fused operator, and MLPs (and grouped experts, ``TEGroupedMLP``,
whose fusion path calls ``weighted_bias_swiglu_impl``) that would take the unfused path with a plain SiLU gate
are built with ``bias_activation_fusion`` on, in a copy of their config that only the MLP
sees, so they reach those replacements. Nothing here reads global
arguments; each MLP sees only its own config.
"""
from __future__ import annotations

import copy
import functools

from ascendspeed.features.fused_swiglu.config import runs_plain_gated_silu
from ascendspeed.ops.swiglu import swiglu, weighted_swiglu
from ascendspeed.patching import Patch, replace, wrap


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


def fused_weighted_bias_swiglu_impl(input, bias, weights, fp8_input_store=False):
    """megatron-core's ``weighted_bias_swiglu_impl`` (an expert's SwiGLU scaled by its tokens' routing
    probabilities) on the fused weighted operator: ``swiglu(input + bias) * weights`` in one pass, in fp32,
    rounded once to the input's dtype (megatron-core rounds the SwiGLU, then the product). A bias is taken
    (megatron-core's raises NotImplementedError)."""
    if fp8_input_store:
        raise ValueError(
            "ascendspeed fused SwiGLU keeps its saved input in the activation dtype; it cannot run with "
            "activation_func_fp8_input_store=True. Turn that off in the TransformerConfig or drop "
            "--use-fused-swiglu."
        )
    shape = input.shape
    x = input.reshape(-1, shape[-1])
    if weights.numel() != x.shape[0]:
        raise ValueError(
            f"weighted_bias_swiglu_impl: weights must hold one routing probability per token of input "
            f"({x.shape[0]} tokens in input of shape {tuple(shape)}), got weights of shape {tuple(weights.shape)}"
        )
    if bias is not None:
        x = x + bias
    out = weighted_swiglu(x, weights.reshape(x.shape[0], 1))
    return out.view(*shape[:-1], shape[-1] // 2)


def _take_the_fusion_path(module, config) -> None:
    """A module built for the unfused plain-SiLU gated path gets a copy of its config with
    ``bias_activation_fusion`` on, which only it sees: its forward then calls the fused operator."""
    if runs_plain_gated_silu(config):
        module.config = copy.copy(config)
        module.config.bias_activation_fusion = True


def wrap_mlp_init(original):
    """MLPs on the unfused plain-SiLU gated path, dense and experts, are switched to the fusion path, where
    ``bias_swiglu_impl`` (dense) and ``weighted_bias_swiglu_impl`` (experts with routing probabilities) are
    the fused operator."""

    @functools.wraps(original)
    def __init__(self, config, submodules, is_expert=False, *args, **kwargs):
        original(self, config, submodules, is_expert, *args, **kwargs)
        _take_the_fusion_path(self, config)

    return __init__


def wrap_grouped_mlp_init(original):
    """Grouped experts (``TEGroupedMLP``, ``--moe-grouped-gemm``) on the unfused plain-SiLU gated path are
    switched to their fusion path, which calls ``weighted_bias_swiglu_impl``: the fused operator."""

    @functools.wraps(original)
    def __init__(self, num_local_experts, config, submodules, *args, **kwargs):
        original(self, num_local_experts, config, submodules, *args, **kwargs)
        _take_the_fusion_path(self, config)

    return __init__


def patches() -> list[Patch]:
    return [
        replace("megatron.core.transformer.mlp:bias_swiglu_impl", fused_bias_swiglu_impl,
                expect="(input, bias, fp8_input_store=False, cpu_offload_input=False)",
                name="fused SwiGLU: bias_swiglu_impl on the fused operator"),
        replace("megatron.core.transformer.mlp:weighted_bias_swiglu_impl", fused_weighted_bias_swiglu_impl,
                expect="(input, bias, weights, fp8_input_store=False)",
                name="fused SwiGLU: experts' weighted_bias_swiglu_impl on the fused operator"),
        wrap("megatron.core.transformer.mlp:MLP.__init__", wrap_mlp_init,
             expect="(self, config, submodules, is_expert=False, input_size=None, ffn_hidden_size=None, "
                    "tp_group=None)",
             megatron="<0.18", name="fused SwiGLU: unfused plain-SiLU gated MLPs take the fused path"),
        wrap("megatron.core.transformer.mlp:MLP.__init__", wrap_mlp_init,
             expect="(self, config, submodules, is_expert=False, input_size=None, ffn_hidden_size=None, "
                    "tp_group=None, name=None)",
             megatron=">=0.18", name="fused SwiGLU: unfused plain-SiLU gated MLPs take the fused path"),
        wrap("megatron.core.transformer.moe.experts:TEGroupedMLP.__init__", wrap_grouped_mlp_init,
             expect="(self, num_local_experts, config, submodules, pg_collection=None)", megatron="<0.18",
             name="fused SwiGLU: unfused plain-SiLU gated grouped experts take the fused path"),
        wrap("megatron.core.transformer.moe.experts:TEGroupedMLP.__init__", wrap_grouped_mlp_init,
             expect="(self, num_local_experts, config, submodules, pg_collection=None, name=None)",
             megatron=">=0.18", name="fused SwiGLU: unfused plain-SiLU gated grouped experts take the fused path"),
    ]
