"""Mixture of experts: ``--num-experts N`` (megatron-core's MoE layers) on every device ascendspeed runs on.

megatron-core's expert MLPs (``SequentialMLP`` on the local spec) take the routing probabilities as a
per-token scale of the activation. With a bias on the expert linears (Megatron's default) or an activation
without a weighted fused kernel (gelu, Megatron's default), ``MLP.forward`` cannot take that scale: it raises
"Only support fusion of swiglu and quick_gelu with per_token_scale" with the bias-activation fusion, and adds
the scaled output bias in place on a view without it. ``mlp.py`` computes those experts' scale after the MLP
(the MLP is linear after its activation, so the result is the same), and leaves every other MLP to Megatron.

What the CPU cannot run (grouped GEMM, the flex dispatcher) is refused before Megatron-LM validates its
arguments (the TE fallback, ``ascendspeed.accelerator.cpu_megatron_lm``); ``--moe-permute-fusion`` is the
``moe_permute_fusion`` feature's; the gloo shape of the alltoall
dispatcher's split sizes is a CPU shim (``ascendspeed.accelerator.cpu_megatron_core``). megatron-core users
call ``ascendspeed.features.enable_features(num_experts=N)``. See ``docs/features/moe.md``.
"""
from ascendspeed.features.moe.feature import MoeFeature

FEATURE = MoeFeature()

__all__ = ["FEATURE", "MoeFeature"]
