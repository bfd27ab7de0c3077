"""The patches of ``--use-fused-swiglu``: megatron-core's SwiGLU on ``ascendspeed.ops.swiglu``.

megatron-core's ``MLP.forward`` computes a SwiGLU one of two ways: with ``bias_activation_fusion`` it
calls ``bias_swiglu_impl`` (bound by name in ``mlp.py``), otherwise an unfused ``glu`` closure local to
``forward``. One replacement covers both: ``bias_swiglu_impl`` becomes the fused operator, and MLPs that
would take the unfused path with a plain SiLU gate are built with ``bias_activation_fusion`` on, in a copy
of their config that only the MLP sees, so they reach that same replacement. Nothing here reads global
arguments; each MLP sees only its own config.
"""
from __future__ import annotations

import copy
import functools

from ascendspeed.features.fused_swiglu.config import runs_plain_gated_silu
from ascendspeed.ops.swiglu import swiglu
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


def wrap_mlp_init(original):
    """Dense MLPs on the unfused plain-SiLU gated path are switched to the fusion path.

    Experts are left alone: they take a per-token scale, and megatron-core's fusion path then calls its
    own weighted kernel, not ``bias_swiglu_impl``.
    """

    @functools.wraps(original)
    def __init__(self, config, submodules, is_expert=False, *args, **kwargs):
        original(self, config, submodules, is_expert, *args, **kwargs)
        if not is_expert and runs_plain_gated_silu(config):
            self.config = copy.copy(config)
            self.config.bias_activation_fusion = True

    return __init__


def patches() -> list[Patch]:
    return [
        replace("megatron.core.transformer.mlp:bias_swiglu_impl", fused_bias_swiglu_impl,
                expect="(input, bias, fp8_input_store=False, cpu_offload_input=False)",
                name="fused SwiGLU: bias_swiglu_impl on the fused operator"),
        wrap("megatron.core.transformer.mlp:MLP.__init__", wrap_mlp_init,
             expect="(self, config, submodules, is_expert=False, input_size=None, ffn_hidden_size=None, "
                    "tp_group=None)",
             megatron="<0.18", name="fused SwiGLU: unfused plain-SiLU gated MLPs take the fused path"),
        wrap("megatron.core.transformer.mlp:MLP.__init__", wrap_mlp_init,
             expect="(self, config, submodules, is_expert=False, input_size=None, ffn_hidden_size=None, "
                    "tp_group=None, name=None)",
             megatron=">=0.18", name="fused SwiGLU: unfused plain-SiLU gated MLPs take the fused path"),
    ]
