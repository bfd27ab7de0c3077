"""Patches on megatron-core's ``DistributedDataParallel`` and its gradient buffers.

* the constructor keeps gradient buckets on every pipeline stage and virtual-pipeline chunk (megatron-core
  gives stages after the first, and chunks after the first, one bucket reduced after backward) and
  attaches an ``OverlapState`` to each bucket group;
* the parameter hook is megatron-core's, plus: a gradient arriving after its bucket was sent goes aside,
  to be reduced exactly in ``finish_grad_sync`` (``bucket_groups.py``).
"""
from __future__ import annotations

import functools
import inspect
import itertools
import warnings

import torch

from ascendspeed.features.async_ddp.state import AsyncDDPSettings, OverlapState, attach_states, overlap_state
from ascendspeed.patching import Patch, replace, wrap

_DDP_COUNTER = itertools.count()
_LATE_WARNED = False


def _distributed_optimizer_layout(module, ddp_config, pg_collection):
    """megatron-core 0.18+ lays out a distributed optimizer's buffers before building them, from a bucket
    size that is None on pipeline stages after the first: the layout of every stage, bucketed with the
    configured size, computed as ``DistributedDataParallel`` itself would (same parameters, same order)."""
    from megatron.core import parallel_state
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if pg_collection is not None:
        data_parallel_size = pg_collection.intra_dp_cp.size()
        expert_data_parallel_size = pg_collection.intra_expt_dp.size()
    else:
        data_parallel_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True,
                                                                         partial_data_parallel=True)
        expert_data_parallel_size = parallel_state.get_expert_data_parallel_world_size(partial_expert_data_parallel=True)
    bucket_size = ddp_config.bucket_size
    if bucket_size is None:
        bucket_size = max(40_000_000, 1_000_000 * data_parallel_size)
    params = [param for _, param in module.named_parameters() if param.requires_grad]
    return DistributedOptimizer.compute_full_param_layout(
        params, bucket_size, data_parallel_size, ddp_config, expert_data_parallel_world_size=expert_data_parallel_size
    )


