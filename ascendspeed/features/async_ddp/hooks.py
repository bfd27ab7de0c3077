"""Grad-buffer hooks that overlap megatron-core's data-parallel gradient reduction with backward.

megatron-core 0.16 already launches a bucket group's all-reduce / reduce-scatter from the parameter
hooks once all its gradients are ready, but

* only on the first pipeline stage and only for the first virtual-pipeline chunk (others get one
  bucket, reduced after backward);
* only from the second iteration: the first one learns how many gradients each parameter receives and
  sends everything at the end; a parameter without a gradient fails an assertion or never sends;
* without any record of what was hidden.

Here a bucket group keeps an ``_OverlapState``: the number of gradients it expects per parameter
(one until observed otherwise, so iteration 1 overlaps too), how many arrived in this step, and whether
its collective was dispatched. A gradient arriving after dispatch (a parameter used more than once per
step, or the first step of an unusual model) is kept aside and reduced by an extra collective in
``finish_grad_sync``, so the result is always exact; later steps wait for it. Groups that are still
waiting when backward ends (unused parameters) are dispatched then. The per-parameter expectations are
re-learnt every step from what arrived, which assumes, as megatron-core does, that every data-parallel
rank runs the same graph.
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import itertools
import time
import warnings
from typing import Optional

import torch

from ascendspeed.features.async_ddp.telemetry import Telemetry

_STATE_ATTRIBUTE = "_ascendspeed_overlap"
_KEEP_BUCKETS = contextvars.ContextVar("ascendspeed_async_ddp_keep_buckets", default=False)
_DDP_COUNTER = itertools.count()
_LATE_WARNED = False


@dataclasses.dataclass(frozen=True)
class OverlapSettings:
    """What the patches do, fixed when the feature is applied."""

    all_stages: bool = True  # keep buckets (and launch from the hooks) on every stage and chunk
    keep_chunk_buckets: bool = True  # also for virtual-pipeline chunks after the first
    telemetry: Optional[Telemetry] = None


class _OverlapState:
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


def overlap_state(group) -> _OverlapState:
    state = getattr(group, _STATE_ATTRIBUTE, None)
    if state is None:
        state = _OverlapState(group, label=f"group{id(group):x}", first_iteration_overlap=False)
        setattr(group, _STATE_ATTRIBUTE, state)
    return state


def _works_of(handle):
    """The ``Work`` objects behind a grad-reduce handle (a coalescing manager or a single work)."""
    if handle is None:
        return []
    works = getattr(handle, "works", None)
    if works is not None:
        return [work for work in works if hasattr(work, "get_future")]
    return [handle] if hasattr(handle, "get_future") else []


def _grad_offset(bucket, param) -> int:
    """Where ``param``'s gradient starts inside ``bucket.grad_data`` (padding included)."""
    return param.main_grad.storage_offset() - bucket.grad_data.storage_offset()


