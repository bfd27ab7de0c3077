"""Hybrid-model layer patterns (``--hybrid-layer-pattern``, ``--hybrid-override-pattern``) checked before
Megatron-LM validates them: layers whose megatron-core module needs a CUDA-only package that is not installed
are refused here, naming the layer's symbol and the package, instead of failing while the model is built.

Attention (``*``), MLP (``-``) and MoE (``E``) layers are megatron-core's own modules (with Transformer Engine's
classes served by ``accelerator.te_fallback`` where TE is absent) and run on every device; the hybrid specs build
MoE layers as grouped experts (``TEGroupedMLP``), whose own refusals (the bias-dropout fusion with biased
linears, a bias-gelu fusion) are made here, naming the flags. Mamba (``M``) mixers call ``mamba_ssm``'s and
``causal_conv1d``'s CUDA/triton kernels, served by ``accelerator.mamba_fallback`` where those are absent; gated
delta net (``G``) layers call ``fla`` (flash-linear-attention) triton kernels, served by
``accelerator.gdn_fallback`` from megatron-core 0.18 (refused before, where ``fla`` is absent).
"""
from __future__ import annotations

import importlib.util

from ascendspeed.accelerator.te_fallback.validation import check_grouped_expert_settings
from ascendspeed.features.base import FeatureArgumentError
from ascendspeed.patching.patch import installed_version
from ascendspeed.patching.versions import release

#: Pattern symbol -> (layer, the packages its megatron-core module needs, the first megatron-core release on which
#: ascendspeed serves it without them).
NEEDS_PACKAGES = {
    "G": ("gated delta net", ("fla",), "0.18.0"),
}
#: Megatron-LM's flags that hold a hybrid layer pattern (argument name -> flag); a release lacking one skips it.
PATTERN_FLAGS = {
    "hybrid_layer_pattern": "--hybrid-layer-pattern",
    "hybrid_override_pattern": "--hybrid-override-pattern",
    "mtp_hybrid_override_pattern": "--mtp-hybrid-override-pattern",
}


def _missing(packages) -> list[str]:
    return [package for package in packages if importlib.util.find_spec(package) is None]


def check_hybrid_pattern(args) -> None:
    """``FeatureArgumentError`` for the first layer symbol of a pattern whose packages are not installed."""
    for dest, flag in PATTERN_FLAGS.items():
        pattern = getattr(args, dest, None)
        if not pattern:
            continue
        for symbol, (layer, packages, served_from) in NEEDS_PACKAGES.items():
            missing = _missing(packages) if symbol in pattern else []
            if missing and release(installed_version()) < release(served_from):
                raise FeatureArgumentError(
                    f"{flag} {pattern!r} has {layer} layers ({symbol}), whose megatron-core module needs "
                    f"{' and '.join(packages)} (CUDA/triton kernels); not installed: {', '.join(missing)}. "
                    f"Use megatron-core >= {served_from} (ascendspeed serves them without), other layers, or "
                    "install those packages on a CUDA machine"
                )
        if "E" in pattern:
            check_grouped_expert_settings(args, f"{flag} {pattern!r} has MoE layers (E), which megatron-core's "
                                                "hybrid specs build as grouped experts")
