"""Adaptive recompute under a memory budget: ``--adaptive-recompute-device-size MB`` measures each layer's
activations and recompute cost during the first steps, then gives each layer no, selective or full recompute,
the cheapest plan that fits, through megatron-core's own recompute; ``--memory-fragmentation`` sets the
caching allocator's expandable segments on CUDA and NPU. See ``docs/features/adaptive-recompute.md``.
"""
from ascendspeed.features.adaptive_recompute.feature import AdaptiveRecomputeFeature

FEATURE = AdaptiveRecomputeFeature()

__all__ = ["FEATURE", "AdaptiveRecomputeFeature"]
