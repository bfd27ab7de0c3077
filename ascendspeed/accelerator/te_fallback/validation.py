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
    Unsupported("te_rng_tracker", "--te-rng-tracker", False, f"{_NO_TE}: drop the flag"),
    Unsupported("use_te_activation_func", "--use-te-activation-func", False, f"{_NO_TE}: drop the flag"),
    Unsupported("use_transformer_engine_op_fuser", "--use-transformer-engine-op-fuser", False,
                f"{_NO_TE}: drop the flag"),
    Unsupported("delay_wgrad_compute", "--delay-wgrad-compute", False, f"{_NO_TE}: drop the flag"),
    Unsupported("fused_residual_rmsnorm", "--fused-residual-rmsnorm", False,
                f"the fused residual RMSNorm is a TE kernel; {_NO_TE}: drop the flag"),
    Unsupported("moe_grouped_gemm", "--moe-grouped-gemm", False,
                f"grouped-GEMM experts are TE's grouped linears; {_NO_TE}: drop the flag (experts then run "
                "one after another)"),
)


def check_arguments(args) -> None:
    """``FeatureArgumentError`` naming the first flag that needs TE (used where TE is absent)."""
    if getattr(args, "transformer_impl", "local") == "inference_optimized":
        raise FeatureArgumentError(
            f"--transformer-impl inference_optimized cannot run: {_NO_TE}; use --transformer-impl transformer_engine "
            "or local"
        )
    refuse_unsupported(args, TE_ONLY, "Megatron without Transformer Engine")
