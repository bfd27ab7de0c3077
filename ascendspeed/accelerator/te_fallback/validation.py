"""The flags that need Transformer Engine itself: refused where TE is absent, before Megatron-LM validates."""
from __future__ import annotations

from ascendspeed.features.base import FeatureArgumentError, Unsupported, refuse_unsupported

_NO_TE = "it needs Transformer Engine, which is not installed (ascendspeed serves TE's layer classes with " \
         "megatron-core's local modules, which have no such mode)"

#: Megatron-LM flags with no local equivalent, by argument name (a flag this Megatron-LM lacks is skipped).
TE_ONLY = (
    Unsupported("fp8", "--fp8-format", None, f"fp8 training runs on TE's fp8 GEMMs; {_NO_TE}: drop the flag"),
    Unsupported("fp8_param_gather", "--fp8-param-gather", False, f"{_NO_TE}: drop the flag"),
    Unsupported("fp4", "--fp4-format", None, f"fp4 training runs on TE's fp4 GEMMs; {_NO_TE}: drop the flag"),
    Unsupported("fp4_param_gather", "--fp4-param-gather", False, f"{_NO_TE}: drop the flag"),
    Unsupported("tp_comm_overlap", "--tp-comm-overlap", False,
                f"the overlap runs in TE's userbuffers (CUDA); {_NO_TE}: drop the flag"),
    Unsupported("cuda_graph_impl", "--cuda-graph-impl", "none",
                f"CUDA graphs capture CUDA kernels; {_NO_TE}: drop the flag"),
    Unsupported("enable_cuda_graph", "--enable-cuda-graph", False,
                f"CUDA graphs capture CUDA kernels; {_NO_TE}: drop the flag"),
    Unsupported("external_cuda_graph", "--external-cuda-graph", False,
                f"CUDA graphs capture CUDA kernels; {_NO_TE}: drop the flag"),
    Unsupported("use_te_activation_func", "--use-te-activation-func", False, f"{_NO_TE}: drop the flag"),
    Unsupported("use_transformer_engine_op_fuser", "--use-transformer-engine-op-fuser", False,
                f"{_NO_TE}: drop the flag"),
    Unsupported("delay_wgrad_compute", "--delay-wgrad-compute", False, f"{_NO_TE}: drop the flag"),
    Unsupported("fused_residual_rmsnorm", "--fused-residual-rmsnorm", False,
                f"the fused residual RMSNorm is a TE kernel; {_NO_TE}: drop the flag"),
    Unsupported("moe_use_legacy_grouped_gemm", "--moe-use-legacy-grouped-gemm", False,
                "the legacy GroupedMLP runs the grouped_gemm package's CUDA kernels: drop the flag "
                "(--moe-grouped-gemm runs ascendspeed's grouped linears in TE's place)"),
)


def check_arguments(args) -> None:
    """``FeatureArgumentError`` naming the first flag that needs TE (used where TE is absent)."""
    if getattr(args, "transformer_impl", "local") == "inference_optimized":
        raise FeatureArgumentError(
            f"--transformer-impl inference_optimized cannot run: {_NO_TE}; use --transformer-impl transformer_engine "
            "or local"
        )
    refuse_unsupported(args, TE_ONLY, "Megatron without Transformer Engine")
    check_grouped_experts(args)


def check_grouped_experts(args) -> None:
    """``--moe-grouped-gemm`` builds megatron-core's ``TEGroupedMLP`` on TE's grouped linears, which ascendspeed
    serves; of Megatron-LM's built-in specs only the transformer_engine one picks it (a ``--spec`` decides for
    itself)."""
    if not getattr(args, "moe_grouped_gemm", False):
        return
    if getattr(args, "transformer_impl", "local") == "local" and not getattr(args, "spec", None):
        raise FeatureArgumentError(
            "--moe-grouped-gemm with --transformer-impl local would not run grouped experts: megatron-core's "
            "local spec builds SequentialMLP (from 0.17) or the legacy GroupedMLP on the grouped_gemm package's "
            "CUDA kernels (before). Grouped experts are built by the transformer_engine spec, where ascendspeed's "
            "grouped linears take the place of TE's: pass --transformer-impl transformer_engine"
        )
    check_grouped_expert_settings(args, "--moe-grouped-gemm")


def check_grouped_expert_settings(args, what: str) -> None:
    """What megatron-core's ``TEGroupedMLP`` refuses while it builds or runs (on every device), refused here
    naming the flags: the bias-dropout fusion with biased linears, and a bias-activation fusion other than
    SwiGLU's or quick-GeGLU's."""
    if getattr(args, "add_bias_linear", False) and getattr(args, "bias_dropout_fusion", False):
        raise FeatureArgumentError(
            f"{what}: grouped experts (megatron-core's TEGroupedMLP) with biased linear layers cannot use the "
            "bias-dropout fusion: pass --no-bias-dropout-fusion, or --disable-bias-linear"
        )
    gated = getattr(args, "swiglu", False) or getattr(args, "quick_geglu", False)
    # without biases Megatron-LM's validate_args (after this check) turns the bias-activation fusion off
    biased = getattr(args, "add_bias_linear", False)
    if not gated and biased and getattr(args, "bias_gelu_fusion", False):
        raise FeatureArgumentError(
            f"{what}: grouped experts (megatron-core's TEGroupedMLP) fuse the bias into SwiGLU or quick-GeGLU "
            "only: pass --no-bias-gelu-fusion (or --swiglu)"
        )
