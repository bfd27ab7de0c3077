"""``--reuse-fp32-param`` for megatron-core's ``DistributedOptimizer`` (bf16).

megatron-core gives each rank an fp32 copy of its shard of every bucket (4 bytes per shard element)
beside the bf16 parameter buffer. Here the shard's fp32 main weights exist only during the step, laid
out in the bucket's own bf16 parameter buffer (whose other ranks' parts the all-gather after the step
overwrites anyway); between steps the shard is the bf16 weights in the buffer plus a 2-byte remainder
per element (``storage.BucketShardUnit``): 2 bytes per shard element saved, 2/DP per parameter.
"""
from __future__ import annotations

import contextvars
import functools

import torch
from megatron.core import tensor_parallel

from ascendspeed.features.reuse_fp32_param.float16_optimizer import reuse_state
from ascendspeed.features.reuse_fp32_param.storage import BucketShardUnit, ReuseState, main_layout
from ascendspeed.patching import wrap

#: The buffers of the ``DistributedOptimizer`` being constructed, for the (class-level) group builder.
_BUILDING = contextvars.ContextVar("reuse_fp32_param_building", default=None)


class _Construction:
    def __init__(self, buffers):
        self.buffers = buffers
        self.units = {}
        self.pieces = {}

    def unit(self, gbuf_index: int, bucket_index: int) -> BucketShardUnit:
        key = (gbuf_index, bucket_index)
        if key not in self.units:
            buffer = self.buffers[gbuf_index]
            bucket = buffer.buckets[bucket_index]
            group = buffer.data_parallel_group
            size = group.size()
            remainders = torch.zeros(bucket.param_data.numel() // max(size, 1), dtype=torch.int16,
                                     device=bucket.param_data.device)
            self.units[key] = BucketShardUnit(bucket.param_data, group.rank(), size, remainders)
        return self.units[key]


def wrap_init(original):
    """Construct as megatron-core does, with the group builder below making the main weights views
    of the bucket buffers; then attach the ``ReuseState``."""

    @functools.wraps(original)
    def __init__(self, optimizer, config, grad_scaler, init_state_fn, model_chunks, per_model_buffers,
                 data_parallel_group, data_parallel_group_gloo, data_parallel_group_idx,
                 distributed_optimizer_instance_id):
        if not config.bf16:
            raise ValueError("--reuse-fp32-param needs bf16 training (--bf16); this optimizer is not bf16")
        buffers = [buffer for buffers in (per_model_buffers or {}).values() for buffer in buffers]
        construction = _Construction(buffers)
        token = _BUILDING.set(construction)
        try:
            original(self, optimizer, config, grad_scaler, init_state_fn, model_chunks, per_model_buffers,
                     data_parallel_group, data_parallel_group_gloo, data_parallel_group_idx,
                     distributed_optimizer_instance_id)
        finally:
            _BUILDING.reset(token)
        if construction.units:
            self.reuse_fp32_param = ReuseState(construction.units.values())
            self.reuse_fp32_param_pieces = construction.pieces
            self.main_weight_tensors = self.reuse_fp32_param.storage_tensors

    return __init__


