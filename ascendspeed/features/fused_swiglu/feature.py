"""``--use-fused-swiglu``: its flag, its validation and the two patches that switch megatron-core's SwiGLU."""
from __future__ import annotations

import argparse

from ascendspeed.features.base import Feature, FeatureArgumentError
from ascendspeed.patching import replace, wrap

# Bound by name in mlp.py (``from ...fused_bias_swiglu import bias_swiglu_impl``); the patch manager
# also swaps the other copies of the original (its defining module, the MoE shared experts).
BIAS_SWIGLU_IMPL = "megatron.core.transformer.mlp:bias_swiglu_impl"
MLP_FORWARD = "megatron.core.transformer.mlp:MLP.forward"

SIGNATURES = {
    "bias_swiglu_impl": "(input, bias, fp8_input_store=False, cpu_offload_input=False)",
    "mlp_forward": "(self, hidden_states, per_token_scale=None, **kwargs)",
}

#: Settings the fused operator cannot honour: (dest, Megatron-LM flag or setting name, default, why).
#: Megatron-LM has no flag for activation_func_fp8_input_store; it is refused where a caller sets it.
_UNSUPPORTED = (
    ("activation_func_fp8_input_store", "activation_func_fp8_input_store", False,
     "the fused operator saves its input for backward in the activation dtype, not in fp8"),
    ("use_te_activation_func", "--use-te-activation-func", False,
     "Transformer Engine's activation would replace the fused operator"),
    ("activation_func_clamp_value", "--activation-func-clamp-value", None,
     "the fused operator has no clamped SwiGLU"),
    ("glu_linear_offset", "--glu-linear-offset", 0.0, "the fused operator has no linear offset"),
)


class FusedSwigluFeature(Feature):
    name = "fused_swiglu"
    megatron_arguments = {"swiglu": False, **{dest: default for dest, _, default, _ in _UNSUPPORTED}}

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("ascendspeed fused SwiGLU")
        group.add_argument(
            "--use-fused-swiglu", action="store_true",
            help="With --swiglu, compute the MLP's SwiGLU with ascendspeed's fused operator (one pass forward, "
            "one backward, only the input saved) on both of megatron-core's paths, with or without "
            "--no-bias-swiglu-fusion.",
        )

    def is_enabled(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, "use_fused_swiglu", False))

    def validate(self, args: argparse.Namespace) -> None:
        if not self.is_enabled(args):
            return
        if not getattr(args, "swiglu", False):
            raise FeatureArgumentError(
                "--use-fused-swiglu needs --swiglu: it replaces the SwiGLU activation of gated MLPs, and without "
                "--swiglu the MLP has none. Add --swiglu or drop --use-fused-swiglu."
            )
        for dest, flag, default, why in _UNSUPPORTED:
            value = getattr(args, dest, default)
            if value != default:
                raise FeatureArgumentError(f"--use-fused-swiglu cannot run with {flag} {value}: {why}")

    def patches(self, args: argparse.Namespace):
        from ascendspeed.features.fused_swiglu import mlp  # loads the C++ operator only when enabled

        return [
            replace(BIAS_SWIGLU_IMPL, mlp.fused_bias_swiglu_impl, expect=SIGNATURES["bias_swiglu_impl"],
                    name="fused SwiGLU on the bias-activation-fusion path"),
            wrap(MLP_FORWARD, mlp.wrap_mlp_forward, expect=SIGNATURES["mlp_forward"],
                 name="fused SwiGLU on the unfused gated path"),
        ]
