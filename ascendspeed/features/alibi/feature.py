"""``--position-embedding-type alibi``: its flags, their validation and its settings."""
from __future__ import annotations

import argparse

from ascendspeed.accelerator.te_fallback import serves_local_modules
from ascendspeed.features.alibi import attention
from ascendspeed.features.alibi.attention import AlibiSettings
from ascendspeed.features.base import (
    Feature,
    FeatureArgumentError,
    Unsupported,
    add_choices,
    defaults_of,
    refuse_unsupported,
)
from ascendspeed.features.megatron_flags import FUSED_ATTENTION_BACKENDS, attention_backend_name

UNSUPPORTED = (
    Unsupported("sft", "--sft", False, "packed sequences are not supported yet"),
    Unsupported("apply_query_key_layer_scaling", "--apply-query-key-layer-scaling", False,
                "the layer scaling would scale the bias too"),
    Unsupported("multi_latent_attention", "--multi-latent-attention", False, "multi-latent attention is not supported"),
    Unsupported("use_legacy_models", "--use-legacy-models", False, "legacy models are not supported"),
    Unsupported("rotary_percent", "--rotary-percent", 1.0,
                "it configures rotary embeddings, which ALiBi replaces; drop the flag"),
    Unsupported("rotary_base", "--rotary-base", 10000,
                "it configures rotary embeddings, which ALiBi replaces; drop the flag"),
    Unsupported("rotary_seq_len_interpolation_factor", "--rotary-seq-len-interpolation-factor", None,
                "it configures rotary embeddings, which ALiBi replaces; drop the flag"),
    Unsupported("use_rope_scaling", "--use-rope-scaling", False,
                "it configures rotary embeddings, which ALiBi replaces; drop the flag"),
)
UNSUPPORTED_FUSED = (
    Unsupported("context_parallel_size", "--context-parallel-size", 1,
                "context parallelism runs ALiBi in its own blockwise attention; drop --alibi-fused-attention"),
    Unsupported("reset_attention_mask", "--reset-attention-mask", False,
                "the fused path uses the kernel's causal mask, not document masks; use the local path"),
    Unsupported("window_size", "--window-size", None, "sliding-window attention is not supported by the fused path"),
    Unsupported("softmax_type", "--softmax-type", "vanilla", "only the vanilla softmax is supported by the fused path"),
)


def _fused_by_backend(args: argparse.Namespace) -> bool:
    """Megatron's ``--attention-backend`` ``auto`` (its default), ``flash`` or ``fused`` choose the fused kernel
    wherever it computes what the local path computes: no attention dropout drawn (the kernel draws its own
    mask) and nothing the fused path refuses. ``unfused`` and ``local`` keep the local path."""
    if attention_backend_name(getattr(args, "attention_backend", "auto")) not in FUSED_ATTENTION_BACKENDS:
        return False
    if (getattr(args, "attention_dropout", 0.0) or 0.0) > 0:
        return False
    return all(getattr(args, rule.dest, rule.default) == rule.default for rule in UNSUPPORTED_FUSED)


class AlibiFeature(Feature[AlibiSettings]):
    name = "alibi"
    example_flags = ("--position-embedding-type", "alibi", "--alibi-fused-attention")
    megatron_arguments = {
        "position_embedding_type": "learned_absolute",
        "transformer_impl": "local",
        "attention_backend": "auto",
        **defaults_of(UNSUPPORTED + UNSUPPORTED_FUSED),
    }

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("ascendspeed ALiBi")
        group.add_argument(
            "--alibi-fused-attention", action="store_true",
            help="With --position-embedding-type alibi, compute attention with the fused kernel (ascendspeed's "
            "flash attention generating the bias inside, one fp32 logsumexp per query row saved; "
            "npu_fusion_attention on NPU) instead of Megatron's local attention with the in-place bias operator. "
            "Without the flag, --attention-backend auto (the default), flash or fused choose the fused kernel "
            "where it computes the local path's function (no attention dropout, no document masks, sliding "
            "windows or softmax offsets, no context parallelism); --attention-backend unfused keeps the local path.",
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
        if not serves_local_modules(args):
            # TEDotProductAttention is megatron-core's DotProductAttention where TE is absent (te_fallback).
            raise FeatureArgumentError(
                f"--position-embedding-type alibi cannot run with --transformer-impl {args.transformer_impl} "
                "when Transformer Engine is installed: ALiBi is applied by megatron-core's DotProductAttention, "
                "not TE's attention; use --transformer-impl local"
            )
        refuse_unsupported(args, UNSUPPORTED, "--position-embedding-type alibi")
        if fused:
            refuse_unsupported(args, UNSUPPORTED_FUSED, "--position-embedding-type alibi --alibi-fused-attention")

    def settings(self, args: argparse.Namespace) -> AlibiSettings:
        return AlibiSettings(fused=bool(getattr(args, "alibi_fused_attention", False)),
                             fused_where_exact=_fused_by_backend(args))

    def configure_transformer_config(self, config, settings: AlibiSettings) -> None:
        attention.mark_config(config, settings)

    def patches(self, settings: AlibiSettings, state=None):
        return attention.patches(settings)
