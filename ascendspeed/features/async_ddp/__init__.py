"""Async DDP: data-parallel gradient reduction overlapped with backward, on every device and stage.

Flags: Megatron-LM's ``--overlap-grad-reduce`` (and ``--use-distributed-optimizer``,
``--ddp-bucket-size``) plus ``--no-overlap-grad-reduce-all-stages`` and ``--log-grad-reduce-overlap``.
Modules, by what they patch: ``ddp`` (DistributedDataParallel and its buffers), ``bucket_groups``
(dispatch and completion of each bucket group's collective), ``schedules`` (the forward-backward
schedules), ``gloo`` (reduce-scatter on gloo); ``state`` holds the settings and per-group bookkeeping,
``telemetry`` the timing. See ``docs/features/async-ddp.md``.
"""
from ascendspeed.features.async_ddp.feature import AsyncDDPFeature
from ascendspeed.features.async_ddp.state import AsyncDDPSettings

FEATURE = AsyncDDPFeature()

__all__ = ["FEATURE", "AsyncDDPFeature", "AsyncDDPSettings"]
