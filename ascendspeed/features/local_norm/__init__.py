"""Local norms: megatron-core's local layer spec with ``--sequence-parallel`` on every device, and
``--use-fused-rmsnorm`` (with ``--normalization RMSNorm``) on ``ascendspeed.ops.rms_norm``.

``norm.py`` holds the norm module and its patch on ``WrappedTorchNorm``; ``feature.py`` the flags. The
feature is on whenever ``--sequence-parallel`` or ``--apply-layernorm-1p`` (zero-centred gamma) runs with
``--transformer-impl local`` (or ``transformer_engine`` where TE is absent: ``accelerator.te_fallback`` builds
these norms for ``TENorm``), or the fused RMSNorm is asked for. See ``docs/features/rms_norm.md`` and ``docs/features/sequence-parallel.md``.
"""
from ascendspeed.features.local_norm.feature import LocalNormFeature
from ascendspeed.features.local_norm.norm import LocalNorm, LocalNormSettings

FEATURE = LocalNormFeature()

__all__ = ["FEATURE", "LocalNorm", "LocalNormFeature", "LocalNormSettings"]
