"""Around megatron-core's forward-backward schedules: every stage overlaps, and steps are timed."""
from __future__ import annotations

import functools

from ascendspeed.features.async_ddp.state import AsyncDDPSettings
from ascendspeed.features.schedule_signatures import NO_PIPELINING_0_15, SCHEDULE, SCHEDULE_0_15
from ascendspeed.patching import Patch, wrap

def wrap_schedule(settings: AsyncDDPSettings):
    """Around megatron-core's forward-backward schedules: every stage overlaps, and steps are timed.

    With ``all_stages``, ``config.grad_sync_func`` (Megatron-LM's ``align_grad_reduce``) is hidden for
    the duration of the schedule: with it, the schedules run the last backward of stages after the
    first under ``no_sync`` and launch the whole stage afterwards; without it, each stage sends its
    buckets from the hooks as they fill. With telemetry, a training call closes the iteration record
    (the schedule ends with ``finalize_model_grads``, so every collective has completed).
    """
    from megatron.core.utils import get_model_config

    telemetry = settings.telemetry

    def factory(original):
        @functools.wraps(original)
        def schedule(*args, **kwargs):
            model = kwargs.get("model")
            if model is None or kwargs.get("forward_only", False):
                return original(*args, **kwargs)
            config = get_model_config(model[0] if isinstance(model, list) else model)
            saved = getattr(config, "grad_sync_func", None)
            mask = settings.all_stages and saved is not None
            if mask:
                config.grad_sync_func = None
            try:
                result = original(*args, **kwargs)
            finally:
                if mask:
                    config.grad_sync_func = saved
            if telemetry is not None:
                telemetry.end_iteration()
            return result

        return schedule

    return factory


def patches(settings: AsyncDDPSettings) -> list[Patch]:
    schedule = wrap_schedule(settings)
    return [
        wrap("megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining", schedule,
             expect=SCHEDULE, megatron=">=0.16", name="async ddp: no pipeline schedule"),
        wrap("megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining", schedule,
             expect=NO_PIPELINING_0_15, megatron="<0.16", name="async ddp: no pipeline schedule"),
        wrap("megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_without_interleaving",
             schedule, expect=SCHEDULE, megatron=">=0.16", name="async ddp: 1F1B schedule"),
        wrap("megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_without_interleaving",
             schedule, expect=SCHEDULE_0_15, megatron="<0.16", name="async ddp: 1F1B schedule"),
        wrap("megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_with_interleaving",
             schedule, expect=SCHEDULE, megatron=">=0.16", name="async ddp: interleaved schedule"),
        wrap("megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_with_interleaving",
             schedule, expect=SCHEDULE_0_15, megatron="<0.16", name="async ddp: interleaved schedule"),
    ]
