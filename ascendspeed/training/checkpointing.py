"""Checkpoints in Megatron's distributed format, resumable at any parallel layout.

Layout of a checkpoint directory (Megatron-LM's, so either program loads the other's)::

    latest_checkpointed_iteration.txt      the iteration of the newest complete checkpoint
    iter_0000200/                          megatron.core.dist_checkpointing (torch_dist): .metadata,
                                           __R_I.distcp shards (with the common state; common.pt on
                                           older releases), metadata.json; and
                                           ascendspeed_record.json, the flags that define the model

What the state dict holds and how it reshards is in ``dist_checkpoint``. A checkpoint is written into a
hidden staging directory (``.iter_0000200.tmp``) and renamed to its name by rank 0 once every rank has
written its shards; the tracker is written (to a temporary name, fsync'd, renamed) after that, so a reader
sees the old checkpoint or the new one, never a part, and an interrupted save never becomes "latest". A
failure on any rank is reported on every rank (nobody waits forever in a collective) with the path and
the cause.

Checkpoints of the earlier rank-file format (``iter_NNNNNNN/rank_00000.pt``, one ``torch.save`` file per
rank) still load, with the layout that wrote them.

The data order is a function of the iteration (``data.train_microbatches``), so a resumed run sees
exactly the batches the uninterrupted run would have seen.
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import random
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.core import CheckpointingException
from torch.distributed.checkpoint.api import CheckpointException
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from ascendspeed.training import checkpoint_record, dist_checkpoint, optimizer_state, watchdog
from ascendspeed.training.errors import CheckpointError, ResumeError
from ascendspeed.training.model import unwrap, vocab_size
from ascendspeed.training.progress import print_rank_0
from ascendspeed.training.save_lock import SaveDirectoryLock

TRACKER_FILE = "latest_checkpointed_iteration.txt"

#: Temporary files being written now, for an exit that cannot unwind (the watchdog's).
_IN_FLIGHT: set[Path] = set()
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


#: The flag behind each ``Layout`` field, for messages.
LAYOUT_FLAGS = {
    "world_size": "world size (torchrun --nproc-per-node x nodes)",
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "virtual_pipeline_model_parallel_size": "virtual pipeline stages (--num-layers-per-virtual-pipeline-stage)",
    "use_distributed_optimizer": "--use-distributed-optimizer",
}


def iteration_directory(directory: str, iteration: int) -> Path:
    return Path(directory) / f"iter_{iteration:07d}"


def staging_directory(final: Path) -> Path:
    """Where a checkpoint is written before it is complete (hidden, so no ``iter_*`` glob sees it)."""
    return final.with_name(f".{final.name}.tmp")


def rank_file(directory: str, iteration: int) -> Path:
    return iteration_directory(directory, iteration) / f"rank_{dist.get_rank():05d}.pt"


def _distributed_optimizers(optimizer) -> list[DistributedOptimizer]:
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part for part in parts if isinstance(part, DistributedOptimizer)]


def _set_rng_state(state: dict) -> None:
    """The random states of a rank-file checkpoint (a distributed one stores Megatron-LM's, see
    ``dist_checkpoint``)."""
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


def _os_error(error: BaseException) -> Optional[OSError]:
    """``error`` itself or the ``OSError`` under it: torch's writer reports a full disk as "unexpected pos
    704 vs 598" and keeps the ``OSError`` (ENOSPC, EFBIG) only as its context."""
    inner = error
    while inner is not None and not isinstance(inner, OSError):
        inner = inner.__cause__ or inner.__context__
    return inner


