"""Megatron-LM training jobs for the tests, as ``torchrun --standalone --nproc-per-node N`` would start them.

``run_job(script, processes, args, env=..., cwd=..., timeout=...)`` returns ``(returncode, output)`` as
``subprocess.run`` of torchrun would (0 when every rank exited 0, else 1; stdout and stderr of every rank
in one text, rank 0's lines first, then rank 1's, ...). The ranks are forked by one server process per test session
(``tests.helpers.megatron_lm_server``) that has imported the adaptor and Megatron-LM once; a run through
real torchrun costs ~20 s of CPU in imports alone. ``tests/accelerator/test_megatron_lm_on_cpu.py`` keeps
real torchrun runs, so the launcher itself stays tested.
"""
from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
from typing import Mapping, Optional, Sequence

from tests.helpers.megatron_lm import MEGATRON_LM_PATH, REPOSITORY

_SERVER: Optional[subprocess.Popen] = None


def _server() -> subprocess.Popen:
    global _SERVER
    if _SERVER is not None and _SERVER.poll() is None:
        return _SERVER
    environment = {
        **os.environ,
        "ASCENDSPEED_DEVICE": "cpu",
        "OMP_NUM_THREADS": "1",
        "MEGATRON_LM_PATH": MEGATRON_LM_PATH,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")])),
    }
    _SERVER = subprocess.Popen([sys.executable, "-m", "tests.helpers.megatron_lm_server"], env=environment,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(REPOSITORY))
    ready = _SERVER.stdout.readline()
    if not ready:
        raise RuntimeError(f"the Megatron-LM job server exited ({_SERVER.wait()}) before it was ready")
    atexit.register(_stop)
    return _SERVER


def _stop() -> None:
    if _SERVER is not None and _SERVER.poll() is None:
        _SERVER.stdin.close()
        _SERVER.wait(timeout=30)


def _read_if_present(path: str) -> str:
    try:
        with open(path, errors="replace") as log:
            text = log.read()
    except FileNotFoundError:
        return ""
    return text if text.endswith("\n") or not text else text + "\n"


def run_job(script: str, processes: int, args: Sequence[str], *, env: Mapping[str, str], cwd: str,
            timeout: float = 300) -> tuple[int, str]:
    """Run ``script`` on ``processes`` ranks; ``(0 or 1, combined output)``. A job past ``timeout`` fails the
    test with its output."""
    server = _server()
    with tempfile.TemporaryDirectory() as logs:
        request = {"script": script, "processes": processes, "args": list(args), "env": dict(env), "cwd": cwd,
                   "timeout": timeout, "log": os.path.join(logs, "rank")}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        reply = server.stdout.readline()
        output = "".join(_read_if_present(f"{request['log']}.{rank}") for rank in range(processes))
    if not reply:
        raise RuntimeError(f"the Megatron-LM job server died during the job:\n{output[-6000:]}")
    result = json.loads(reply)
    if result["timed_out"]:
        raise AssertionError(f"Megatron-LM job did not finish within {timeout:.0f} s:\n{output[-6000:]}")
    return (0 if all(code == 0 for code in result["codes"]) else 1), output