# -- DistributedDataParallel --------------------------------------------------------------------------
def wrap_ddp_init(settings: OverlapSettings):
    """Keep the bucket size on every pipeline stage (and chunk), and attach the overlap state."""

    def factory(original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def __init__(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            config = bound.arguments["config"]
            ddp_config = bound.arguments["ddp_config"]
            keep = settings.all_stages and ddp_config.overlap_grad_reduce
            if keep and settings.keep_chunk_buckets:
                bound.arguments["disable_bucketing"] = False
            keep = keep and not bound.arguments["disable_bucketing"]
            token = _KEEP_BUCKETS.set(keep)
            try:
                original(*bound.args, **bound.kwargs)
            finally:
                _KEEP_BUCKETS.reset(token)
            if keep:
                self.bucket_size = ddp_config.bucket_size
            index = next(_DDP_COUNTER)
            first_iteration = not getattr(config, "gradient_accumulation_fusion", False)
            groups = self.bucket_groups + self.expert_parallel_bucket_groups
            for number, group in enumerate(groups):
                setattr(group, _STATE_ATTRIBUTE, _OverlapState(group, f"ddp{index}.b{number}", first_iteration))
            if settings.telemetry is not None:
                for buffer in self.buffers + self.expert_parallel_buffers:
                    settings.telemetry.use_device(buffer.grad_data.device)

        return __init__

    return factory


def wrap_buffer_init(original):
    """Inside a DDP constructor that keeps buckets, a ``bucket_size`` of None becomes the configured one."""

    @functools.wraps(original)
    def __init__(self, ddp_config, param_dtype, grad_dtype, params, data_parallel_group, bucket_size, *args, **kwargs):
        if bucket_size is None and _KEEP_BUCKETS.get():
            bucket_size = ddp_config.bucket_size
        original(self, ddp_config, param_dtype, grad_dtype, params, data_parallel_group, bucket_size, *args, **kwargs)

    return __init__


def make_backward_post_hook(settings: OverlapSettings):
    """megatron-core's parameter hook, plus: gradients arriving after their bucket was sent go aside."""
    from megatron.core.transformer.cuda_graphs import is_graph_capturing

    telemetry = settings.telemetry

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        def hook(*unused):
            if is_graph_capturing():
                return
            group = self.param_to_bucket_group.get(param)
            if group is None:
                return
            overlap = self.ddp_config.overlap_grad_reduce
            grad = param.grad
            if telemetry is not None and group.is_last_microbatch:
                telemetry.on_gradient()
            if overlap and group.is_last_microbatch:
                state = overlap_state(group)
                if state.dispatched:
                    _keep_late_gradient(state, param, grad)
                    param.grad = None
                    state.counts[param] = state.counts.get(param, 0) + 1
                    return
            if grad is not None and (not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False)):
                param.main_grad.add_(grad.data)
            param.grad = None
            if overlap:
                group.register_grad_ready(param, self.force_all_reduce)

        return hook

    return _make_backward_post_hook


def _keep_late_gradient(state: _OverlapState, param, grad) -> None:
    if getattr(param, "grad_added_to_main_grad", False) and not getattr(param, "zero_out_wgrad", False):
        raise RuntimeError(
            "ascendspeed async DDP: a gradient was accumulated into main_grad (gradient accumulation "
            f"fusion) after the reduction of its bucket {state.label} started; the parameter of shape "
            f"{tuple(param.shape)} receives more gradients per step than in the previous step. Disable "
            "--gradient-accumulation-fusion or keep the number of uses per step constant."
        )
    global _LATE_WARNED
    if not _LATE_WARNED:
        _LATE_WARNED = True
        warnings.warn(
            f"ascendspeed async DDP: a parameter of shape {tuple(param.shape)} received a gradient after "
            f"bucket {state.label} was sent (it is used more often than expected); such gradients are "
            "reduced separately in that step and waited for in later steps (warned once)",
            stacklevel=2,
        )
    if grad is None:
        return
    kept = state.late_grads.get(param)
    if kept is None:
        state.late_grads[param] = grad.detach().clone()
    else:
        kept.add_(grad)


def wrap_zero_grad_buffer(settings: OverlapSettings):
    def factory(original):
        @functools.wraps(original)
        def zero_grad_buffer(self):
            if settings.telemetry is not None:
                settings.telemetry.begin_iteration()
            return original(self)

        return zero_grad_buffer

    return factory


# -- bucket groups ------------------------------------------------------------------------------------
def register_grad_ready(self, param: torch.nn.Parameter, force_all_reduce: Optional[bool] = False):
    """Count ``param``'s gradient; dispatch the group's collective once all expected ones arrived."""
    assert self.ddp_config.overlap_grad_reduce, "register_grad_ready() needs overlap_grad_reduce"
    if not self.is_last_microbatch:
        return
    assert param in self.param_to_bucket, "Param is not in the bucket group"
    state = overlap_state(self)
    if state.mark_ready(param) and not state.dispatched:
        self.start_grad_sync(force_all_reduce=force_all_reduce)


def wrap_start_grad_sync(settings: OverlapSettings):
    """Dispatch at most once per step (hooks and the schedule may both ask), and time the collective."""
    telemetry = settings.telemetry

    def factory(original):
        @functools.wraps(original)
        def start_grad_sync(self, force_all_reduce: Optional[bool] = False):
            state = overlap_state(self)
            if state.dispatched:
                return
            state.dispatched = True
            if telemetry is None:
                return original(self, force_all_reduce=force_all_reduce)
            start = telemetry.now()
            result = original(self, force_all_reduce=force_all_reduce)
            state.telemetry_token = telemetry.on_dispatch(
                state.label, state.numel, state.last_ready, start, _works_of(self.grad_reduce_handle)
            )
            return result

        return start_grad_sync

    return factory


def make_finish_grad_sync(settings: OverlapSettings):
    telemetry = settings.telemetry

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = False):
        """Wait for the group's collective; dispatch it first if backward never completed the group."""
        if telemetry is not None:
            telemetry.on_compute_end()
        state = overlap_state(self)
        self.param_gather_dispatched = False
        if not self.ddp_config.overlap_grad_reduce:
            self.start_grad_sync(force_all_reduce=force_all_reduce)
            state.end_step(learn=False)
            return
        if not state.dispatched:
            self.start_grad_sync(force_all_reduce=force_all_reduce)
        if self.grad_reduce_handle is not None:
            self.grad_reduce_handle.wait()
            self.grad_reduce_handle = None
        if telemetry is not None:
            telemetry.on_waited(state.telemetry_token)
        if state.late_grads:
            _reduce_late_gradients(self, state, force_all_reduce, telemetry)
        state.end_step(learn=True)

    return finish_grad_sync