def _cause(error: BaseException) -> str:
    """The error and the operating-system error under it; for torch.distributed.checkpoint's collective
    error, the first failing rank's error (its text is a traceback per rank)."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, failure = next(iter(sorted(error.failures.items())))
        failure = failure[0] if isinstance(failure, tuple) else failure
        return (f"torch.distributed.checkpoint failed on rank(s) {sorted(error.failures)}; rank {rank}: "
                f"{_cause(failure) if isinstance(failure, BaseException) else failure}")
    text = f"{type(error).__name__}: {error}".strip().rstrip(":")
    inner = _os_error(error)
    if inner is not None and inner is not error:
        text += f" (caused by {type(inner).__name__}: {inner.strerror or inner})"
    return text


def _write_advice(error: BaseException, path: Path) -> str:
    """What to do about a failed write, from its operating-system cause: a full disk is not a read-only
    directory, and neither is a file-size limit."""
    code = getattr(_os_error(error), "errno", None)
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (f"{path.parent} is not writable ({os.strerror(code)}): make it writable for this user or choose "
                f"another --save")
    if code == errno.EFBIG:
        return (f"a file-size limit stops it ({_free_space(path)}): raise the limit (ulimit -f, or the file "
                f"system's largest file) or choose another --save")
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk or quota is full ({_free_space(path)}): free space or choose another --save"
    limit = _file_size_limit()
    if code is None and limit is not None:  # the writer's worker dropped the OS error; a limit is the likely one
        return (f"this process may not write files past {limit / 2**20:,.2f} MiB (ulimit -f; a write past it fails "
                f"with \"{os.strerror(errno.EFBIG)}\"; {_free_space(path)}): raise the limit or choose another --save")
    return f"({_free_space(path)}) fix the cause above or choose another --save"


def _file_size_limit() -> Optional[int]:
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


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


def temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def atomic_write(path: Path, write: Callable) -> None:
    """Write ``path`` through ``write(binary file)`` under a temporary name, fsync, then rename over it.

    Any exception, a ``Terminated`` raised by the SIGTERM handler included, removes the temporary file."""
    temporary = temporary_name(path)
    _IN_FLIGHT.add(temporary)
    try:
        with open(temporary, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    finally:
        _IN_FLIGHT.discard(temporary)
    _sync_directory(path.parent)


def remove_in_flight_temporaries() -> None:
    """For an exit that skips every ``finally`` (``os._exit``): remove the temporary files and staging
    directories being written."""
    for temporary in list(_IN_FLIGHT):
        try:
            if temporary.is_dir():
                shutil.rmtree(temporary, ignore_errors=True)
            else:
                temporary.unlink(missing_ok=True)
        except OSError:
            pass


def _raise_if_any_rank_failed(error: Optional[Exception], what: str, device: str) -> None:
    """Collective: every rank learns whether ``what`` failed anywhere, so no rank is left waiting in the
    next collective. The failing ranks raise their own error, the others one naming those ranks."""
    watchdog.report(f"the all-reduce after {what}")
    failed = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=torch.device(device))
    failed[dist.get_rank()] = int(error is not None)
    dist.all_reduce(failed)
    if error is not None:
        raise error
    ranks = failed.nonzero().flatten().tolist()
    if ranks:
        raise CheckpointError(f"{what} failed on rank(s) {ranks}; their error names the file and the cause")


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Temporary files of saves that were killed before they could clean up (SIGKILL, power loss): a full
    rank file each, never part of a checkpoint. Only under the lock, so no other run is writing them."""
    stale = [*directory.glob(f".{TRACKER_FILE}.tmp"), *directory.glob(".write_test_rank_*.tmp"),
             *directory.glob("iter_*/.*.tmp"), *directory.glob(".iter_*.tmp"), *directory.glob(".iter_*.old")]
    removed = []
    for path in stale:
        try:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _raise_rank_0_failure(error: Optional[CheckpointError]) -> None:
    """Collective: an error only rank 0 can find (the lock) is raised on every rank with its message."""
    message = [None if error is None else str(error)]
    dist.broadcast_object_list(message, src=0)
    if error is not None:
        raise error
    if message[0] is not None:
        raise CheckpointError(message[0])


def prepare_save_directory(args: argparse.Namespace) -> Optional[SaveDirectoryLock]:
    """At start-up, not after the training time is spent: create ``--save``, lock it against a second run
    (rank 0; returns the lock to release at the end), remove temporaries of killed saves, and check that
    every rank can create files in it."""
    directory = Path(args.save)
    error, lock = None, None
    if dist.get_rank() == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            lock = SaveDirectoryLock(directory)
            warning = lock.acquire()
            if warning:
                print_rank_0(warning)
            removed = remove_stale_temporaries(directory)
            if removed:
                print_rank_0(f"removed {len(removed)} temporary file(s) of an interrupted save from {directory}: "
                             f"{', '.join(str(p.relative_to(directory)) for p in removed)}")
        except CheckpointError as cause:
            lock, error = None, cause
        except OSError:  # reported with the cause by the check below, on every rank
            if lock is not None:
                lock.release()
            lock = None
    _raise_rank_0_failure(error)
    error = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write_test_rank_{dist.get_rank():05d}"
        atomic_write(probe, lambda handle: handle.write(b"ascendspeed"))
        probe.unlink()
    except OSError as cause:
        error = CheckpointError(f"--save {directory} is not writable: {_cause(cause)}; choose a directory this "
                                f"user can create files in")
    try:
        _raise_if_any_rank_failed(error, f"checking --save {directory}", args.device)
    except CheckpointError:
        if lock is not None:
            lock.release()
        raise
    return lock


