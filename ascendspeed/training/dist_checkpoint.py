"""The pretraining entry's checkpoints in Megatron's distributed format (``megatron.core.dist_checkpointing``,
the ``torch_dist`` format Megatron-LM writes by default).

The state dict is the one Megatron-LM's ``generate_state_dict`` builds (``args``, ``iteration``, ``model``
or ``model0``..., ``optimizer``, ``opt_param_scheduler``, ``rng_state``), so a checkpoint of the entry loads
in Megatron-LM's ``pretrain_gpt.py`` and the reverse. Every tensor is stored in model space (its global
shape, each rank writing its shard); the distributed optimizer's state too (``fully_reshardable``). So a
checkpoint loads at another tensor-, pipeline- or data-parallel layout: each rank reads the slices its layout
needs. Random states are kept per (pipeline, tensor) rank and restored when those sizes did not change.

A change of precision (``--bf16`` / ``--fp16`` added or dropped) continues exactly: fp32 main weights and
Adam's moments are stored under the model's keys (``optimizer.state.fp32_param.<key>``, ``...exp_avg...``)
by every optimizer; an fp32 checkpoint without the distributed optimizer has no ``fp32_param`` entries
because its weights are the main weights, and an fp32 run takes the main weights rather than their 16-bit
rounding. ``_prepare_for_precision`` points the load at the right entries, ``_optimizer_state_for_this_run``
puts the non-tensor part (parameter groups, Adam's step) where this run's optimizer reads it.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, extract_matching_values
from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedObject, ShardedTensor,
                                                     ShardedTensorFactory, apply_factories, apply_factory_merges)
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

from ascendspeed.training import optimizer_state
from ascendspeed.training.model import unwrap, vocab_size

#: Megatron-LM's ``checkpoint_version`` for this state dict layout.
CHECKPOINT_VERSION = 3.0
MAIN_WEIGHT_PREFIX = "optimizer.state.fp32_param."
#: Where the distributed optimizer (``fully_reshardable``) stores its main weights.
DISTRIBUTED_MAIN_WEIGHT_PREFIX = "optimizer.state.param."
MAIN_WEIGHT_PREFIXES = (MAIN_WEIGHT_PREFIX, DISTRIBUTED_MAIN_WEIGHT_PREFIX)
#: The distributed optimizer's stored forms that load at another tensor- or pipeline-parallel size.
RESHARDABLE_OPTIMIZER_FORMATS = ("fully_reshardable", "fully_sharded_model_space")


def is_distributed_checkpoint(directory: Path) -> bool:
    return dist_checkpointing.check_is_distributed_checkpoint(str(directory))


def content_metadata(use_distributed_optimizer: bool) -> dict:
    """How the state dict is built, recorded in the checkpoint (``load_content_metadata``) so a loader
    builds the same one. The distributed optimizer stores model-space tensors, which reshard across tensor-,
    pipeline- and data-parallel sizes (``fully_reshardable``; exact with several grad-buffer buckets through
    feature ``accelerator.model_space_checkpoints``)."""
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "fully_reshardable"
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    return metadata


def _model_keys(model: list) -> list[str]:
    return ["model"] if len(model) == 1 else [f"model{index}" for index in range(len(model))]


def _megatron_args(args: argparse.Namespace, iteration: int) -> argparse.Namespace:
    """The entry's flags under Megatron-LM's names (the same ones where both have a flag), plus what
    Megatron-LM's loader reads: the samples consumed so far and the padded vocabulary."""
    plain = (bool, int, float, str, type(None))
    def is_plain(value) -> bool:
        return isinstance(value, plain) or (isinstance(value, (list, tuple)) and all(isinstance(v, plain) for v in value))

    values = {name: value for name, value in vars(args).items() if is_plain(value)}
    values.update(consumed_train_samples=iteration * args.global_batch_size, skipped_train_samples=0,
                  consumed_valid_samples=0, padded_vocab_size=vocab_size(args), ckpt_format="torch_dist",
                  tokenizer_type="ascendspeed ByteTokenizer")
    return argparse.Namespace(**values)


def _rng_states(device: str) -> dict:
    """Megatron-LM's ``rng_state`` entry (its key names), for this rank."""
    device_state = torch.get_rng_state() if device == "cpu" else getattr(torch, device).get_rng_state()
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": device_state,
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _restore_rng_states(state: dict, device: str) -> None:
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if device != "cpu":
        getattr(torch, device).set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _rng_sharded_object(device: str) -> ShardedObject:
    """One object per (pipeline, tensor) rank; data-parallel replicas hold the same streams."""
    return ShardedObject(
        "rng_state", [_rng_states(device)],
        (parallel_state.get_pipeline_model_parallel_world_size(),
         parallel_state.get_tensor_model_parallel_world_size()),
        (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))


