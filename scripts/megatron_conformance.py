#!/usr/bin/env python3
"""Run Megatron's own unit tests on this machine with nothing but ``import ascendspeed.megatron_adaptor`` added,
and write docs/conformance.md.

    python scripts/megatron_conformance.py [--megatron-lm DIR] [--processes 8] [--timeout 300]
                                           [--output docs/conformance.md] [--store docs/conformance.json]
                                           [PATH ...]

``DIR`` (default ``MEGATRON_LM_PATH``, else ``../shared/megatron-lm/core_v0.19.0``) is a Megatron-LM checkout
with ``tests/unit_tests``; ``PATH`` are test files or directories under it (default: the suites named in
``SUITES``). Each test file runs as one ``pytest -p ascendspeed.megatron_adaptor`` session per process (the
adaptor imported before Megatron's conftest: the only change), so memory stays bounded and a hang or crash
costs only its file. Megatron's harness reads ``WORLD_SIZE`` / ``LOCAL_RANK`` and meets at ``MASTER_ADDR`` /
``MASTER_PORT``; its tests ask for model-parallel sizes up to 8 (Megatron's CI runs them on 8 GPUs), so the
default is 8 processes, over gloo on the CPU. Each rank writes its own JUnit report: rank 0's is counted, with
a test that failed on another rank counted as failed. Needs Megatron's test dependencies (``click``,
``requests``, ``pytest-mock``: ``pip install click requests pytest-mock``). Nothing of Megatron's tests is edited
or patched by name.

A rank the kernel's out-of-memory killer takes is named in its file's note (the other ranks, waiting for it in a
collective, are stopped a minute later instead of at the timeout).

For every test that does not pass, the reason is classified from its message (``REASONS``: a CUDA-only
kernel, Transformer Engine, fp8, CUDA graphs, ...); what no rule names is listed as "not classified".
Every outcome is kept in ``--store`` (JSON): a run replaces the results of the files it ran and keeps the
others, and the markdown shows them all, so suites can be run (and re-run after a fix) one at a time.
Exit status 0 unless a file could not run at all.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Seconds the other ranks get to finish after one was killed for memory (they wait for it in a collective).
KILLED_RANK_GRACE_S = 60
DEFAULT_TREE = ROOT.parent / "shared" / "megatron-lm" / "core_v0.19.0"
#: The suites the conformance target starts with (tests/unit_tests/...).
SUITES = ("transformer", "models", "tensor_parallel", "pipeline_parallel", "distributed", "dist_checkpointing",
          "optimizer")

#: (reason, pattern on the message of a test that did not pass), first match wins.
REASONS = (
    # A Megatron-FSDP DTensor of an earlier test's model-parallel state names a group destroyed with that state.
    # The groups of every live DeviceMesh, made or copied, are kept (docs/megatron-lm-on-cpu.md): this is ours.
    ("open in ascendspeed: a group a DeviceMesh still names, destroyed with its model-parallel state",
     r"^RuntimeError: Could not resolve the process group registered under the name"),
    # test_grad_sync_with_expert_parallel sets its expected expert gradient only when ep_size > 1, while experts
    # with ETP != TP reduce over expert groups at EP 1 too (TE's wrapper agrees): an UnboundLocalError anywhere
    ("a bug in Megatron's test (fails on GPUs too)", r"local variable 'ep_expected_grad_data_value_after_collective'"),
    # test_safe_globals saves into the shared checkpoint folder without a process group: no barrier makes the other
    # ranks wait until rank 0 (the conftest fixture) has created the folder, so a late rank 0 fails them anywhere
    ("a race in Megatron's test (fails on GPUs too when rank 0 is late)",
     r"Parent directory \S*tmp_dist_ckpt does not exist"),
    ("needs more processes", r"is not divisible by|world.?size \(\d+\)|requires \d+ (?:GPUs|ranks|processes)"),
    ("needs Transformer Engine", r"transformer.?engine|\bTE\b|transformer_engine|te_version|is_te_min_version"),
    ("fp8 / fp4 (CUDA hardware formats)", r"\bfp8\b|FP8|fp4|FP4|nvfp4|mxfp8"),
    ("CUDA graphs", r"cuda.?graph|CudaGraph|graph capture"),
    ("needs apex", r"\bapex\b"),
    ("needs flash-attn", r"flash.?attn|flash attention"),
    ("needs fla (triton kernels)", r"FLA is not installed|flash-linear-attention|\bfla\b"),
    ("needs Mamba / causal-conv1d kernels", r"mamba_ssm|causal_conv1d|mamba"),
    ("needs triton (CUDA kernels)", r"triton"),
    ("needs NCCL-only features", r"nccl|NCCL|symmetric memory|nvshmem|DeepEP|HybridEP"),
    ("needs a CUDA device", r"cuda|CUDA|NVIDIA driver|GPU|nvcc|device_count|is_available\(\)"),
    ("needs test data (/opt/data)", r"/opt/data|download"),
    # megatron.core.models.huggingface.module imports transformers' AutoConfig / AutoModel only where transformers
    # is installed, and tests patch those names there
    ("needs an optional package",
     r"No module named|ModuleNotFoundError|ImportError|has no attribute 'Auto(?:Config|Model)'"),
)
#: (reason, pattern on the test's name, pattern on its message): for failures whose message alone says nothing
#: (a bare assert), checked before ``REASONS``.
REASONS_BY_TEST = (
    # without tilelang, Megatron's DSA indexer module defines its tilelang entry points as None
    ("needs tilelang (CUDA kernels)", r"test_dsa_tilelang_kernels", r"'NoneType' object is not callable"),
    # get_pg_size() is 1 while torch.distributed is not initialized, so the all-reduce under test is never called;
    # the file initializes it only in earlier tests that need CUDA (skipped here), so alone it fails on GPUs too
    ("a test-order dependency in Megatron's test (needs torch.distributed initialized by an earlier CUDA-only test)",
     r"test_dsa_native_parity::test_cudnn_sparse_loss_reduces_attention_target_across_tp$", r"assert 0 == 1"),
    # storage.resize_(0) then resize_(n) must return the old address: CUDA's caching allocator hands the freed block
    # back, a CPU allocator promises nothing of the kind
    ("needs the CUDA caching allocator (a freed block back at its old address)",
     r"test_dbuffer::test_release_and_reallocate_storage_preserves_buffer_views$", r"assert \d+ == \d+"),
)


@dataclass
class Outcome:
    test: str
    status: str  # passed, failed, skipped
    message: str = ""
    reason: str = ""


@dataclass
class FileResult:
    path: str
    processes: int
    seconds: float
    outcomes: list[Outcome] = field(default_factory=list)
    crashed: str = ""  # the file did not report: timeout, crash before the report

    def counts(self) -> collections.Counter:
        return collections.Counter(outcome.status for outcome in self.outcomes)


def classify(message: str, test: str = "") -> str:
    for reason, test_pattern, pattern in REASONS_BY_TEST:
        if re.search(test_pattern, test) and re.search(pattern, message):
            return reason
    for reason, pattern in REASONS:
        if re.search(pattern, message):
            return reason
    return "not classified"


def _reason(outcome: Outcome) -> str:
    """The stored reason, or, for one no rule named when it ran, what today's rules make of its message."""
    return classify(outcome.message, outcome.test) if outcome.reason == "not classified" else outcome.reason


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _read_report(path: Path) -> dict[str, Outcome]:
    """Every test case of a JUnit report by name; a test reported twice (its call and its teardown) keeps
    the worse outcome."""
    outcomes = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        # a file that failed to import is reported as a case without a class, named after its module
        name = f"{case.get('classname')}::{case.get('name')}" if case.get("classname") else case.get("name", "")
        status, summary, details = "passed", "", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status, summary, details = "failed", child.get("message", ""), child.text or ""
                break
            if child.tag == "skipped":
                status, summary, details = "skipped", child.get("message", ""), child.text or ""
        first_line = next((line for line in f"{summary}\n{details}".strip().splitlines() if line.strip()), "")
        reason = ""
        if status != "passed":  # the exception's own line decides; the traceback only when it names nothing
            reason = classify(summary, name)
            reason = classify(details, name) if reason == "not classified" else reason
        outcome = Outcome(name, status, first_line[:300], reason)
        if name not in outcomes or outcomes[name].status == "passed" or status == "failed":
            outcomes[name] = outcome
    return outcomes


