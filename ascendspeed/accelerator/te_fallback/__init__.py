"""Transformer Engine's layer classes without Transformer Engine (feature ``accelerator.te_fallback``).

megatron-core names Transformer Engine classes in its layer specs: ``get_gpt_layer_with_transformer_engine_spec``
(Megatron-LM's default ``--transformer-impl transformer_engine``), the hybrid stack's specs, and
``HybridStack``, which builds a ``TENorm`` for its final norm whatever the spec. Where ``transformer_engine``
does not import (a CPU, an Ascend NPU, a GPU without TE), megatron-core defines those classes on a mocked base
(``te = MagicMock()``) or as raising stubs, so every such spec fails to build.

This fallback, installed by ``ascendspeed.accelerator.install`` on any device where TE is absent, puts stand-ins
in their place (``standins.py``) that build megatron-core's own local modules with TE's constructor and forward
contracts (``modules.py``): ``TENorm`` -> the local norm (``WrappedTorchNorm``, so ascendspeed's sequence-parallel
and fused RMSNorm apply), ``TELinear`` -> a column-/row-parallel or duplicated linear, ``TEColumnParallelLinear`` /
``TERowParallelLinear`` -> ``ColumnParallelLinear`` / ``RowParallelLinear``, ``TELayerNormColumnParallelLinear``
-> a norm followed by ``ColumnParallelLinear`` (parameters named as TE names them: ``layer_norm_weight``,
``layer_norm_bias``), ``TEDotProductAttention`` -> ``DotProductAttention`` with separate key and value head sizes
(so ALiBi, fused RoPE and fused SwiGLU, which patch megatron-core's local classes, apply on these paths too),
``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear`` -> ascendspeed's grouped linears
(``grouped_linear.py``, the ``grouped_linear`` operator), so ``--moe-grouped-gemm`` builds megatron-core's
``TEGroupedMLP``. The T5, BERT and heterogeneous-GPT spec modules, which bind TE's names only where TE imports,
get the stand-ins too.

``rope.py`` serves megatron-core's RoPE fusion (``apply_rope_fusion``) with ascendspeed's rotary operator where
megatron-core would take TE's fused kernels. ``thd.py`` splits a packed batch over the context-parallel ranks
where megatron-core asks TE's extension. ``recompute.py`` keeps megatron-core's ``CheckpointWithoutOutput``
(selective recompute of norms, MoE activations, MLA up projections) off Transformer Engine's fp8 state, which it
asked for even with fp8 off. ``optimizer.py`` lets megatron-core's torch optimizers be made from a config without a
learning rate, as TE's ``FusedAdam`` is. ``router.py`` runs megatron-core's MoE router fusion
(``moe_router_fusion``) on its unfused branch, which computes what TE's fused router kernels compute.

What TE alone provides (fp8/fp4, userbuffers ``--tp-comm-overlap``, CUDA graphs, TE's op fuser and activation
ops, the legacy grouped_gemm experts, delayed weight gradients) is refused in ``validate_args`` (``check_arguments``).
"""
from __future__ import annotations

from ascendspeed.accelerator.optional_packages import importable

FEATURE = "accelerator.te_fallback"


def needed() -> bool:
    """The fallback is installed where Transformer Engine does not import."""
    return not importable("transformer_engine")


def serves_local_modules(args) -> bool:
    """Whether the model of ``args`` is built from megatron-core's local modules: ``--transformer-impl local``,
    or ``transformer_engine`` where TE is absent (this fallback builds the local modules for TE's classes)."""
    impl = getattr(args, "transformer_impl", "local")
    return impl == "local" or (impl == "transformer_engine" and needed())


def patches():
    from ascendspeed.accelerator.te_fallback import optimizer, recompute, rope, router, standins, thd

    return (standins.patches() + recompute.patches() + rope.patches() + thd.patches() + optimizer.patches()
            + router.patches())


def check_arguments(args) -> None:
    """Refuse the flags that need Transformer Engine itself (called before Megatron-LM's ``validate_args``)."""
    from ascendspeed.accelerator.te_fallback import validation

    validation.check_arguments(args)


__all__ = ["FEATURE", "check_arguments", "needed", "patches", "serves_local_modules"]
