"""Run a test body on N real processes joined by a gloo process group.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, initialises ``torch.distributed``
with gloo in each, calls ``fn(rank, world_size, *args)`` and returns the list of per-rank return values
(which must be picklable: move tensors to CPU). An exception in any rank fails the caller with that rank's
traceback, and the other ranks (likely blocked in a collective waiting for the failed one) are stopped a
few seconds later instead of hanging until the timeout.

Ranks are forked from a forkserver that has already imported torch, megatron-core and ascendspeed with the
adaptor installed (``tests.helpers.forkserver_preload``): a fresh interpreter spends ~6 s of CPU on those
imports, paid once per test session instead of once per rank of every job. A forked rank is as fresh as a
spawned one otherwise (nothing ran in the server but imports), and it takes the caller's environment as of
the call. ``fresh_interpreter=True`` spawns a new interpreter instead, for a body that depends on what a
module read from the environment at import.

Ranks meet through a file store in a private temporary directory, not a TCP port: a port picked free by
the parent can be taken by a concurrently running test before rank 0 binds it, which made ranks retry
connecting to a stranger until the timeout.
"""
from __future__ import annotations

import faulthandler
import os
import tempfile
import time
import traceback

import multiprocessing

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.ports import free_port


#: Seconds the other ranks get to finish after one rank failed, before they are stopped.
FAILURE_GRACE_S = 5.0


#: What the forkserver imports before it forks ranks (a module whose import installs the adaptor first).
FORKSERVER_PRELOAD = ["tests.helpers.forkserver_preload"]


def _worker(rank, world_size, port, fn, args, result_dir, environment):
    # A rank that dies of a signal (a native crash) prints every thread's Python stack to the captured stderr.
    faulthandler.enable(all_threads=True)
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        ASCENDSPEED_DEVICE=os.environ.get("ASCENDSPEED_DEVICE", "cpu"),
    )
    torch.set_num_threads(1)
    outcome = {}
    try:
        from ascendspeed.adaptor import install

        install()  # what ``import ascendspeed.megatron_adaptor`` does in a training script
        store = os.path.join(result_dir, "rendezvous")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        outcome["value"] = fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        outcome["error"] = f"rank {rank}:\n{traceback.format_exc()}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    partial = os.path.join(result_dir, f"rank{rank}.partial")
    torch.save(outcome, partial)
    os.replace(partial, os.path.join(result_dir, f"rank{rank}.pt"))


def _first_error(result_dir, world_size, succeeded):
    """The traceback of a rank that has failed so far, or None; ``succeeded`` caches ranks seen to succeed."""
    for rank in range(world_size):
        path = os.path.join(result_dir, f"rank{rank}.pt")
        if rank not in succeeded and os.path.exists(path):
            outcome = torch.load(path, weights_only=False)
            if "error" in outcome:
                return outcome["error"]
            succeeded.add(rank)
    return None


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0, fresh_interpreter: bool = False):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results."""
    if not fresh_interpreter:
        multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    with tempfile.TemporaryDirectory() as result_dir:
        context = mp.start_processes(
            _worker,
            args=(world_size, free_port(), fn, args, result_dir, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method="spawn" if fresh_interpreter else "forkserver",
        )
        deadline = time.monotonic() + timeout
        failed_at, error, succeeded = None, None, set()
        while not context.join(timeout=1.0):
            if error is None:
                error = _first_error(result_dir, world_size, succeeded)
                failed_at = time.monotonic() if error is not None else None
            if error is not None and time.monotonic() > failed_at + FAILURE_GRACE_S:
                for process in context.processes:
                    process.kill()
                raise AssertionError("distributed test failed (the other ranks were stopped)\n" + error)
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise AssertionError(f"distributed test did not finish within {timeout:.0f} s (hang?)")
        outcomes = [torch.load(os.path.join(result_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
    errors = [o["error"] for o in outcomes if "error" in o]
    if errors:
        raise AssertionError("distributed test failed\n" + "\n".join(errors))
    return [o["value"] for o in outcomes]


def _each_case(rank, world_size, fn, cases):
    return [fn(rank, world_size, *case) for case in cases]


def run_distributed_cases(fn, world_size: int, cases, timeout: float = 300.0) -> list:
    """One job for many cases: ``fn(rank, world_size, *case)`` for every case, one after the other on the same
    ``world_size`` ranks. Returns, per case in order, the list of per-rank results. Starting ranks and their
    process group costs more than most cases; a failing case fails the job, naming its rank's traceback."""
    cases = [tuple(case) for case in cases]
    per_rank = run_distributed(_each_case, world_size, fn, cases, timeout=timeout)
    return [[results[index] for results in per_rank] for index in range(len(cases))]


def call(rank, world_size, fn, *args):
    """A case of ``run_distributed_cases(call, ...)`` that names its own body: ``(fn, *args)``."""
    return fn(rank, world_size, *args)

