"""Async DDP: data-parallel gradient reduction overlapped with backward, on every device and stage.

Flags: Megatron-LM's ``--overlap-grad-reduce`` (and ``--use-distributed-optimizer``,
``--ddp-bucket-size``) plus ``--no-overlap-grad-reduce-all-stages`` and ``--log-grad-reduce-overlap``.
See ``docs/features/async-ddp.md``.
"""
from ascendspeed.features.async_ddp.feature import AsyncDDPFeature, ddp_config_from_args
from ascendspeed.features.async_ddp.telemetry import TELEMETRY

FEATURE = AsyncDDPFeature()

__all__ = ["FEATURE", "AsyncDDPFeature", "TELEMETRY", "ddp_config_from_args"]