def save_checkpoint(args: argparse.Namespace, iteration: int, model, optimizer, scheduler) -> Path:
    """Every rank writes its shards into the staging directory; rank 0 then adds the record, renames it
    to ``iter_NNNNNNN`` and writes the tracker. Returns the iteration's directory."""
    final = iteration_directory(args.save, iteration)
    staging = staging_directory(final)
    error = None
    _IN_FLIGHT.add(staging)
    try:
        if dist.get_rank() == 0:
            try:
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
            except OSError as cause:
                error = CheckpointError(f"cannot create checkpoint directory {staging}: {_cause(cause)}; "
                                        f"{_write_advice(cause, staging)}")
        _raise_if_any_rank_failed(error, f"saving iteration {iteration}", args.device)
        try:
            dist_checkpoint.save(args, staging, iteration, model, optimizer, scheduler)
        except (OSError, RuntimeError, CheckpointingException, CheckpointException) as cause:
            error = CheckpointError(f"cannot write checkpoint {final} (staged in {staging}): {_cause(cause)}; "
                                    f"{_write_advice(cause, staging / 'shard')}. The previous checkpoint stays the "
                                    f"latest.")
        _raise_if_any_rank_failed(error, f"saving iteration {iteration}", args.device)
    except BaseException:  # a failed write, or a Terminated raised by the SIGTERM handler
        _remove_staging(staging)
        _IN_FLIGHT.discard(staging)
        raise
    error = None
    if dist.get_rank() == 0:
        tracker = Path(args.save) / TRACKER_FILE
        step, target = "write checkpoint record", staging / checkpoint_record.METADATA_FILE
        try:
            checkpoint_record.write(staging, iteration, dataclasses.asdict(Layout.of(args)), args, vocab_size(args),
                                    atomic_write)
            step, target = f"move the written checkpoint {staging} into place as", final / "shard"
            _replace_directory(staging, final)
            step, target = "write checkpoint tracker", tracker
            atomic_write(tracker, lambda handle: handle.write(f"{iteration}\n".encode()))
        except OSError as cause:
            _remove_staging(staging)
            named = final if target.name == "shard" else target
            error = CheckpointError(f"cannot {step} {named}: {_cause(cause)}; {_write_advice(cause, target)}. The "
                                    f"previous checkpoint stays the latest")
        except BaseException:  # a Terminated between the shards and the rename
            _remove_staging(staging)
            _IN_FLIGHT.discard(staging)
            raise
    _IN_FLIGHT.discard(staging)
    _raise_if_any_rank_failed(error, f"writing the tracker of iteration {iteration}", args.device)
    return final


def _remove_staging(staging: Path, attempts: int = 20) -> None:
    """Remove a failed save's staging directory. Writer processes of megatron-core's shard writer (forked on
    some releases) may still be finishing a file in it while they stop: retry briefly until it is gone."""
    for _ in range(attempts):
        shutil.rmtree(staging, ignore_errors=True)
        if not staging.exists():
            return
        time.sleep(0.1)


def _replace_directory(staging: Path, final: Path) -> None:
    """Rename ``staging`` to ``final``; an older ``final`` (a save of the same iteration) is moved aside
    first and removed after."""
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staging, final)
    _sync_directory(final.parent)
    shutil.rmtree(old, ignore_errors=True)


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
    _check_layout(args, state["layout"], directory)
    return state


