"""The settings of async DDP and the per-bucket-group bookkeeping its patches share.

A bucket group keeps an ``OverlapState``: the number of gradients it expects per parameter (one until
observed otherwise, so iteration 1 overlaps too), how many arrived in this step, and whether its
collective was dispatched. The per-parameter expectations are re-learnt every step from what arrived,
which assumes, as megatron-core does, that every data-parallel rank runs the same graph.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

from ascendspeed.features.async_ddp.telemetry import Telemetry

STATE_ATTRIBUTE = "_ascendspeed_overlap"


@dataclasses.dataclass(frozen=True)
class AsyncDDPSettings:
    """What the patches do, fixed when the feature is applied.

    ``all_stages``: every pipeline stage and virtual-pipeline chunk keeps its buckets and launches each
    from the gradient hooks as it fills (megatron-core buckets only the first stage's first chunk).
    ``log_overlap``: time every bucket collective (``--log-grad-reduce-overlap``).
    ``telemetry``: the recorder of the application the patches are bound to (the feature's state, set when
    it binds them; None without ``log_overlap``). Not part of the settings' identity.
    """

    all_stages: bool = True
    log_overlap: bool = False
    telemetry: Optional[Telemetry] = dataclasses.field(default=None, compare=False)


class OverlapState:
    """Per bucket group bookkeeping for one step."""

    def __init__(self, group, label: str, first_iteration_overlap: bool):
        self.label = label
        self.params = tuple(group.params)
        self.numel = sum(bucket.grad_data.numel() for bucket in group.buckets)
        # None: not known yet, dispatch at the end of the step (megatron-core's first-step behaviour).
        self.expected = {param: 1 for param in group.params} if first_iteration_overlap else None
        self.late_grads = {}
        self.begin_step()
        group.is_first_batch = False  # megatron-core's own first-step logic is replaced by this state

    def begin_step(self):
        self.counts = {}
        self.dispatched = False
        self.last_ready = None
        self.late_grads = {}
        self.telemetry_token = None
        self.remaining = None if self.expected is None else sum(1 for n in self.expected.values() if n > 0)

    def mark_ready(self, param) -> bool:
        """Count one gradient of ``param``; True when every expected gradient of the group arrived."""
        count = self.counts.get(param, 0) + 1
        self.counts[param] = count
        self.last_ready = time.perf_counter()
        if self.expected is None:
            return False
        if count == self.expected.get(param, 0):
            self.remaining -= 1
        return self.remaining == 0

    def end_step(self, learn: bool):
        if learn and self.counts:
            self.expected = {param: self.counts.get(param, 0) for param in self.params}
        self.begin_step()


def overlap_state(group) -> OverlapState:
    """The group's state (attached by the DDP constructor patch; created here for groups built before)."""
    state = getattr(group, STATE_ATTRIBUTE, None)
    if state is None:
        state = OverlapState(group, label=f"group{id(group):x}", first_iteration_overlap=False)
        setattr(group, STATE_ATTRIBUTE, state)
    return state


def attach_states(ddp, label: str, first_iteration_overlap: bool) -> None:
    """Give every bucket group of a freshly built DDP its state, labelled ``<label>.b<number>``."""
    groups = ddp.bucket_groups + ddp.expert_parallel_bucket_groups
    for number, group in enumerate(groups):
        setattr(group, STATE_ATTRIBUTE, OverlapState(group, f"{label}.b{number}", first_iteration_overlap))
