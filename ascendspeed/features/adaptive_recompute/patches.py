"""Where adaptive recompute hooks into megatron-core: the training schedules (one call per step, in the
pretraining entry and in Megatron-LM alike), ``get_megatron_optimizer`` (whose optimizer state the memory
account needs); ``norm_recompute`` has megatron-core's norm recompute under the activation account."""
from __future__ import annotations

import functools

from ascendspeed.features.adaptive_recompute import norm_recompute
from ascendspeed.features.adaptive_recompute.controller import AdaptiveRecompute
from ascendspeed.features.schedule_signatures import NO_PIPELINING_0_15, SCHEDULE, SCHEDULE_0_15
from ascendspeed.patching import EXISTS, Patch, wrap


def wrap_schedule(controller: AdaptiveRecompute, name: str):
    """A training call of schedule ``name`` runs under the controller (profiling, planning, measuring)."""

    def factory(original):
        @functools.wraps(original)
        def schedule(*args, **kwargs):
            model = kwargs.get("model")
            if model is None or kwargs.get("forward_only", False):
                return original(*args, **kwargs)
            chunks = model if isinstance(model, list) else [model]
            return controller.run(name, lambda: original(*args, **kwargs), chunks, kwargs["num_microbatches"])

        return schedule

    return factory


def wrap_get_megatron_optimizer(controller: AdaptiveRecompute):
    """Remember the optimizer: its state belongs to the static memory the plan must leave room for."""

    def factory(original):
        @functools.wraps(original)
        def get_megatron_optimizer(*args, **kwargs):
            optimizer = original(*args, **kwargs)
            controller.remember_optimizer(optimizer)
            return optimizer

        return get_megatron_optimizer

    return factory


def patches(controller: AdaptiveRecompute) -> list[Patch]:
    no_pipelining = wrap_schedule(controller, "forward_backward_no_pipelining")
    one_f_one_b = wrap_schedule(controller, "forward_backward_pipelining_without_interleaving")
    interleaved = wrap_schedule(controller, "forward_backward_pipelining_with_interleaving")
    return [
        wrap("megatron.core.optimizer:get_megatron_optimizer", wrap_get_megatron_optimizer(controller),
             expect=EXISTS, name="adaptive recompute: wrap get_megatron_optimizer, remember the optimizer"),
        wrap("megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining", no_pipelining,
             expect=SCHEDULE, megatron=">=0.16", name="adaptive recompute: no pipeline schedule"),
        wrap("megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining", no_pipelining,
             expect=NO_PIPELINING_0_15, megatron="<0.16", name="adaptive recompute: no pipeline schedule"),
        wrap("megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_without_interleaving",
             one_f_one_b, expect=SCHEDULE, megatron=">=0.16", name="adaptive recompute: 1F1B schedule"),
        wrap("megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_without_interleaving",
             one_f_one_b, expect=SCHEDULE_0_15, megatron="<0.16", name="adaptive recompute: 1F1B schedule"),
        wrap("megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_with_interleaving",
             interleaved, expect=SCHEDULE, megatron=">=0.16", name="adaptive recompute: interleaved schedule"),
        wrap("megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_with_interleaving",
             interleaved, expect=SCHEDULE_0_15, megatron="<0.16", name="adaptive recompute: interleaved schedule"),
    ] + norm_recompute.patches()
