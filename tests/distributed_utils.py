"""Run a test body on N real processes joined by a gloo process group.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh processes (spawn), initialises
``torch.distributed`` with gloo in each, calls ``fn(rank, world_size, *args)`` and returns the list of
per-rank return values (which must be picklable: move tensors to CPU). An exception in any rank fails
the caller with that rank's traceback.
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, fn, args, result_dir):
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
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        outcome["value"] = fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        outcome["error"] = f"rank {rank}:\n{traceback.format_exc()}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(outcome, os.path.join(result_dir, f"rank{rank}.pt"))


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results."""
    with tempfile.TemporaryDirectory() as result_dir:
        context = mp.start_processes(
            _worker,
            args=(world_size, _free_port(), fn, args, result_dir),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise AssertionError(f"distributed test did not finish within {timeout:.0f} s (hang?)")
        outcomes = [torch.load(os.path.join(result_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
    errors = [o["error"] for o in outcomes if "error" in o]
    if errors:
        raise AssertionError("distributed test failed\n" + "\n".join(errors))
    return [o["value"] for o in outcomes]