def _wait_for_ranks(processes: list, deadline: float, timeout: float) -> str:
    """Wait for every rank; what went wrong, or "". A rank killed by SIGKILL that this script did not kill was
    taken by the kernel's out-of-memory killer: the others then wait in a collective for it, so they get
    ``KILLED_RANK_GRACE_S`` to finish before they are stopped too."""
    killed: list[int] = []
    while any(process.poll() is None for process in processes):
        if time.perf_counter() > deadline:
            for process in processes:
                process.kill()
            for process in processes:
                process.wait()
            if killed:
                break
            return f"timed out after {timeout:.0f} s"
        if not killed:
            killed = [rank for rank, process in enumerate(processes) if process.returncode == -signal.SIGKILL]
            if killed:
                deadline = min(deadline, time.perf_counter() + KILLED_RANK_GRACE_S)
        time.sleep(0.5)
    killed = killed or [rank for rank, process in enumerate(processes) if process.returncode == -signal.SIGKILL]
    if killed:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        return (f"out of memory: rank(s) {', '.join(map(str, killed))} killed by the kernel ({len(processes)} ranks "
                f"in {memory:.0f} GiB)")
    return ""


def _run_session(tree: Path, targets: list[str], processes: int, timeout: float):
    """One pytest session per rank on ``targets``; returns (rank 0's outcomes with the failures of other ranks
    put in, or None when rank 0 wrote no report; seconds; what went wrong)."""
    with tempfile.TemporaryDirectory() as scratch:
        environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(ROOT)]), WORLD_SIZE=str(processes),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1",
                           ASCENDSPEED_DEVICE=os.environ.get("ASCENDSPEED_DEVICE", "cpu"))
        ranks, start = [], time.perf_counter()
        for rank in range(processes):
            report, log = Path(scratch) / f"rank{rank}.xml", Path(scratch) / f"rank{rank}.log"
            # Each rank's own base folder under this session's scratch: Megatron's shared checkpoint folder
            # (``tmp_path_dist_ckpt``, beside the base folder) is then the session's, and no other pytest session
            # on the machine prunes it as one of its old numbered folders.
            command = [sys.executable, "-m", "pytest", "-p", "ascendspeed.megatron_adaptor", "-p", "no:cacheprovider",
                       "-q", "--continue-on-collection-errors", f"--junitxml={report}", "--rootdir", str(tree),
                       f"--basetemp={Path(scratch) / f'rank{rank}'}", *targets]
            with open(log, "w") as output:
                ranks.append((report, log, subprocess.Popen(
                    command, cwd=tree, env=dict(environment, RANK=str(rank), LOCAL_RANK=str(rank)), stdout=output,
                    stderr=subprocess.STDOUT, text=True)))
        problem = _wait_for_ranks([process for _, _, process in ranks], start + timeout, timeout)
        logs = [log.read_text(errors="replace") for _, log, _ in ranks]
        seconds = time.perf_counter() - start
        reports = [report for report, _, _ in ranks]
        if not reports[0].exists():
            tail = " | ".join((logs[0] or "").strip().splitlines()[-3:])[:300]
            return None, seconds, problem or f"no report: {tail}"
        outcomes = _read_report(reports[0])
        for report in reports[1:]:
            if report.exists():
                failed = {test: outcome for test, outcome in _read_report(report).items() if outcome.status == "failed"}
                outcomes = {test: failed.get(test, outcome) if outcome.status == "passed" else outcome
                            for test, outcome in outcomes.items()}
        return outcomes, seconds, problem


