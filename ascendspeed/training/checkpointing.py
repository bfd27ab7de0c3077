"""Checkpoints: one ``torch.save`` file per rank, resumable with the same parallel layout.

Layout of a checkpoint directory (Megatron-LM's tracker-file convention)::

    latest_checkpointed_iteration.txt      the iteration of the newest complete checkpoint
    iter_0000200/rank_00000.pt ...         model chunks, optimizer (+ this rank's distributed-optimizer
                                           shard), LR scheduler, RNG states

Every file is written to a temporary name, flushed to disk (fsync) and renamed over its final name, so a
reader sees the old file or the new one, never a part. The tracker is written (the same way) by rank 0
after every rank has written its file, so an interrupted save never becomes "latest". A failure on any
rank is reported on every rank (nobody waits forever in a collective) with the file and the cause.

The data order is a function of the iteration (``data.train_microbatches``), so a resumed run sees
exactly the batches the uninterrupted run would have seen.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from ascendspeed.training.errors import CheckpointError, ResumeError
from ascendspeed.training.model import unwrap
from ascendspeed.training.progress import print_rank_0

TRACKER_FILE = "latest_checkpointed_iteration.txt"
STATE_KEYS = ("iteration", "layout", "model", "optimizer", "distributed_optimizer", "scheduler", "rng")

#: The learning-rate schedule a checkpoint records (``OptimizerParamScheduler.state_dict``) and the flag
#: that sets each entry in this run.
SCHEDULE_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "--lr-warmup-iters",
    "lr_decay_steps": "--lr-decay-iters (default --train-iters)",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "--weight-decay",
}


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


def iteration_directory(directory: str, iteration: int) -> Path:
    return Path(directory) / f"iter_{iteration:07d}"


def rank_file(directory: str, iteration: int) -> Path:
    return iteration_directory(directory, iteration) / f"rank_{dist.get_rank():05d}.pt"


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


def _cause(error: BaseException) -> str:
    """The error and the operating-system error under it: torch's writer reports a full disk as
    "unexpected pos 704 vs 598" and keeps the ``OSError`` (ENOSPC, EFBIG) only as its context."""
    text = f"{type(error).__name__}: {error}".strip().rstrip(":")
    inner = error.__cause__ or error.__context__
    while inner is not None and not isinstance(inner, OSError):
        inner = inner.__cause__ or inner.__context__
    if inner is not None and inner is not error:
        text += f" (caused by {type(inner).__name__}: {inner.strerror or inner})"
    return text


def _free_space(path: Path) -> str:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return f"{shutil.disk_usage(candidate).free / 2**20:,.0f} MiB free on its file system"
    return "free space unknown"


def _sync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX); where directories cannot be opened, nothing to do."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def atomic_write(path: Path, write: Callable) -> None:
    """Write ``path`` through ``write(binary file)`` under a temporary name, fsync, then rename over it."""
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        with open(temporary, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _sync_directory(path.parent)


def _raise_if_any_rank_failed(error: Optional[Exception], what: str, device: str) -> None:
    """Collective: every rank learns whether ``what`` failed anywhere, so no rank is left waiting in the
    next collective. The failing ranks raise their own error, the others one naming those ranks."""
    failed = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=torch.device(device))
    failed[dist.get_rank()] = int(error is not None)
    dist.all_reduce(failed)
    if error is not None:
        raise error
    ranks = failed.nonzero().flatten().tolist()
    if ranks:
        raise CheckpointError(f"{what} failed on rank(s) {ranks}; their error names the file and the cause")


def check_save_directory(args: argparse.Namespace) -> None:
    """At start-up, not after the training time is spent: can every rank create files under ``--save``?"""
    directory = Path(args.save)
    error = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write_test_rank_{dist.get_rank():05d}"
        atomic_write(probe, lambda handle: handle.write(b"ascendspeed"))
        probe.unlink()
    except OSError as cause:
        error = CheckpointError(f"--save {directory} is not writable: {_cause(cause)}; choose a directory this "
                                f"user can create files in")
    _raise_if_any_rank_failed(error, f"checking --save {directory}", args.device)


def save_checkpoint(args: argparse.Namespace, iteration: int, model, optimizer, scheduler) -> Path:
    """Every rank writes its file, then rank 0 the tracker; returns the iteration's directory."""
    path = rank_file(args.save, iteration)
    state = {  # outside the try: gathering the distributed optimizer's state is collective
        "iteration": iteration,
        "layout": dataclasses.asdict(Layout.of(args)),
        "model": [unwrap(chunk).state_dict() for chunk in model],
        "optimizer": optimizer.state_dict(),
        "distributed_optimizer": [part.get_parameter_state_dp_reshardable()
                                  for part in _distributed_optimizers(optimizer)],
        "scheduler": scheduler.state_dict(),
        "rng": _rng_state(),
    }
    error = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda handle: torch.save(state, handle))
    except (OSError, RuntimeError) as cause:
        error = CheckpointError(f"cannot write checkpoint file {path}: {_cause(cause)} ({_free_space(path)}); "
                                f"free space or choose another --save. The previous checkpoint stays the latest.")
    _raise_if_any_rank_failed(error, f"saving iteration {iteration}", args.device)
    error = None
    if dist.get_rank() == 0:
        tracker = Path(args.save) / TRACKER_FILE
        try:
            atomic_write(tracker, lambda handle: handle.write(f"{iteration}\n".encode()))
        except OSError as cause:
            error = CheckpointError(f"cannot write checkpoint tracker {tracker}: {_cause(cause)} "
                                    f"({_free_space(tracker)}); the files of {path.parent} are complete: write "
                                    f"{iteration} into the tracker to make it the latest")
    _raise_if_any_rank_failed(error, f"writing the tracker of iteration {iteration}", args.device)
    return path.parent