def _with_groups(metadata: dict) -> dict:
    return {**metadata, "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}


def sharded_state(args: argparse.Namespace, iteration: int, model: list, optimizer, scheduler, metadata: dict, *,
                  is_loading: bool, with_optimizer: bool = True, with_rng: bool = True) -> dict:
    """Megatron-LM's checkpoint state dict for this rank (collective with the distributed optimizer)."""
    metadata = _with_groups(metadata)
    state = {"args": _megatron_args(args, iteration), "checkpoint_version": CHECKPOINT_VERSION,
             "iteration": iteration, "num_floating_point_operations_so_far": 0}
    for key, chunk in zip(_model_keys(model), model):
        state[key] = unwrap(chunk).sharded_state_dict(metadata=metadata)
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _rng_sharded_object(args.device)
    return state


def save(args: argparse.Namespace, directory: Path, iteration: int, model: list, optimizer, scheduler) -> None:
    """Collective: every rank writes its shards into the existing, empty ``directory``."""
    metadata = content_metadata(args.use_distributed_optimizer)
    state = sharded_state(args, iteration, model, optimizer, scheduler, metadata, is_loading=False)
    dist_checkpointing.save(state, str(directory), get_default_save_sharded_strategy("torch_dist"),
                            content_metadata=metadata)


def content_metadata_of(directory: Path) -> Optional[dict]:
    """What ``content_metadata`` the writer recorded (None for checkpoints older than megatron-core 0.13)."""
    return dist_checkpointing.load_content_metadata(str(directory))


def saved_common_state(directory: Path) -> dict:
    """The checkpoint's non-tensor state (``args`` of the entry or of Megatron-LM, the schedule, ...)."""
    return dist_checkpointing.load_common_state_dict(str(directory))


def _sharded_tensors(state) -> list[ShardedTensor]:
    if isinstance(state, ShardedTensor):
        return [state]
    if isinstance(state, dict):
        return [tensor for value in state.values() for tensor in _sharded_tensors(value)]
    if isinstance(state, (list, tuple)):
        return [tensor for value in state for tensor in _sharded_tensors(value)]
    return []


class _MainWeightFromWeight:
    """A main weight an fp32 non-distributed checkpoint does not store: it is the loaded fp32 weight."""

    def __init__(self, weight: ShardedTensor, shape: torch.Size):
        self.weight, self.shape = weight, shape


def _apply_factories(request: dict) -> dict:
    """Replace each factory by the pieces it stores (e.g. SwiGLU's two halves: what a precision change
    re-keys); returns the factories, for ``apply_factory_merges`` after the load."""
    factories, _ = extract_matching_values(request, lambda value: isinstance(value, ShardedTensorFactory),
                                           return_lists_as_dicts=True)
    apply_factories(request)
    return factories


def _prepare_for_precision(request: dict, stored: dict, fp32_model: bool) -> None:
    """Point the request at the entries that hold what this run needs (see the module docstring). Tensors
    load in the dtype they were stored in (``load_state_dict`` rounds them into 16-bit parameters)."""
    requested = _sharded_tensors(request)
    keys = {tensor.key for tensor in requested}
    weights = {(tensor.key, tensor.global_offset): tensor for tensor in requested
               if not tensor.key.startswith("optimizer.")}
    for tensor in requested:
        if (fp32_model and not tensor.key.startswith("optimizer.")
                and MAIN_WEIGHT_PREFIX + tensor.key in stored and MAIN_WEIGHT_PREFIX + tensor.key not in keys):
            tensor.key = MAIN_WEIGHT_PREFIX + tensor.key
        saved = stored.get(tensor.key)
        if saved is not None and saved.dtype != tensor.dtype:
            tensor.data = torch.empty_like(tensor.data, dtype=saved.dtype)
            tensor.dtype = saved.dtype

    def from_weight(value):
        prefix = next((p for p in MAIN_WEIGHT_PREFIXES if getattr(value, "key", "").startswith(p)), None)
        if isinstance(value, ShardedTensor) and prefix and value.key not in stored:
            weight = weights.get((value.key[len(prefix):], value.global_offset))
            if weight is not None and weight.key in stored:
                return LocalNonpersistentObject(_MainWeightFromWeight(weight, value.data.shape))
        return value

    dict_list_map_inplace(from_weight, request)


def _resolve_main_weights(loaded: dict) -> None:
    """After the load: each main weight taken from a weight is (an fp32 copy of) the loaded weight."""
    dict_list_map_inplace(lambda value: value.weight.data.float().reshape(value.shape).clone()
                          if isinstance(value, _MainWeightFromWeight) else value, loaded)


def _optimizer_state_for_this_run(loaded: dict, mixed_run: bool, mixed_checkpoint: bool) -> dict:
    """megatron-core's fp32 optimizer keeps ``{state, param_groups}`` at the top, its mixed-precision one
    under ``optimizer`` (beside the main weights). The loaded non-tensor part (parameter groups, Adam's
    shared ``common_step``) sits where the checkpoint's optimizer kept it: move it where this run's reads it."""
    if mixed_run == mixed_checkpoint:
        return loaded
    saved = loaded["optimizer"] if mixed_checkpoint else loaded
    groups, step = saved["param_groups"], saved["state"].get("common_step")
    inner = loaded["optimizer"] if mixed_run else loaded
    current = inner.get("param_groups") or []
    if len(current) != len(groups):
        raise ValueError(f"the checkpoint's optimizer has {len(groups)} parameter groups, this run's {len(current)}")
    for group, mine in zip(groups, current):  # a stored group names no parameters: they are this run's
        if "params" in mine:
            group.setdefault("params", mine["params"])
    inner["param_groups"] = groups
    if step is not None:
        inner["state"]["common_step"] = step
    if mixed_run:
        return {key: value for key, value in loaded.items() if key not in ("param_groups", "state")}
    return {key: value for key, value in loaded.items() if key in ("param_groups", "state")}


def load(args: argparse.Namespace, directory: Path, iteration: int, saved_args: Optional[argparse.Namespace],
         model: list, optimizer, scheduler) -> tuple[Optional[dict], bool]:
    """Collective: read this layout's share of ``directory`` into the model and the optimizer. Returns the
    scheduler state to load (None with ``--no-load-optim``) and whether the random states were restored
    (only at the checkpoint's tensor- and pipeline-parallel sizes: they are per (PP, TP) rank)."""
    metadata = content_metadata_of(directory) or {}
    same_model_parallel = same_model_parallel_sizes(args, saved_args)
    load_optimizer = not args.no_load_optim
    if load_optimizer and args.use_distributed_optimizer:
        metadata.setdefault("distrib_optim_sharding_type", "fully_sharded_model_space")
    request = sharded_state(args, iteration, model, optimizer, scheduler, metadata, is_loading=True,
                            with_optimizer=load_optimizer, with_rng=same_model_parallel and not args.no_load_rng)
    stored = dist_checkpointing.load_tensors_metadata(str(directory))
    fp32_model = not (args.bf16 or args.fp16)
    mixed_run = load_optimizer and "fp32_from_fp16_params" in request["optimizer"]
    factories = _apply_factories(request)
    _prepare_for_precision(request, stored, fp32_model)
    loaded = dist_checkpointing.load(request, str(directory))
    _resolve_main_weights(loaded)
    loaded = apply_factory_merges(loaded, factories)
    for key, chunk in zip(_model_keys(model), model):
        unwrap(chunk).load_state_dict(loaded[key])
    if load_optimizer:
        mixed_checkpoint = not args_used_distributed_optimizer(saved_args) and any(
            key.startswith(MAIN_WEIGHT_PREFIX) for key in stored)
        optimizer.load_state_dict(_optimizer_state_for_this_run(loaded["optimizer"], mixed_run, mixed_checkpoint))
        if fp32_model and args.use_distributed_optimizer:
            # each rank's main-weight shard, a view of its weights, holds the checkpoint's main weights (a 16-bit
            # checkpoint's weights are their rounding): every rank takes every shard
            optimizer_state.gather_parameters(model)
    else:
        optimizer.reload_model_params()
    if "rng_state" in request:
        _restore_rng_states(loaded["rng_state"][0], args.device)
    return (loaded.get("opt_param_scheduler") if load_optimizer else None), "rng_state" in request


def args_used_distributed_optimizer(saved_args) -> bool:
    return bool(getattr(saved_args, "use_distributed_optimizer", False))


def same_model_parallel_sizes(args: argparse.Namespace, saved_args: Optional[argparse.Namespace]) -> bool:
    return (getattr(saved_args, "tensor_model_parallel_size", 1), getattr(saved_args, "pipeline_model_parallel_size", 1)
            ) == (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