def _check_layout(args: argparse.Namespace, saved: dict, directory: Path) -> None:
    """Each file of a rank-file checkpoint holds one rank's part of the model and optimizer: the parallel
    layout must match. Without the optimizer state (``--no-load-optim``) the distributed optimizer does not
    matter. (A distributed checkpoint's layout is checked by ``_check_saved_arguments``.)"""
    current = dataclasses.asdict(Layout.of(args))
    changes = [(LAYOUT_FLAGS[key], saved.get(key), value) for key, value in current.items()
               if saved.get(key) != value and not (key == "use_distributed_optimizer" and args.no_load_optim)]
    if not changes:
        return
    listed = "; ".join(f"{flag}: checkpoint {old}, now {new}" for flag, old, new in changes)
    hint = (" (or pass --no-load-optim to take only the weights and start the optimizer afresh)"
            if all(flag == "--use-distributed-optimizer" for flag, _, _ in changes) else "")
    raise CheckpointError(f"checkpoint {directory} was written with another parallel layout ({listed}): each rank "
                          f"file of this older format holds that layout's share of the state. Resume with the "
                          f"checkpoint's settings{hint}")


def _check_record(args: argparse.Namespace, record: Optional[dict], directory: Path, announce: bool,
                  layout_must_match: bool) -> None:
    """Before any weight is read: the model must be the checkpoint's, and its optimizer state must carry
    over to this run's optimizer (a precision change converts, see ``optimizer_state``)."""
    if record is None and announce:
        print_rank_0(f"note: {directory} has no {checkpoint_record.METADATA_FILE} (written by another program, or "
                     f"before checkpoints recorded their model): its architecture is checked tensor by tensor only")
    if record is None:
        return
    saved = record["architecture"]
    changes = checkpoint_record.differences(saved, checkpoint_record.architecture(args, vocab_size(args)))
    if changes:
        raise ResumeError(
            f"--load {args.load}: checkpoint {directory} holds another model than these flags build "
            f"({checkpoint_record.describe(changes, saved)}). A checkpoint only resumes into the model that wrote "
            f"it: pass the checkpoint's values ({checkpoint_record.as_flags(changes, saved)}), or train the new "
            f"model from scratch without --load")
    storage = record.get("optimizer_storage", {})
    current = checkpoint_record.optimizer_storage(args)
    if not args.no_load_optim and storage.get("--optimizer", args.optimizer) != args.optimizer:
        raise ResumeError(
            f"--load {args.load}: --optimizer: checkpoint {storage['--optimizer']}, now {args.optimizer}: the state "
            f"of one optimizer does not carry over to the other. Resume with --optimizer {storage['--optimizer']}, "
            f"or pass --no-load-optim to start the new optimizer afresh from the checkpoint's weights")
    record_layout = record.get("layout")
    if record_layout is not None and layout_must_match:
        _check_layout(args, record_layout, directory)
    if (announce and not args.no_load_optim
            and checkpoint_record.precision(storage) != checkpoint_record.precision(current)):
        print_rank_0(f"--load {args.load}: the checkpoint trained in {checkpoint_record.precision(storage)}, this "
                     f"run trains in {checkpoint_record.precision(current)}: its fp32 main weights and optimizer "
                     f"state carry over unchanged" + (", the fp16 loss scale starts at --initial-loss-scale"
                                                      if args.fp16 else ""))


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


def _locate(args: argparse.Namespace, announce: bool) -> tuple[Optional[int], Optional[dict]]:
    """The iteration to resume from (None: nothing to load) and, for a distributed checkpoint, its common
    state (None for the rank-file format), after every check that needs no weights."""
    iteration = latest_iteration(args.load)
    if iteration is None and not args.allow_fresh_start:
        what = "does not exist" if not Path(args.load).exists() else f"holds no checkpoint (no {TRACKER_FILE})"
        raise CheckpointError(f"--load {args.load} {what}: check the path, or pass --allow-fresh-start to "
                              f"start from scratch when it holds none")
    if iteration is None:
        return None, None
    directory = iteration_directory(args.load, iteration)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint tracker {Path(args.load) / TRACKER_FILE} names iteration {iteration}, but "
                              f"{directory} does not exist: write the iteration of an existing iter_NNNNNNN "
                              f"directory into the tracker")
    try:
        record = checkpoint_record.read(directory)
    except ValueError as cause:
        raise CheckpointError(f"{cause}: the checkpoint record is damaged; resume from an earlier checkpoint by "
                              f"writing its iteration into {Path(args.load) / TRACKER_FILE}") from cause
    common = _read_common_state(args, directory) if is_distributed_checkpoint(directory) else None
    _check_record(args, record, directory, announce, layout_must_match=common is None)
    if common is not None:
        _check_saved_arguments(args, directory, common.get("args"))
    if iteration > args.train_iters:
        raise ResumeError(f"--load {args.load} holds iteration {iteration}, past --train-iters "
                          f"{args.train_iters}: there is nothing to train. Raise --train-iters above "
                          f"{iteration} to continue training")
    return iteration, common


