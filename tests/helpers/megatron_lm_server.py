"""A process that imports the adaptor and Megatron-LM's training package once, then forks every job's ranks.

``python -m tests.helpers.megatron_lm_server`` (started by ``tests.helpers.megatron_lm_jobs``) reads one
JSON request per line on stdin and answers one JSON line on stdout per job. A job is what
``torchrun --standalone --nproc-per-node N script args...`` runs: N ranks of ``script`` with torchrun's
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), each rank's stdout and stderr in its own log (``<log>.<rank>``: ranks
sharing one file interleave a line of one rank into an unterminated line of another), and torchrun's
failure rule: when a rank fails, the others are stopped (a job whose rank 0 lost the probed rendezvous port to
another process is started again on another). Each rank is a fork of this server, which has done nothing but
imports and torch.compile's one-time set-up, so it starts as a fresh interpreter would after
``import ascendspeed.megatron_adaptor`` and Megatron-LM's imports, without their ~8 s of CPU per rank, nor ~2 s of
its first compile.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import signal
import sys
import time
import traceback

from tests.helpers.ports import free_port

#: Seconds the other ranks get after one failed, before they are stopped (torchrun stops them at once;
#: a moment lets their last lines reach the log).
FAILURE_GRACE_S = 2.0


def _exit_code(error: SystemExit) -> int:
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def _run_rank(rank: int, request: dict, port: int) -> None:
    """The body of one forked rank; never returns."""
    code = 1
    try:
        log = os.open(f"{request['log']}.{rank}", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # the log, whatever the server's streams were
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        world_size = request["processes"]
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.chdir(request["cwd"])
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        sys.argv = [request["script"], *request["args"]]
        runpy.run_path(request["script"], run_name="__main__")
        code = 0
    except SystemExit as error:
        code = _exit_code(error)
    except BaseException:  # noqa: BLE001 - printed like an uncaught exception, as a rank of torchrun would
        traceback.print_exc()
        code = 1
    finally:
        # What a real rank's interpreter does at exit: among others, multiprocessing stops the processes the
        # rank started (torch_dist's checkpoint writer starts some); without it they outlive the job.
        try:
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


#: Times a job is started again when rank 0 could not bind the rendezvous port: it is probed free, then bound
#: by rank 0 a moment later, and another process on the machine can take it in between.
PORT_RETRIES = 3


def _lost_the_port(request: dict) -> bool:
    try:
        with open(f"{request['log']}.0", errors="replace") as log:
            return "EADDRINUSE" in log.read()
    except FileNotFoundError:
        return False


def _run_job(request: dict) -> dict:
    for _ in range(PORT_RETRIES):
        result = _run_ranks(request, free_port())
        if not any(result["codes"]) or not _lost_the_port(request):
            return result
        for rank in range(request["processes"]):
            with contextlib.suppress(FileNotFoundError):
                os.truncate(f"{request['log']}.{rank}", 0)
    return result


def _run_ranks(request: dict, port: int) -> dict:
    sys.stdout.flush()
    ranks = {}
    for rank in range(request["processes"]):
        pid = os.fork()
        if pid == 0:
            _run_rank(rank, request, port)
        ranks[pid] = rank
    codes: dict[int, int] = {}
    deadline = time.monotonic() + request["timeout"]
    failed_at = None
    timed_out = False
    while len(codes) < len(ranks):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[ranks[pid]] = os.waitstatus_to_exitcode(status)
            if codes[ranks[pid]] != 0 and failed_at is None:
                failed_at = time.monotonic()
            continue
        now = time.monotonic()
        if (failed_at is not None and now > failed_at + FAILURE_GRACE_S) or now > deadline:
            timed_out = now > deadline
            for other, rank in ranks.items():
                if rank not in codes:
                    os.kill(other, signal.SIGKILL)
            failed_at = float("inf")
        time.sleep(0.05)
    return {"codes": [codes[rank] for rank in range(len(ranks))], "timed_out": timed_out}


def _initialize_the_compiler() -> None:
    """Do torch.compile's one-time work here, not in every forked rank: importing inductor, registering its
    pattern passes, probing the CPU's vector ISA and precompiling its header with the C++ compiler. Megatron-LM's JIT
    warm-up (``set_jit_fusion_options``) took 3.1-3.6 s per rank with it, 1.5 s without. The graph is an
    inference one, compiled past the caches so that every step runs: compiling one with gradients runs the
    autograd engine, whose threads a forked child cannot use. One compile thread: a rank must not inherit the
    server's compile workers."""
    import torch

    torch._inductor.config.compile_threads = 1

    def bias_dropout_add(x, bias, residual):
        return residual + torch.nn.functional.dropout(x + bias, p=0.1, training=True)

    compiled = torch.compile(bias_dropout_add)
    with torch._inductor.config.patch(force_disable_caches=True), torch.no_grad():
        compiled(torch.rand(4, 8), torch.rand(8), torch.rand(4, 8))


def main() -> None:
    sys.path.append(os.environ["MEGATRON_LM_PATH"])
    import ascendspeed.megatron_adaptor  # noqa: F401 - first, as in a training script

    import megatron.training  # noqa: F401
    import megatron.training.arguments  # noqa: F401
    import megatron.training.training  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    _initialize_the_compiler()

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(_run_job(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