def run(tree: Path, test_file_groups: dict[str, list[Path]], processes: int, timeout: float,
        report=lambda results: None) -> list[FileResult]:
    """Each test file in sessions of its own: memory stays bounded (8 processes of a whole suite outgrow 24 GiB)
    and a hang or crash costs only its file. ``report(results)`` after each file: an interrupted run keeps
    what it measured."""
    results = []
    for files in test_file_groups.values():
        for path in files:
            target = str(path.relative_to(tree))
            result = _file_result(*_run_session(tree, [target], processes, timeout), target, processes)
            counts = result.counts()
            print(f"{result.path} [{processes}]: {counts['passed']} passed, {counts['failed']} failed, "
                  f"{counts['skipped']} skipped, {result.seconds:.0f} s {result.crashed}", flush=True)
            results.append(result)
            report(results)
    return results


def _file_result(outcomes, seconds, problem, target, processes) -> FileResult:
    result = FileResult(target, processes, seconds, outcomes=list((outcomes or {}).values()), crashed=problem)
    if outcomes is not None and not outcomes and not problem:
        result.crashed = "collected no test"
    return result


def test_file_groups(tree: Path, paths: list[str]) -> dict[str, list[Path]]:
    """The test files under each of ``paths`` (directories or files, from the tree or from tests/unit_tests)."""
    groups = {}
    for path in paths:
        target = tree / "tests" / "unit_tests" / path if not (tree / path).exists() else tree / path
        if target.is_dir():
            groups[path] = sorted(target.rglob("test_*.py"))
        elif target.exists():
            groups[path] = [target]
        else:
            raise SystemExit(f"{path}: no such test file or directory under {tree}")
    return groups


def _suite_of(path: str) -> str:
    parts = Path(path).parts
    return "/".join(parts[2:4]) if len(parts) > 4 else parts[2] if len(parts) > 3 else "(top level)"


def load_store(path: Path) -> list[FileResult]:
    if not path.exists():
        return []
    return [FileResult(**{**entry, "outcomes": [Outcome(**outcome) for outcome in entry["outcomes"]]})
            for entry in json.loads(path.read_text())]