def is_distributed_checkpoint(directory: Path) -> bool:
    """Megatron's distributed format; else the rank-file format (or damaged: its loader names the cause)."""
    return not any(directory.glob("rank_*.pt")) and dist_checkpoint.is_distributed_checkpoint(directory)


def _check_saved_arguments(args: argparse.Namespace, directory: Path, saved: Optional[argparse.Namespace]) -> None:
    """A distributed checkpoint reshards across tensor-, pipeline- (virtual stages included) and data-parallel
    sizes; what its ``args`` (the entry's or Megatron-LM's) say about the optimizer's storage must fit this run."""
    if saved is None or args.no_load_optim:
        return
    saved_distributed = dist_checkpoint.args_used_distributed_optimizer(saved)
    if saved_distributed != args.use_distributed_optimizer:
        raise CheckpointError(f"checkpoint {directory} holds another optimizer's state (--use-distributed-optimizer: "
                              f"checkpoint {saved_distributed}, now {args.use_distributed_optimizer}). Resume with "
                              f"the checkpoint's setting (or pass --no-load-optim to take only the weights and start "
                              f"the optimizer afresh)")
    sharding = (_read(args, directory, dist_checkpoint.content_metadata_of) or {}).get("distrib_optim_sharding_type")
    if saved_distributed and sharding not in (None, *dist_checkpoint.RESHARDABLE_OPTIMIZER_FORMATS) \
            and not dist_checkpoint.same_model_parallel_sizes(args, saved):
        raise CheckpointError(
            f"checkpoint {directory} stores the distributed optimizer's state as {sharding!r}, which loads only at "
            f"the tensor- and pipeline-parallel sizes that wrote it ({saved.tensor_model_parallel_size}, "
            f"{saved.pipeline_model_parallel_size}). Resume with those or pass --no-load-optim (Megatron-LM saves a "
            f"reshardable form with --dist-ckpt-optim-fully-reshardable, the entry always)")


def check_resume(args: argparse.Namespace) -> None:
    """Collective, at start-up before the data and the model: refuse a ``--load`` that cannot resume with
    these flags (missing, damaged record, another model or parallel layout, another optimizer)."""
    error = None
    try:
        _locate(args, announce=True)
    except (CheckpointError, ResumeError) as failure:
        error = failure
    _raise_if_any_rank_failed(error, f"checking --load {args.load}", args.device)


def load_checkpoint(args: argparse.Namespace, model, optimizer, scheduler) -> int:
    """Restore the newest checkpoint under ``args.load``; returns its iteration.

    Returns 0 only when ``args.load`` holds no checkpoint at all and ``--allow-fresh-start`` is given;
    otherwise a missing, empty or damaged checkpoint, or one that does not fit these flags, raises
    ``CheckpointError`` or ``ResumeError`` on every rank, before any weight is changed.
    """
    error, state, iteration, distributed = None, None, None, False
    try:
        iteration, common = _locate(args, announce=False)
        if iteration is not None:
            distributed = common is not None
            state = common if distributed else _read_rank_file(args, iteration)
            if not args.no_load_optim:
                saved = _saved_schedule(args, iteration, state) if distributed else state["scheduler"]
                _reconcile_schedule(args, saved, scheduler)
    except (CheckpointError, ResumeError) as failure:
        error = failure
    _raise_if_any_rank_failed(error, f"loading {args.load}", args.device)
    if iteration is None:
        return 0
    if distributed:
        return _load_distributed(args, iteration, state.get("args"), model, optimizer, scheduler)
    error, gather = None, False
    try:
        gather = _restore(args, state, model, optimizer)
    except (optimizer_state.ConversionError, RuntimeError, KeyError, ValueError, AssertionError) as cause:
        error = CheckpointError(
            f"cannot load {rank_file(args.load, iteration)} into this run's model and optimizer: {_cause(cause)}. "
            f"Resume with the flags that wrote it (its {checkpoint_record.METADATA_FILE} lists them)")
    _raise_if_any_rank_failed(error, f"loading {args.load}", args.device)
    if gather:
        optimizer_state.gather_parameters(model)
    if not args.no_load_optim:
        scheduler.load_state_dict(state["scheduler"])
    if not args.no_load_rng:
        _set_rng_state(state["rng"])
    return iteration


