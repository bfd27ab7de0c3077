"""Run a check script under a narrower CPU instruction set than this machine's widest.

torch (and ascendspeed's per-ISA kernels) pick the instruction set from ``ATEN_CPU_CAPABILITY``, read once
at start-up, so each set runs in a fresh interpreter. ``script`` is formatted with ``tests`` (the tests
directory, for ``sys.path``) and ``isa``; it prints ``unsupported <isa>`` when this CPU cannot run that set,
else ``ok <isa>`` after its checks.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check_under_isa(script: str, isa: str, timeout: float = 120) -> None:
    """Run ``script`` with ``ATEN_CPU_CAPABILITY=isa``; fail on an error, skip where the CPU lacks ``isa``."""
    root = os.path.dirname(TESTS)
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, ATEN_CPU_CAPABILITY=isa.lower(), PYTHONPATH=path)
    done = subprocess.run(
        [sys.executable, "-c", script.format(tests=TESTS, isa=isa)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    if done.stdout.startswith("unsupported"):
        pytest.skip(f"this CPU cannot run {isa} kernels ({done.stdout.strip()})")
    assert done.stdout.strip() == f"ok {isa}"


def assert_vectorized_and_multi_threaded(kernel: str, reference: str) -> None:
    """``kernel`` (an operator's ``_<op>_cpu_kernel()`` report, "AVX512, multi-threaded") runs on several
    threads and on the instruction set of ``reference``, another operator's report."""
    assert "multi-threaded" in kernel, f"{kernel}: add -fopenmp to the extension's compile and link flags"
    assert kernel.split(",")[0] == reference.split(",")[0]
