"""Which megatron-core ``TransformerConfig`` settings the fused operator covers.

Shared by the flag validation (``feature.py``) and the patches (``mlp.py``), and free of both: the
feature imports the patches only when it is enabled, since they load the C++ operator.
"""
from __future__ import annotations

import torch.nn.functional as F

from ascendspeed.features.base import Unsupported

#: ``TransformerConfig`` settings (also Megatron-LM flag destinations) the fused operator cannot honour.
#: Megatron-LM has no flag for activation_func_fp8_input_store; it is refused where a caller sets it.
UNSUPPORTED = (
    Unsupported("activation_func_fp8_input_store", "activation_func_fp8_input_store", False,
                "the fused operator saves its input for backward in the activation dtype, not in fp8"),
    Unsupported("use_te_activation_func", "--use-te-activation-func", False,
                "Transformer Engine's activation would replace the fused operator"),
    Unsupported("activation_func_clamp_value", "--activation-func-clamp-value", None,
                "the fused operator has no clamped SwiGLU"),
    Unsupported("glu_linear_offset", "--glu-linear-offset", 0.0, "the fused operator has no linear offset"),
)


def runs_plain_gated_silu(config) -> bool:
    """Whether ``MLP.forward`` takes its unfused gated path with a plain SiLU gate for ``config``: the
    ``glu`` closure computing ``silu(a) * b``, with none of the settings the fused operator refuses."""
    return (
        config.gated_linear_unit
        and config.activation_func is F.silu
        and not config.bias_activation_fusion
        and all(getattr(config, rule.dest) == rule.default for rule in UNSUPPORTED)
    )
