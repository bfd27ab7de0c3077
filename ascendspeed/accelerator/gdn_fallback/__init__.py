"""megatron-core's gated delta net layers without ``fla`` (feature ``accelerator.gdn_fallback``).

megatron-core's ``GatedDeltaNet`` (``G`` in a hybrid layer pattern: Qwen3-Next-style models) takes its causal
convolution, L2 norm and chunked gated delta rule from ``fla`` (flash-linear-attention, triton kernels). Where
it does not import, the names are None and ``GatedDeltaNet.__init__`` raises "FLA is not installed". The
fallback puts torch functions with ``fla``'s contracts there (``kernels.py``): the convolution of
``mamba_fallback.ssd``, a torch L2 norm, and megatron-core's own torch chunked gated delta rule (the one its
deterministic mode runs), called once per packed sequence. megatron-core 0.18 and newer (its torch rule and
the layer's call of it); before, ``G`` layers stay refused in ``validate_args`` where ``fla`` is absent.
"""
from __future__ import annotations

from ascendspeed.accelerator.optional_packages import importable

FEATURE = "accelerator.gdn_fallback"


def needed() -> bool:
    """The fallback is installed where ``fla`` does not import."""
    return not importable("fla.ops.gated_delta_rule")


def patches():
    from ascendspeed.accelerator.gdn_fallback import kernels

    return kernels.patches()
