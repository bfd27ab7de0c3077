"""Expert MLPs scaled by their routing probabilities after the MLP, where megatron-core cannot scale them.

megatron-core's ``MLP.forward(hidden_states, per_token_scale)`` (the experts of ``SequentialMLP``) multiplies
the activation by ``per_token_scale`` before ``linear_fc2`` and adds ``fc2``'s bias times the scale to the
output. Two of its paths fail:

* with ``bias_activation_fusion`` and an activation that has no weighted fused kernel (gelu, Megatron's
  default; only gated SiLU and gated quick-gelu have one), it raises "Only support fusion of swiglu and
  quick_gelu with per_token_scale in MLP"; the weighted SwiGLU kernel refuses a bias;
* with a bias it adds ``output_bias * scale`` in place to ``linear_fc2``'s output, which on the local spec
  is the view an autograd function returned ("Output 0 of _ReduceFromModelParallelRegion is a view and is
  being modified inplace").

``linear_fc2`` (and its tensor-parallel reduction) is linear, so ``fc2(act(x) * p) + b * p`` equals
``(fc2(act(x)) + b) * p``: the wrap runs Megatron's own forward without the scale (every activation and
fusion path works there) and scales its output and bias after. MLPs Megatron handles itself (no scale, or a
weighted fused kernel and no bias) run unchanged.
"""
from __future__ import annotations

import functools

import torch.nn.functional as F

from ascendspeed.patching import Patch, wrap


def _weighted_kernel_exists(config, activation_func) -> bool:
    """Whether megatron-core's bias-activation fusion has a per-token-scaled kernel for this MLP."""
    from megatron.core.transformer import mlp as megatron_mlp

    quick_gelu = getattr(megatron_mlp, "quick_gelu", None)
    return bool(config.gated_linear_unit) and (
        activation_func is F.silu or (quick_gelu is not None and activation_func is quick_gelu)
    )


def scaled_after(mlp) -> bool:
    """Whether ``mlp`` (called with a per-token scale) takes the scale after its second linear."""
    config = mlp.config
    if config.add_bias_linear:
        return True
    fused = config.bias_activation_fusion and not getattr(config, "use_te_activation_func", False)
    return fused and not _weighted_kernel_exists(config, mlp.activation_func)


def _scale(output, output_bias, per_token_scale):
    """``(output + output_bias) * per_token_scale`` per token, in the output's dtype, as megatron-core casts."""
    if output_bias is not None:
        output = output + output_bias
    return (output * per_token_scale.unsqueeze(-1)).to(output.dtype), None


def wrap_mlp_forward_v015(original):
    """megatron-core 0.15: ``forward(self, hidden_states, per_token_scale=None)``."""

    @functools.wraps(original)
    def forward(self, hidden_states, per_token_scale=None):
        if per_token_scale is None or not scaled_after(self):
            return original(self, hidden_states, per_token_scale)
        return _scale(*original(self, hidden_states, None), per_token_scale)

    return forward


def wrap_mlp_forward(original):
    """megatron-core 0.16+: ``forward(self, hidden_states, per_token_scale=None, **kwargs)``."""

    @functools.wraps(original)
    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is None or not scaled_after(self):
            return original(self, hidden_states, per_token_scale, **kwargs)
        return _scale(*original(self, hidden_states, None, **kwargs), per_token_scale)

    return forward


def patches() -> list[Patch]:
    name = "moe: experts with a bias or gelu scale by their routing probabilities after fc2 (wrap)"
    return [
        wrap("megatron.core.transformer.mlp:MLP.forward", wrap_mlp_forward_v015,
             expect="(self, hidden_states, per_token_scale=None)", megatron="<0.16", name=name),
        wrap("megatron.core.transformer.mlp:MLP.forward", wrap_mlp_forward,
             expect="(self, hidden_states, per_token_scale=None, **kwargs)", megatron=">=0.16", name=name),
    ]
