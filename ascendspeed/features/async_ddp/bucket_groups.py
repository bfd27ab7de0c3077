"""Patches on megatron-core's ``_ParamAndGradBucketGroup``: dispatch from the hooks, exactly once.

A group dispatches its collective once every expected gradient arrived (``register_grad_ready``), at
most once per step (``start_grad_sync``; the hooks and the schedule may both ask); ``finish_grad_sync``
dispatches groups backward never completed (unused parameters), waits, and reduces gradients that
arrived after dispatch with an extra collective, so the result is always exact.

megatron-core 0.16 added ``force_all_reduce`` to these methods; on 0.15 they take none. The functions
here take ``force_all_reduce=None`` ("not given") and pass it on only when given, so one implementation
serves both; the patches name each release range's signature.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from ascendspeed.features.async_ddp.state import AsyncDDPSettings, OverlapState, overlap_state
from ascendspeed.features.async_ddp.telemetry import Telemetry
from ascendspeed.patching import Patch, replace, wrap


def _works_of(handle):
    """The ``Work`` objects behind a grad-reduce handle (a coalescing manager or a single work)."""
    if handle is None:
        return []
    works = getattr(handle, "works", None)
    if works is not None:
        return [work for work in works if hasattr(work, "get_future")]
    return [handle] if hasattr(handle, "get_future") else []


def _grad_offset(bucket, param) -> int:
    """Where ``param``'s gradient starts inside ``bucket.grad_data`` (padding included). A parameter that
    accumulates in a separate higher-precision ``main_grad`` (megatron-core 0.17+) has its slot of the
    communication buffer in ``main_grad_copy_in_grad_buffer``."""
    in_buffer = getattr(param, "main_grad_copy_in_grad_buffer", None)
    slot = param.main_grad if in_buffer is None else in_buffer
    return slot.storage_offset() - bucket.grad_data.storage_offset()


def _forwarded(force_all_reduce: Optional[bool]) -> dict:
    """``force_all_reduce`` as a keyword for megatron-core's methods, only when the caller gave one."""
    return {} if force_all_reduce is None else {"force_all_reduce": force_all_reduce}


def register_grad_ready(self, param: torch.nn.Parameter, force_all_reduce: Optional[bool] = None):
    """Count ``param``'s gradient; dispatch the group's collective once all expected ones arrived."""
    assert self.ddp_config.overlap_grad_reduce, "register_grad_ready() needs overlap_grad_reduce"
    if not self.is_last_microbatch:
        return
    assert param in self.param_to_bucket, "Param is not in the bucket group"
    state = overlap_state(self)
    if state.mark_ready(param) and not state.dispatched:
        self.start_grad_sync(**_forwarded(force_all_reduce))


def wrap_start_grad_sync(settings: AsyncDDPSettings):
    """Dispatch at most once per step (hooks and the schedule may both ask), and time the collective."""
    telemetry = settings.telemetry

    def factory(original):
        @functools.wraps(original)
        def start_grad_sync(self, force_all_reduce: Optional[bool] = None):
            state = overlap_state(self)
            if state.dispatched:
                return
            state.dispatched = True
            if telemetry is None:
                return original(self, **_forwarded(force_all_reduce))
            start = telemetry.now()
            result = original(self, **_forwarded(force_all_reduce))
            state.telemetry_token = telemetry.on_dispatch(
                state.label, state.numel, state.last_ready, start, _works_of(self.grad_reduce_handle)
            )
            return result

        return start_grad_sync

    return factory


@dataclasses.dataclass(frozen=True)
class BucketGroupRelease:
    """What megatron-core's bucket group does around the collective, by release.

    ``copies_back_extra_main_grads`` (0.17+): parameters accumulating in a separate higher-precision
    ``main_grad`` get the reduced values copied back from the communication buffer after the wait.
    ``tracks_finished`` (0.18+): ``grad_reduce_finished`` makes ``finish_grad_sync`` idempotent within a step
    (a successor group may finish its predecessor early); ``reset`` clears it.
    """

    copies_back_extra_main_grads: bool
    tracks_finished: bool


def make_finish_grad_sync(settings: AsyncDDPSettings, release: BucketGroupRelease):
    telemetry = settings.telemetry

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = None):
        """Wait for the group's collective; dispatch it first if backward never completed the group."""
        self.param_gather_dispatched = False
        if release.tracks_finished and self.ddp_config.overlap_grad_reduce and self.grad_reduce_finished:
            return
        if telemetry is not None:
            telemetry.on_compute_end()
        state = overlap_state(self)
        if not self.ddp_config.overlap_grad_reduce:
            self.start_grad_sync(**_forwarded(force_all_reduce))
            if release.copies_back_extra_main_grads:
                self._copy_back_extra_main_grads()
            state.end_step(learn=False)
            return
        if not state.dispatched:
            self.start_grad_sync(**_forwarded(force_all_reduce))
        if self.grad_reduce_handle is not None:
            self.grad_reduce_handle.wait()
            self.grad_reduce_handle = None
        if telemetry is not None:
            telemetry.on_waited(state.telemetry_token)
        if state.late_grads:
            _reduce_late_gradients(self, state, force_all_reduce, telemetry)
        if release.copies_back_extra_main_grads:
            self._copy_back_extra_main_grads()
        if release.tracks_finished:
            self.grad_reduce_finished = True
        state.end_step(learn=True)

    return finish_grad_sync


