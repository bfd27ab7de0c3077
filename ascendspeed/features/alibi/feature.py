"""``--position-embedding-type alibi``: flags, validation and the four patches that apply ALiBi."""
from __future__ import annotations

import argparse

from ascendspeed.features.alibi import attention
from ascendspeed.features.base import Feature, FeatureArgumentError, add_choices
from ascendspeed.patching import wrap

DOT_PRODUCT_ATTENTION = "megatron.core.transformer.dot_product_attention:DotProductAttention"
SOFTMAX = "megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax"
GPT_MODEL = "megatron.core.models.gpt.gpt_model:GPTModel"

_TC = "megatron.core.transformer.transformer_config.TransformerConfig"
_PGC = "Optional[megatron.core.process_groups_config.ProcessGroupCollection]"
_SPEC = "megatron.core.transformer.spec_utils.ModuleSpec"
SIGNATURES = {
    "attention_init": (
        f"(self, config: {_TC}, layer_number: int, attn_mask_type: megatron.core.transformer.enums.AttnMaskType, "
        "attention_type: str, attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None, "
        f"cp_comm_type: Optional[str] = None, pg_collection: {_PGC} = None)"
    ),
    "attention_forward": (
        "(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: "
        "Optional[torch.Tensor], attn_mask_type: Optional[megatron.core.transformer.enums.AttnMaskType] = None, "
        "attention_bias: Optional[torch.Tensor] = None, packed_seq_params: "
        "Optional[megatron.core.packed_seq_params.PackedSeqParams] = None)"
    ),
    "softmax_forward": (
        "(self, input: torch.Tensor, mask: Optional[torch.Tensor], softmax_offset: Optional[torch.Tensor] = None)"
    ),
    "gpt_init": (
        f"(self, config: {_TC}, transformer_layer_spec: {_SPEC}, vocab_size: int, max_sequence_length: int, "
        "pre_process: bool = True, post_process: bool = True, fp16_lm_cross_entropy: bool = False, "
        "parallel_output: bool = True, share_embeddings_and_output_weights: bool = False, "
        "position_embedding_type: Literal['learned_absolute', 'rope', 'mrope', 'yarn', 'none'] = "
        "'learned_absolute', rotary_percent: float = 1.0, rotary_base: int = 10000, rope_scaling: bool = False, "
        "rope_scaling_factor: float = 8.0, scatter_embedding_sequence_parallel: bool = True, "
        f"seq_len_interpolation_factor: Optional[float] = None, mtp_block_spec: Optional[{_SPEC}] = None, "
        f"pg_collection: {_PGC} = None, vp_stage: Optional[int] = None) -> None"
    ),
}

#: Flag values ALiBi cannot run with yet: (dest, flag, default, why).
_UNSUPPORTED = (
    ("transformer_impl", "--transformer-impl", "local",
     "Transformer Engine attention is not supported yet; use --transformer-impl local"),
    ("sft", "--sft", False, "packed sequences are not supported yet"),
    ("apply_query_key_layer_scaling", "--apply-query-key-layer-scaling", False,
     "the layer scaling would scale the bias too"),
    ("multi_latent_attention", "--multi-latent-attention", False, "multi-latent attention is not supported"),
    ("use_legacy_models", "--use-legacy-models", False, "legacy models are not supported"),
)
_UNSUPPORTED_FUSED = (
    ("reset_attention_mask", "--reset-attention-mask", False,
     "the fused path uses the kernel's causal mask, not document masks; use the local path"),
    ("window_size", "--window-size", None, "sliding-window attention is not supported by the fused path"),
    ("softmax_type", "--softmax-type", "vanilla", "only the vanilla softmax is supported by the fused path"),
)


class AlibiFeature(Feature):
    name = "alibi"
    megatron_arguments = {
        "position_embedding_type": "learned_absolute",
        **{dest: default for dest, _, default, _ in _UNSUPPORTED + _UNSUPPORTED_FUSED},
    }

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("ascendspeed ALiBi")
        group.add_argument(
            "--alibi-fused-attention", action="store_true",
            help="With --position-embedding-type alibi, compute attention with the fused kernel (torch's "
            "flash attention with an O(heads * seq) fp32 bias; npu_fusion_attention on NPU) instead of "
            "Megatron's local attention with the in-place bias operator.",
        )

    def extend_megatron_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_choices(parser, "--position-embedding-type", "alibi")

    def is_enabled(self, args: argparse.Namespace) -> bool:
        return getattr(args, "position_embedding_type", None) == "alibi"

    def validate(self, args: argparse.Namespace) -> None:
        fused = bool(getattr(args, "alibi_fused_attention", False))
        if not self.is_enabled(args):
            if fused:
                raise FeatureArgumentError("--alibi-fused-attention needs --position-embedding-type alibi")
            return
        _refuse(args, _UNSUPPORTED, "--position-embedding-type alibi")
        if fused:
            _refuse(args, _UNSUPPORTED_FUSED, "--position-embedding-type alibi --alibi-fused-attention")

    def settings(self, args: argparse.Namespace) -> attention.AlibiSettings:
        return attention.AlibiSettings(fused=bool(getattr(args, "alibi_fused_attention", False)))

    def configure_transformer_config(self, config, args: argparse.Namespace) -> None:
        config.alibi = self.settings(args)

    def patches(self, args: argparse.Namespace):
        sig = SIGNATURES
        return [
            wrap(f"{GPT_MODEL}.__init__", attention.wrap_gpt_model_init(self.settings(args)), expect=sig["gpt_init"]),
            wrap(f"{DOT_PRODUCT_ATTENTION}.__init__", attention.wrap_attention_init, expect=sig["attention_init"]),
            wrap(f"{DOT_PRODUCT_ATTENTION}.forward", attention.wrap_attention_forward,
                 expect=sig["attention_forward"]),
            wrap(f"{SOFTMAX}.forward", attention.wrap_softmax_forward, expect=sig["softmax_forward"]),
        ]


def _refuse(args: argparse.Namespace, unsupported, what: str) -> None:
    for dest, flag, default, why in unsupported:
        value = getattr(args, dest, default)
        if value != default:
            raise FeatureArgumentError(f"{what} cannot run with {flag} {value}: {why}")
