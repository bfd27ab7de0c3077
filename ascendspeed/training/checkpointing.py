"""Checkpoints: one ``torch.save`` file per rank, resumable with the same parallel layout.

Layout of a checkpoint directory (Megatron-LM's tracker-file convention)::

    latest_checkpointed_iteration.txt      the iteration of the newest complete checkpoint
    iter_0000200/rank_00000.pt ...         model chunks, optimizer (+ this rank's distributed-optimizer
                                           shard), LR scheduler, RNG states

The tracker is written by rank 0 after every rank has finished writing, so an interrupted save never
becomes "latest". The data order is a function of the iteration (``data.train_microbatches``), so a
resumed run sees exactly the batches the uninterrupted run would have seen.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from ascendspeed.training.model import unwrap

TRACKER_FILE = "latest_checkpointed_iteration.txt"


@dataclasses.dataclass(frozen=True)
class Layout:
    """What must match between the run that saved and the run that loads."""

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: Optional[int]
    use_distributed_optimizer: bool

    @classmethod
    def of(cls, args: argparse.Namespace) -> "Layout":
        return cls(args.world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                   args.virtual_pipeline_model_parallel_size, args.use_distributed_optimizer)


def rank_file(directory: str, iteration: int) -> Path:
    return Path(directory) / f"iter_{iteration:07d}" / f"rank_{dist.get_rank():05d}.pt"


def _distributed_optimizers(optimizer) -> list[DistributedOptimizer]:
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part for part in parts if isinstance(part, DistributedOptimizer)]


def _rng_state() -> dict:
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _mark_no_padding(state: dict) -> dict:
    """megatron-core's loader skips the padding entries its sharded (dist-checkpoint) writer inserts and
    reads a ``padding`` key that ``get_parameter_state_dp_reshardable`` does not write: every entry that
    getter returns is a real parameter."""
    for key, per_dtype in state.items():
        if isinstance(key, int):
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for entry in bucket:
                        entry.setdefault("padding", False)
    return state


def _unshare_step_counters(optimizer) -> None:
    """Without apex or Transformer Engine, megatron-core's ``DistributedOptimizer.load_state_dict`` gives
    every parameter's Adam state one shared ``step`` tensor. torch's Adam increments each parameter's
    counter in place, so a shared one advances once per parameter per iteration and skews the bias
    correction of every update after a resume. Give each parameter its own counter."""
    for part in _distributed_optimizers(optimizer):
        for state in part.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def save_checkpoint(args: argparse.Namespace, iteration: int, model, optimizer, scheduler) -> Path:
    """Every rank writes its file; returns the iteration's directory."""
    path = rank_file(args.save, iteration)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "iteration": iteration,
        "layout": dataclasses.asdict(Layout.of(args)),
        "model": [unwrap(chunk).state_dict() for chunk in model],
        "optimizer": optimizer.state_dict(),
        "distributed_optimizer": [part.get_parameter_state_dp_reshardable()
                                  for part in _distributed_optimizers(optimizer)],
        "scheduler": scheduler.state_dict(),
        "rng": _rng_state(),
    }
    torch.save(state, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(args.save) / TRACKER_FILE).write_text(f"{iteration}\n")
    dist.barrier()
    return path.parent


def latest_iteration(directory: str) -> Optional[int]:
    tracker = Path(directory) / TRACKER_FILE
    if not tracker.is_file():
        return None
    return int(tracker.read_text().strip())


def load_checkpoint(args: argparse.Namespace, model, optimizer, scheduler) -> int:
    """Restore the newest checkpoint under ``args.load``; returns its iteration (0 when there is none)."""
    iteration = latest_iteration(args.load)
    if iteration is None:
        return 0
    path = rank_file(args.load, iteration)
    if not path.is_file():
        raise ValueError(f"checkpoint {path.parent} has no file for rank {dist.get_rank()}: it was written by "
                         f"fewer ranks; resume with the world size and parallel settings that wrote it")
    state = torch.load(path, map_location="cpu", weights_only=False)
    saved, current = Layout(**state["layout"]), Layout.of(args)
    if saved != current:
        raise ValueError(
            f"checkpoint {path.parent} was written with {saved}; this run has {current}. "
            f"Resume with the same world size and parallel settings."
        )
    for chunk, chunk_state in zip(model, state["model"], strict=True):
        unwrap(chunk).load_state_dict(chunk_state)
    if not args.no_load_optim:
        optimizer.load_state_dict(state["optimizer"])
        _unshare_step_counters(optimizer)
        with torch.no_grad():  # fp32 main params are views of the (grad-requiring) model params
            for part, part_state in zip(_distributed_optimizers(optimizer), state["distributed_optimizer"],
                                        strict=True):
                part.load_parameter_state_from_dp_reshardable(_mark_no_padding(part_state))
        scheduler.load_state_dict(state["scheduler"])
    else:
        optimizer.reload_model_params()
    if not args.no_load_rng:
        _set_rng_state(state["rng"])
    return iteration