def write_markdown(results: list[FileResult], tree: Path, output: Path) -> None:
    import platform

    import torch

    megatron_core = subprocess.run([sys.executable, "-c", "import megatron.core; print(megatron.core.__version__)"],
                                   capture_output=True, text=True).stdout.strip()
    source = (tree / "SOURCE").read_text().strip() if (tree / "SOURCE").exists() else tree.name
    cpu_model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), platform.processor() or "unknown CPU") \
        if Path("/proc/cpuinfo").exists() else platform.processor() or "unknown CPU"
    lines = [
        "# Megatron's own unit tests on a CPU",
        "",
        "Generated by `python scripts/megatron_conformance.py` (do not edit by hand): Megatron-LM's",
        "`tests/unit_tests`, run unchanged with `pytest -p ascendspeed.megatron_adaptor` (the adaptor imported",
        "before Megatron's conftest; nothing of the tests edited or patched by name), one pytest session per test",
        "file and process, the processes meeting over gloo where Megatron's harness asks for NCCL (8 processes:",
        "the model-parallel sizes its tests use).",
        "",
        f"Tree: `{source}`; megatron-core {megatron_core}, torch {torch.__version__}, Python "
        f"{platform.python_version()}; {cpu_model}, {os.cpu_count()} logical CPUs; last run "
        f"{datetime.date.today().isoformat()}; {sum(result.seconds for result in results) / 60:.0f} minutes of runs in all.",
        "",
        "## Per suite",
        "",
        "| suite | processes | files | passed | failed | skipped | files that did not report |",
        "|---|---|---|---|---|---|---|",
    ]
    by_suite = collections.defaultdict(list)
    for result in results:
        by_suite[_suite_of(result.path), result.processes].append(result)
    for (suite, processes), group in sorted(by_suite.items()):
        counts = sum((result.counts() for result in group), collections.Counter())
        crashed = sum(1 for result in group if result.crashed)
        lines.append(f"| {suite} | {processes} | {len(group)} | {counts['passed']} | {counts['failed']} | "
                     f"{counts['skipped']} | {crashed} |")
    lines += ["", "## Why the tests that do not pass do not", "",
              "| reason | processes | failed | skipped |", "|---|---|---|---|"]
    reasons = collections.Counter()
    for result in results:
        for outcome in result.outcomes:
            if outcome.status != "passed":
                reasons[_reason(outcome), result.processes, outcome.status] += 1
    for reason, processes in sorted({(reason, processes) for reason, processes, _ in reasons}):
        lines.append(f"| {reason} | {processes} | {reasons[reason, processes, 'failed']} | "
                     f"{reasons[reason, processes, 'skipped']} |")
    lines += ["", "## Per file", "",
              "| file | processes | passed | failed | skipped | seconds | note |", "|---|---|---|---|---|---|---|"]
    for result in sorted(results, key=lambda result: (result.path, result.processes)):
        counts = result.counts()
        lines.append(f"| `{result.path}` | {result.processes} | {counts['passed']} | {counts['failed']} | "
                     f"{counts['skipped']} | {result.seconds:.0f} | {result.crashed.replace('|', '/')} |")
    lines += ["", "## Every failed test, with the first line of its message", ""]
    for result in sorted(results, key=lambda result: (result.path, result.processes)):
        for outcome in result.outcomes:
            if outcome.status == "failed":
                message = outcome.message.replace("|", "/").replace("`", "'")
                lines.append(f"- {result.processes} process(es) `{outcome.test}`: {_reason(outcome)}: {message}")
    output.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=list(SUITES))
    parser.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM_PATH", str(DEFAULT_TREE)))
    parser.add_argument("--processes", type=int, nargs="+", default=[8],
                        help="process counts to run at (Megatron's CI: 8, its tests' model-parallel sizes need it)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per test file")
    parser.add_argument("--output", default=str(ROOT / "docs" / "conformance.md"))
    parser.add_argument("--store", default=str(ROOT / "docs" / "conformance.json"),
                        help="every outcome, kept across runs (a run replaces the files it ran)")
    options = parser.parse_args()
    tree = Path(options.megatron_lm).resolve()
    if not (tree / "tests" / "unit_tests").is_dir():
        raise SystemExit(f"{tree} has no tests/unit_tests: pass --megatron-lm with a Megatron-LM checkout")
    results = []
    groups = test_file_groups(tree, options.paths)
    store = Path(options.store)
    rerun = {(str(path.relative_to(tree)), processes) for files in groups.values() for path in files
             for processes in options.processes}
    kept = [result for result in load_store(store) if (result.path, result.processes) not in rerun]

    def report(new_results):
        measured = kept + results + new_results
        write_markdown(measured, tree, Path(options.output))
        store.write_text(json.dumps([asdict(result) for result in measured], indent=1) + "\n")

    for processes in options.processes:
        results += run(tree, groups, processes, options.timeout, report)
    return 1 if any(result.crashed and not result.outcomes for result in results) else 0


if __name__ == "__main__":
    sys.exit(main())
