"""Context parallelism on every device: ring attention, Ulysses, and both at once (hybrid).

The attention algorithms work on [batch, heads, local sequence, head dim] tensors of the ranks of a
context-parallel group, whose tokens follow the balanced layout of ``layout.py``:

* ``ring.ring_attention``: key/value blocks travel around the ring, merged by log-sum-exp;
* ``ulysses.ulysses_attention``: all-to-all to a head split around any core attention;
* ``hybrid.hybrid_attention``: Ulysses inside groups of ``--ulysses-degree-in-cp`` ranks, ring across them.

See ``docs/features/context-parallel.md``.
"""
from ascendspeed.features.context_parallel.feature import ContextParallelFeature
from ascendspeed.features.context_parallel.hybrid import HybridGroups, build_hybrid_groups, hybrid_attention
from ascendspeed.features.context_parallel.ring import ring_attention
from ascendspeed.features.context_parallel.telemetry import RingOverlap, RingTelemetry
from ascendspeed.features.context_parallel.settings import ContextParallelSettings
from ascendspeed.features.context_parallel.ulysses import local_core_attention, ulysses_attention

FEATURE = ContextParallelFeature()

__all__ = [
    "FEATURE",
    "ContextParallelFeature",
    "ContextParallelSettings",
    "HybridGroups",
    "RingOverlap",
    "RingTelemetry",
    "build_hybrid_groups",
    "hybrid_attention",
    "local_core_attention",
    "ring_attention",
    "ulysses_attention",
]