def make_reset(release: BucketGroupRelease):
    def reset(self):
        """Prepare the group for the next step (an unfinished collective is completed first). megatron-core
        0.15 calls this from the constructor, before the group has a ``grad_reduce_handle``."""
        if getattr(self, "grad_reduce_handle", None) is not None:
            self.grad_reduce_handle.wait()
            self.grad_reduce_handle = None
        overlap_state(self).begin_step()
        self.per_param_grad_ready_counts = {}
        self.is_last_microbatch = True
        if release.tracks_finished:
            self.grad_reduce_finished = False

    return reset


def _reduce_late_gradients(group, state: OverlapState, force_all_reduce, telemetry: Optional[Telemetry]):
    """Reduce the gradients that arrived after dispatch with the same collective, then add them in."""
    distributed = torch.distributed
    use_reduce_scatter = group.ddp_config.use_distributed_optimizer and not force_all_reduce
    if group.ddp_config.use_distributed_optimizer:
        process_group = group.intra_distributed_optimizer_instance_group
        size = group.intra_distributed_optimizer_instance_size
        rank = group.intra_distributed_optimizer_instance_rank
    else:
        process_group = group.data_parallel_group
    op = distributed.ReduceOp.AVG if group.ddp_config.average_in_collective else distributed.ReduceOp.SUM
    for bucket in group.buckets:
        late = [(param, grad) for param, grad in state.late_grads.items() if param in bucket.params]
        if not late:
            continue
        start = telemetry.now() if telemetry is not None else None
        side = torch.zeros_like(bucket.grad_data)
        for param, grad in late:
            offset = _grad_offset(bucket, param)
            side[offset:offset + param.numel()].add_(grad.reshape(-1).to(side.dtype))
        if bucket.gradient_scaling_factor != 1.0:
            side *= bucket.gradient_scaling_factor
        if use_reduce_scatter:
            shard = side.numel() // size
            reduced = torch.empty(shard, dtype=side.dtype, device=side.device)
            distributed.reduce_scatter_tensor(reduced, side, op=op, group=process_group)
            bucket.grad_data[rank * shard:(rank + 1) * shard].add_(reduced)
        else:
            distributed.all_reduce(side, op=op, group=process_group)
            bucket.grad_data.add_(side)
        if telemetry is not None:
            telemetry.on_dispatch(state.label, side.numel(), None, start, [], kind="late")


_RELEASES = {
    "<0.17": BucketGroupRelease(copies_back_extra_main_grads=False, tracks_finished=False),
    ">=0.17,<0.18": BucketGroupRelease(copies_back_extra_main_grads=True, tracks_finished=False),
    ">=0.18": BucketGroupRelease(copies_back_extra_main_grads=True, tracks_finished=True),
}


def patches(settings: AsyncDDPSettings) -> list[Patch]:
    start = wrap_start_grad_sync(settings)
    ready = "async ddp: dispatch once every expected gradient arrived, from iteration 1"
    once = "async ddp: dispatch at most once per step, timed"
    finish = "async ddp: dispatch what backward never completed, wait, reduce late gradients"
    reset = "async ddp: reset the overlap state each step"
    found = [
        replace("megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.register_grad_ready",
                register_grad_ready, expect="(self, param)", megatron="<0.16", name=ready),
        replace("megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.register_grad_ready",
                register_grad_ready, expect="(self, param, force_all_reduce=False)", megatron=">=0.16", name=ready),
        wrap("megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.start_grad_sync",
             start, expect="(self)", megatron="<0.16", name=once),
        wrap("megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.start_grad_sync",
             start, expect="(self, force_all_reduce=False)", megatron=">=0.16", name=once),
        replace("megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.finish_grad_sync",
                make_finish_grad_sync(settings, _RELEASES["<0.17"]), expect="(self)", megatron="<0.16", name=finish),
    ]
    for releases, release in _RELEASES.items():
        lowest = ">=0.16," + releases if releases.startswith("<") else releases
        found += [
            replace("megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.finish_grad_sync",
                    make_finish_grad_sync(settings, release), expect="(self, force_all_reduce=False)",
                    megatron=lowest, name=finish),
            replace("megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.reset",
                    make_reset(release), expect="(self)", megatron=releases, name=reset),
        ]
    return found