def wrap_build_model_and_main_param_groups(original):
    """``DistributedOptimizer._build_model_and_main_param_groups`` with each bf16 shard's main weight a
    view of its bucket's main region instead of a new fp32 copy (fp32 parameters as megatron-core).
    The patch manager hands over and re-wraps the function inside the classmethod."""

    def build(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
        construction = _BUILDING.get()
        if construction is None:
            return original(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        groups = tuple([] for _ in range(5))
        model_float16, model_fp32, shard_float16, shard_fp32, shard_fp32_from_float16 = groups
        for group_range in opt_group_ranges:
            for group in groups:
                group.append([])
            for model_param in group_range["params"]:
                gbuf_index, dtype, bucket_index = param_gbuf_map[model_param]
                ranges = gbuf_ranges[gbuf_index][dtype][bucket_index]["param_map"][model_param]
                param_range = ranges["param"]
                shard_model_param = model_param.detach().view(-1)[param_range.start: param_range.end]
                _copy_attributes(shard_model_param, model_param)
                if model_param.dtype == torch.bfloat16:
                    unit = construction.unit(gbuf_index, bucket_index)
                    in_bucket = ranges["gbuf_world_in_bucket"]
                    start, end = in_bucket.start - unit.start, in_bucket.end - unit.start
                    main_param = unit.main()[start:end]
                    _copy_attributes(main_param, model_param)
                    model_param.main_param = main_param
                    model_param.main_param_sharded = True
                    construction.pieces[model_param] = (unit, start, end)
                    model_float16[-1].append(model_param)
                    shard_float16[-1].append(shard_model_param)
                    shard_fp32_from_float16[-1].append(main_param)
                elif model_param.dtype == torch.float32:
                    model_fp32[-1].append(model_param)
                    shard_fp32[-1].append(shard_model_param)
                else:
                    raise TypeError(f"--reuse-fp32-param: parameters must be bf16 or fp32, got {model_param.dtype}")
            group_range["orig_group"]["params"] = [*shard_fp32[-1], *shard_fp32_from_float16[-1]]
        return groups

    return build


def _copy_attributes(tensor, model_param):
    tensor_parallel.copy_tensor_model_parallel_attributes(tensor, model_param)
    if hasattr(model_param, "shared"):
        tensor.shared = model_param.shared


def wrap_copy_main_params_to_model_params(original):
    """After the step: encode the shard's main weights into its bf16 weights (in the bucket buffer, ready
    for the all-gather) and remainders. fp32 parameters need nothing: their shards are the parameters."""

    @functools.wraps(original)
    def _copy_main_params_to_model_params(self):
        state = reuse_state(self)
        if state is None:
            return original(self)
        state.to_model_layout()

    return _copy_main_params_to_model_params


def wrap_copy_model_params_to_main_params(original):
    @functools.wraps(original)
    def _copy_model_params_to_main_params(self, state_dict=None):
        state = reuse_state(self)
        if state is None:
            return original(self, state_dict)
        if state_dict is not None:
            raise NotImplementedError("--reuse-fp32-param: main weights cannot be initialised from a state dict")
        state.reset_from_model()

    return _copy_model_params_to_main_params


def wrap_get_main_param_and_optimizer_states(original):
    """Checkpoint writers get an exact fp32 copy of the main weight (between steps it is not laid out)."""

    @functools.wraps(original)
    def _get_main_param_and_optimizer_states(self, model_param):
        tensors = original(self, model_param)
        state = reuse_state(self)
        if state is not None and not state.in_main_layout and model_param in self.reuse_fp32_param_pieces:
            unit, start, end = self.reuse_fp32_param_pieces[model_param]
            tensors["param"] = unit.read(start, end)
        return tensors

    return _get_main_param_and_optimizer_states


def wrap_loader(original):
    """Checkpoint loaders write the main weights while they are laid out, then split them; the other
    ranks' bf16 weights the layout displaced are put back (no all-gather follows a load)."""

    @functools.wraps(original)
    def load(self, *args, **kwargs):
        with main_layout(reuse_state(self), preserve_model=True):
            return original(self, *args, **kwargs)

    return load


def patches():
    return [
        wrap("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__", wrap_init,
             expect="(self, optimizer, config, grad_scaler, init_state_fn, model_chunks, per_model_buffers, "
                    "data_parallel_group, data_parallel_group_gloo, data_parallel_group_idx, "
                    "distributed_optimizer_instance_id)"),
        wrap("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups",
             wrap_build_model_and_main_param_groups,
             expect="(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)"),
        wrap("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._copy_main_params_to_model_params",
             wrap_copy_main_params_to_model_params, expect="(self)"),
        wrap("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._copy_model_params_to_main_params",
             wrap_copy_model_params_to_main_params, expect="(self, state_dict=None)"),
        wrap("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._get_main_param_and_optimizer_states",
             wrap_get_main_param_and_optimizer_states, expect="(self, model_param)"),
        wrap("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_state_dict", wrap_loader,
             expect="(self, state_dict)"),
        wrap("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_parameter_state_from_dp_reshardable",
             wrap_loader, expect="(self, state_dict)"),
        wrap("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_parameter_state_from_fs_model_space",
             wrap_loader, expect="(self, state_dict)"),
        wrap("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_parameter_state_from_dp_zero_legacy",
             wrap_loader, expect="(self, state_dict)"),
        wrap("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_parameter_state_from_dp_zero",
             wrap_loader, expect="(self, state_dict, *, update_legacy_format=False)"),
        wrap("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_parameter_state_from_fully_reshardable",
             wrap_loader, expect="(self, state_dict)"),
    ]