def _read_common_state(args: argparse.Namespace, directory: Path) -> dict:
    """The non-tensor part of a distributed checkpoint (its ``args``, schedule, iteration)."""
    return _read(args, directory, dist_checkpoint.saved_common_state)


def _read(args: argparse.Namespace, directory: Path, reader: Callable):
    """``reader(directory)``, any failure to read a damaged checkpoint named as such."""
    try:
        return reader(directory)
    except (Exception, CheckpointException) as cause:  # noqa: BLE001 - many types; all mean "unreadable"
        raise CheckpointError(f"cannot read checkpoint {directory}: {_cause(cause)}; the checkpoint is damaged: "
                              f"resume from an earlier one by writing its iteration into "
                              f"{Path(args.load) / TRACKER_FILE}") from cause


def _saved_schedule(args: argparse.Namespace, iteration: int, common: dict) -> dict:
    saved = common.get("opt_param_scheduler")
    if saved is None:
        raise CheckpointError(f"checkpoint {iteration_directory(args.load, iteration)} holds no learning-rate schedule "
                              f"(saved without the optimizer, --no-save-optim): pass --no-load-optim to take only "
                              f"its weights")
    return saved


def _load_distributed(args: argparse.Namespace, iteration: int, saved_args: Optional[argparse.Namespace], model,
                      optimizer, scheduler) -> int:
    """Collective: every rank reads its layout's share; any failure is raised on every rank."""
    directory = iteration_directory(args.load, iteration)
    error, saved_scheduler, rng_restored = None, None, False
    try:
        saved_scheduler, rng_restored = dist_checkpoint.load(args, directory, iteration, saved_args, model, optimizer,
                                                             scheduler)
        _unshare_step_counters(optimizer)
    except (CheckpointingException, CheckpointException, RuntimeError, KeyError, ValueError, AssertionError, OSError,
            EOFError) as cause:
        error = CheckpointError(
            f"cannot load checkpoint {directory} into this run's model and optimizer: {_cause(cause)}. The checkpoint "
            f"is damaged, or was written for another model: resume with the flags that wrote it (its "
            f"{checkpoint_record.METADATA_FILE} lists them), or from an earlier checkpoint by writing its iteration "
            f"into {Path(args.load) / TRACKER_FILE}")
    _raise_if_any_rank_failed(error, f"loading {args.load}", args.device)
    if saved_scheduler is not None:
        scheduler.load_state_dict(saved_scheduler)
    if not args.no_load_rng and not rng_restored:
        print_rank_0(f"--load {args.load}: the checkpoint was written at other tensor- or pipeline-parallel sizes; "
                     f"its random states belong to those ranks and are not restored (dropout draws afresh)")
    return iteration


def _restore(args: argparse.Namespace, state: dict, model, optimizer) -> bool:
    """Weights and optimizer state into this run's objects (local: no collective). Returns whether the
    distributed optimizer's main weights must still be gathered into the model (see ``optimizer_state``)."""
    model_states = state["model"]
    distributed = bool(_distributed_optimizers(optimizer))
    saved_optimizer, gather = state["optimizer"], False
    if not distributed:
        if args.no_load_optim:
            optimizer_state.main_weights_into(saved_optimizer, model_states, model, optimizer)
        else:
            saved_optimizer = optimizer_state.convert_local(saved_optimizer, model_states, optimizer,
                                                            model) or saved_optimizer
    elif not args.no_load_optim:
        retagged = optimizer_state.retag_distributed(state["distributed_optimizer"], optimizer)
        gather = retagged and not (args.bf16 or args.fp16)
    for chunk, chunk_state in zip(model, model_states, strict=True):
        unwrap(chunk).load_state_dict(chunk_state)
    if args.no_load_optim:
        optimizer.reload_model_params()
        return False
    optimizer.load_state_dict(saved_optimizer)
    _unshare_step_counters(optimizer)
    with torch.no_grad():  # fp32 main params are views of the (grad-requiring) model params
        for part, part_state in zip(_distributed_optimizers(optimizer), state["distributed_optimizer"], strict=True):
            part.load_parameter_state_from_dp_reshardable(_mark_no_padding(part_state))
    return gather