def latest_iteration(directory: str) -> Optional[int]:
    """The tracker's iteration; None when ``directory`` is missing or holds no checkpoint at all.

    A directory with iteration directories but no tracker, or a tracker that is not a number, is damaged
    and raises ``CheckpointError`` (it is not "no checkpoint").
    """
    directory = Path(directory)
    tracker = directory / TRACKER_FILE
    if not directory.exists():
        return None
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is a file, not a checkpoint directory")
    if not tracker.is_file():
        saved = sorted(path.name for path in directory.glob("iter_*"))
        if saved:
            raise CheckpointError(f"{directory} holds {', '.join(saved)} but no {TRACKER_FILE}: write the iteration "
                                  f"of the newest complete one into {tracker}")
        return None
    try:
        text = tracker.read_text()
    except (OSError, UnicodeDecodeError) as cause:
        raise CheckpointError(f"cannot read checkpoint tracker {tracker}: {_cause(cause)}") from cause
    try:
        iteration = int(text.strip())
    except ValueError:
        iteration = -1
    if iteration < 0:
        raise CheckpointError(f"checkpoint tracker {tracker} holds {text[:40]!r}, not an iteration number: it is "
                              f"damaged; write the iteration of the newest complete iter_NNNNNNN directory into it")
    return iteration


def _read_rank_file(args: argparse.Namespace, iteration: int) -> dict:
    directory = iteration_directory(args.load, iteration)
    tracker = Path(args.load) / TRACKER_FILE
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint tracker {tracker} names iteration {iteration}, but {directory} does not "
                              f"exist: write the iteration of an existing iter_NNNNNNN directory into the tracker")
    path = rank_file(args.load, iteration)
    if not path.is_file():
        present = sorted(p.name for p in directory.glob("rank_*.pt"))
        raise CheckpointError(f"checkpoint {directory} has no file for rank {dist.get_rank()} (it holds "
                              f"{len(present)} rank file(s)): it was written by fewer ranks; resume with the world "
                              f"size and parallel settings that wrote it")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as cause:  # noqa: BLE001 - pickle and zip errors have many types; all mean "unreadable"
        raise CheckpointError(f"cannot read checkpoint file {path} ({path.stat().st_size:,} bytes): {_cause(cause)}; "
                              f"the file is damaged or truncated: resume from an earlier checkpoint by writing its "
                              f"iteration into {tracker}") from cause
    if not isinstance(state, dict) or any(key not in state for key in STATE_KEYS):
        raise CheckpointError(f"{path} is not an ascendspeed checkpoint file (it lacks "
                              f"{', '.join(k for k in STATE_KEYS if not isinstance(state, dict) or k not in state)})")
    saved, current = Layout(**state["layout"]), Layout.of(args)
    if saved != current:
        raise CheckpointError(f"checkpoint {directory} was written with {saved}; this run has {current}. "
                              f"Resume with the same world size and parallel settings.")
    return state


def schedule_changes(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(flag, checkpoint value, this run's value) for every schedule setting the flags change."""
    return [(flag, saved[key], current[key]) for key, flag in SCHEDULE_FLAGS.items() if saved[key] != current[key]]


def _reconcile_schedule(args: argparse.Namespace, saved: dict, scheduler) -> None:
    """Megatron-LM's rule: a schedule flag that differs from the checkpoint is an error unless the user
    says which one wins (``--override-opt_param-scheduler``: the flags; ``--use-checkpoint-opt_param-scheduler``:
    the checkpoint). Either way the run prints what it follows."""
    changes = schedule_changes(saved, scheduler.state_dict())
    if not changes:
        return
    listed = "; ".join(f"{flag}: checkpoint {old}, now {new}" for flag, old, new in changes)
    if args.override_opt_param_scheduler:
        print_rank_0(f"learning-rate schedule follows this run's flags (--override-opt_param-scheduler): {listed}")
    elif args.use_checkpoint_opt_param_scheduler:
        print_rank_0(f"learning-rate schedule stays the checkpoint's (--use-checkpoint-opt_param-scheduler), "
                     f"ignoring {listed}")
    else:
        raise ResumeError(f"--load {args.load}: the learning-rate schedule differs from the checkpoint's ({listed}). "
                          f"Pass --override-opt_param-scheduler to follow the new flags (e.g. to extend a run), or "
                          f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule")


def load_checkpoint(args: argparse.Namespace, model, optimizer, scheduler) -> int:
    """Restore the newest checkpoint under ``args.load``; returns its iteration.

    Returns 0 only when ``args.load`` holds no checkpoint at all and ``--allow-fresh-start`` is given;
    otherwise a missing, empty or damaged checkpoint raises ``CheckpointError`` on every rank.
    """
    error, state = None, None
    try:
        iteration = latest_iteration(args.load)
        if iteration is None and not args.allow_fresh_start:
            what = "does not exist" if not Path(args.load).exists() else f"holds no checkpoint (no {TRACKER_FILE})"
            raise CheckpointError(f"--load {args.load} {what}: check the path, or pass --allow-fresh-start to "
                                  f"start from scratch when it holds none")
        if iteration is not None:
            state = _read_rank_file(args, iteration)
            if iteration > args.train_iters:
                raise ResumeError(f"--load {args.load} holds iteration {iteration}, past --train-iters "
                                  f"{args.train_iters}: there is nothing to train. Raise --train-iters above "
                                  f"{iteration} to continue training")
            if not args.no_load_optim:
                _reconcile_schedule(args, state["scheduler"], scheduler)
    except (CheckpointError, ResumeError) as failure:
        error = failure
    _raise_if_any_rank_failed(error, f"loading {args.load}", args.device)
    if state is None:
        return 0
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