def wrap_ddp_init(settings: AsyncDDPSettings, lays_out_before_building: bool = False):
    """Bucket every chunk (``disable_bucketing`` off), remember the bucket size, attach the overlap state.

    ``lays_out_before_building`` (megatron-core 0.18+): with the distributed optimizer the buffers' layout is
    computed before the buffers, so the layout with the configured bucket size is passed in here.
    """

    def factory(original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def __init__(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            config = bound.arguments["config"]
            ddp_config = bound.arguments["ddp_config"]
            keep = settings.all_stages and ddp_config.overlap_grad_reduce
            if keep:
                bound.arguments["disable_bucketing"] = False
                # A layout passed in (Megatron-LM 0.18+ computes one per chunk) was made with no buckets on
                # stages after the first: it is replaced by the same layout with the configured bucket size.
                if lays_out_before_building and ddp_config.use_distributed_optimizer:
                    bound.arguments["full_param_layout"] = _distributed_optimizer_layout(
                        bound.arguments["module"], ddp_config, bound.arguments["pg_collection"])
            original(*bound.args, **bound.kwargs)
            if keep:
                self.bucket_size = ddp_config.bucket_size
            first_iteration = not getattr(config, "gradient_accumulation_fusion", False)
            attach_states(self, f"ddp{next(_DDP_COUNTER)}", first_iteration)
            if settings.telemetry is not None:
                for buffer in self.buffers + self.expert_parallel_buffers:
                    settings.telemetry.use_device(buffer.grad_data.device)

        return __init__

    return factory


def wrap_buffer_init(settings: AsyncDDPSettings):
    """A buffer asked for no buckets (``bucket_size`` None: a pipeline stage after the first) gets the
    configured bucket size when gradient reduction overlaps on every stage."""

    def factory(original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def __init__(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            ddp_config = bound.arguments["ddp_config"]
            if bound.arguments["bucket_size"] is None and settings.all_stages and ddp_config.overlap_grad_reduce:
                bound.arguments["bucket_size"] = ddp_config.bucket_size
            original(*bound.args, **bound.kwargs)

        return __init__

    return factory


def make_backward_post_hook(settings: AsyncDDPSettings, passes_force_all_reduce: bool):
    """megatron-core's parameter hook, plus: gradients arriving after their bucket was sent go aside."""
    from megatron.core.transformer.cuda_graphs import is_graph_capturing

    telemetry = settings.telemetry

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        # megatron-core 0.16 added DistributedDataParallel.force_all_reduce (passed to the bucket groups).
        forced = {"force_all_reduce": self.force_all_reduce} if passes_force_all_reduce else {}

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
                group.register_grad_ready(param, **forced)

        return hook

    return _make_backward_post_hook


def _keep_late_gradient(state: OverlapState, param, grad) -> None:
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


def wrap_zero_grad_buffer(settings: AsyncDDPSettings):
    """Each step starts with ``zero_grad_buffer``: the telemetry opens the iteration's record there."""

    def factory(original):
        @functools.wraps(original)
        def zero_grad_buffer(self):
            settings.telemetry.begin_iteration()
            return original(self)

        return zero_grad_buffer

    return factory


def patches(settings: AsyncDDPSettings) -> list[Patch]:
    buffer_init = wrap_buffer_init(settings)
    found = [
        wrap("megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.__init__",
             wrap_ddp_init(settings),
             expect="(self, config, ddp_config, module, disable_bucketing=False, pg_collection=None)",
             megatron="<0.18", name="async ddp: buckets on every stage and chunk, overlap state per bucket group"),
        wrap("megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.__init__",
             wrap_ddp_init(settings, lays_out_before_building=True),
             expect="(self, config, ddp_config, module, disable_bucketing=False, pg_collection=None, "
                    "full_param_layout=None)",
             megatron=">=0.18", name="async ddp: buckets on every stage and chunk, overlap state per bucket group"),
        wrap("megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer.__init__", buffer_init,
             expect="(self, ddp_config, param_dtype, grad_dtype, params, data_parallel_group, bucket_size, "
                    "param_to_name, gradient_scaling_factor, param_indices, nccl_ub, pg_collection=None)",
             megatron="<0.17", name="async ddp: the configured bucket size on pipeline stages after the first"),
        wrap("megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer.__init__", buffer_init,
             expect="(self, ddp_config, param_dtype, grad_dtype, params_with_names, data_parallel_group, "
                    "bucket_size, param_to_name, gradient_scaling_factor, param_indices, nccl_ub, pg_collection=None)",
             megatron=">=0.17,<0.18",
             name="async ddp: the configured bucket size on pipeline stages after the first"),
        wrap("megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer.__init__", buffer_init,
             expect="(self, ddp_config, param_dtype, grad_dtype, params_with_names, data_parallel_group, "
                    "bucket_size, param_to_name, gradient_scaling_factor, param_indices, nccl_ub, pg_collection=None, "
                    "param_layout=None)",
             megatron=">=0.18", name="async ddp: the configured bucket size on pipeline stages after the first"),
        replace("megatron.core.distributed.distributed_data_parallel:DistributedDataParallel._make_backward_post_hook",
                make_backward_post_hook(settings, passes_force_all_reduce=True), expect="(self, param)",
                megatron=">=0.16", name="async ddp: gradients arriving after their bucket was sent go aside"),
        replace("megatron.core.distributed.distributed_data_parallel:DistributedDataParallel._make_backward_post_hook",
                make_backward_post_hook(settings, passes_force_all_reduce=False), expect="(self, param)",
                megatron="<0.16", name="async ddp: gradients arriving after their bucket was sent go aside"),
    ]
    if settings.telemetry is not None:
        found.append(wrap("megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.zero_grad_buffer",
                          wrap_zero_grad_buffer(settings), expect="(self)",
                          name="async ddp telemetry: an iteration starts at zero_grad_buffer"))
    return found