def make_reset():
    def reset(self):
        """Prepare the group for the next step (an unfinished collective is completed first)."""
        if self.grad_reduce_handle is not None:
            self.grad_reduce_handle.wait()
            self.grad_reduce_handle = None
        overlap_state(self).begin_step()
        self.per_param_grad_ready_counts = {}
        self.is_last_microbatch = True

    return reset


def _reduce_late_gradients(group, state: _OverlapState, force_all_reduce, telemetry: Optional[Telemetry]):
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


# -- gloo -------------------------------------------------------------------------------------------
def wrap_reduce_scatter(original):
    """On gloo, reduce-scatter a bucket by all-reducing it in place.

    gloo implements reduce-scatter as a clone, an all-reduce and a copy, mostly on the calling thread
    and with a ``Work`` that has no future; the in-place all-reduce moves the same bytes, dispatches at
    once, has a future, and leaves the local shard (a view of the bucket) exactly as reduce-scatter would.
    """

    @functools.wraps(original)
    def reduce_scatter(output, input, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        distributed = torch.distributed
        if distributed.get_backend(group) == "gloo" and _is_shard_view(output, input, group):
            return distributed.all_reduce(input, op=op, group=group, async_op=async_op)
        return original(output, input, op=op, group=group, async_op=async_op)

    return reduce_scatter


def _is_shard_view(output, input, group) -> bool:
    """True when ``output`` is this rank's contiguous shard of ``input`` (as in megatron-core's buckets)."""
    if output.untyped_storage().data_ptr() != input.untyped_storage().data_ptr():
        return False
    size = torch.distributed.get_world_size(group)
    rank = torch.distributed.get_rank(group)
    shard = input.numel() // size
    return (
        output.is_contiguous() and input.is_contiguous() and output.numel() == shard
        and output.storage_offset() == input.storage_offset() + rank * shard
    )


# -- pipeline schedules -------------------------------------------------------------------------------
def wrap_schedule(settings: OverlapSettings):
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
