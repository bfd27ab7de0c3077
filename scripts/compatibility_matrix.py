#!/usr/bin/env python3
"""Run the test suite against every supported megatron-core minor release and write docs/compatibility.md.

    python3 scripts/compatibility_matrix.py [--releases 0.15.3 0.19.2] [--venvs .venvs]
                                            [--megatron-lm DIR] [--output docs/compatibility.md]

For each release it builds (or reuses: ``scripts/bootstrap.sh`` is quick when nothing changed) one virtual
environment ``<venvs>/mcore-<major.minor>``, with Python 3.12 for megatron-core 0.17 and newer (which
require it) and Python 3.11 for older releases, runs ``pytest tests`` there and records what each test
did. ``--megatron-lm DIR`` (or ``MEGATRON_LM_TREES``; default ``../shared/megatron-lm``) names a folder
holding Megatron-LM trees named after their tags (``core_v0.16.1``, ``core_v0.19.0``, ...): the release's
own tag, or else the newest tag of its minor release, becomes ``MEGATRON_LM_PATH`` so the Megatron-LM tests
run too (required: with a tree a skipped Megatron-LM test fails; without one they skip). The table counts passed / failed (failures and errors) / skipped tests per feature.
Exit status: 0 when no test failed anywhere.
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.helpers.megatron_lm import REQUIRE_VARIABLE, SHARED_TREES, tree_for_release  # noqa: E402
#: The newest patch release of each supported minor release.
RELEASES = ("0.15.3", "0.16.1", "0.17.1", "0.18.2", "0.19.2")

#: Table columns: a feature and the test modules (dotted, from the repository root) that exercise it.
#: A test module listed nowhere is counted under its directory's name.
FEATURES = (
    ("ALiBi", ("tests.features.test_alibi", "tests.ops.test_alibi_ops", "tests.ops.test_alibi_attention",
               "tests.ops.test_subnormals")),
    ("fused SwiGLU", ("tests.features.test_fused_swiglu", "tests.ops.test_swiglu")),
    ("async DDP", ("tests.features.test_async_ddp",)),
    ("sequence parallel, fused RMSNorm / RoPE", ("tests.features.test_sequence_parallel", "tests.ops.test_rms_norm",
                                                 "tests.ops.test_rotary")),
    ("context parallel", ("tests.features.test_context_parallel_attention",
                          "tests.features.test_context_parallel_feature", "tests.features.test_context_parallel_gpt",
                          "tests.features.test_context_parallel_npu")),
    ("reuse-fp32-param", ("tests.features.test_reuse_fp32_param", "tests.training.test_memory_account",
                          "tests.ops.test_bf16_split")),
    ("operator safety", ("tests.ops.test_operator_safety",)),
    ("CPU / gloo backend", ("tests.accelerator.test_cpu_shims", "tests.accelerator.test_device_selection",
                            "tests.accelerator.test_megatron_core_on_cpu")),
    ("Megatron-LM integration", ("tests.accelerator.test_megatron_lm_on_cpu", "tests.integration")),
    ("patching + adaptor", ("tests.patching", "tests.adaptor")),
    ("training entry", ("tests.training",)),
)


def python_version_for(release: str) -> str:
    minor = tuple(int(part) for part in release.split(".")[:2])
    return "3.12" if minor >= (0, 17) else "3.11"


def megatron_lm_tree(trees: Path | None, release: str) -> Path | None:
    """The tree of the release's tag, else of the newest tag of its minor release, or None."""
    return tree_for_release(trees, release) if trees is not None else None


def feature_of(classname: str) -> str:
    for feature, modules in FEATURES:
        if any(classname == module or classname.startswith(module + ".") for module in modules):
            return feature
    parts = classname.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


def outcome_of(testcase: ElementTree.Element) -> str:
    if testcase.find("failure") is not None or testcase.find("error") is not None:
        return "failed"
    if testcase.find("skipped") is not None:
        return "skipped"
    return "passed"


def run(command, **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(str(part) for part in command), flush=True)
    return subprocess.run(command, cwd=ROOT, **kwargs)


def test_release(release: str, venvs: Path, trees: Path | None, results: Path, pytest_args: list[str],
                 setup: bool = True) -> dict:
    major_minor = ".".join(release.split(".")[:2])
    venv = venvs / f"mcore-{major_minor}"
    environment = dict(os.environ, VENV=str(venv), MEGATRON_CORE=release,
                       PYTHON_VERSION=python_version_for(release))
    environment.pop("PYTHON", None)
    started = time.monotonic()
    built = run(["bash", "scripts/bootstrap.sh"], env=environment) if setup else subprocess.CompletedProcess([], 0)
    setup_seconds = time.monotonic() - started
    record = {"release": release, "venv": venv, "setup_seconds": setup_seconds, "counts": {}, "failures": []}
    if built.returncode != 0:
        record["error"] = f"scripts/bootstrap.sh failed (exit {built.returncode})"
        return record
    python = venv / "bin" / "python"
    record["python"] = subprocess.run(
        [python, "-c", "import sys, torch; print(sys.version.split()[0], torch.__version__)"],
        capture_output=True, text=True).stdout.strip()
    tree = megatron_lm_tree(trees, release)
    test_environment = dict(os.environ)
    test_environment.pop("MEGATRON_LM_PATH", None)
    if tree is not None:
        test_environment["MEGATRON_LM_PATH"] = str(tree)
        test_environment[REQUIRE_VARIABLE] = "1"
        record["megatron_lm"] = tree.name
    junit = results / f"junit-{release}.xml"
    started = time.monotonic()
    run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", "tests", *pytest_args],
        env=test_environment)
    record["test_seconds"] = time.monotonic() - started
    if not junit.exists():
        record["error"] = "pytest wrote no report"
        return record
    for testcase in ElementTree.parse(junit).getroot().iter("testcase"):
        classname = testcase.get("classname", "")
        outcome = outcome_of(testcase)
        counts = record["counts"].setdefault(feature_of(classname), {"passed": 0, "failed": 0, "skipped": 0})
        counts[outcome] += 1
        if outcome == "failed":
            record["failures"].append(f"{classname}::{testcase.get('name')}")
    return record


def cell(counts: dict | None) -> str:
    if not counts:
        return "–"
    return f"{counts['passed']} / {counts['failed']} / {counts['skipped']}"


def write_report(records: list[dict], output: Path) -> None:
    columns = [feature for feature, _ in FEATURES]
    for record in records:
        columns += [feature for feature in record["counts"] if feature not in columns]
    lines = [
        "# Compatibility: megatron-core releases x features",
        "",
        f"Written by `scripts/compatibility_matrix.py` on {datetime.date.today().isoformat()}: the whole test "
        "suite run once per megatron-core release, each in its own virtual environment (torch 2.13.0; Python "
        "3.12 for megatron-core 0.17 and newer, which require it, Python 3.11 before). Each cell counts the "
        "tests it saw: **passed / failed / skipped** (errors count as failed). Megatron-LM tests run against "
        "the Megatron-LM tag in the last column and are skipped where there is none.",
        "",
        "| megatron-core | " + " | ".join(columns) + " | total | Python, torch | Megatron-LM | minutes (set-up + tests) |",
        "|---" * (len(columns) + 5) + "|",
    ]
    for record in records:
        total = {"passed": 0, "failed": 0, "skipped": 0}
        for counts in record["counts"].values():
            for key in total:
                total[key] += counts[key]
        minutes = f"{record['setup_seconds'] / 60:.1f} + {record.get('test_seconds', 0) / 60:.1f}"
        row = [record["release"], *(cell(record["counts"].get(column)) for column in columns), cell(total),
               record.get("python", "?"), record.get("megatron_lm", "none"), minutes]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Features: " + "; ".join(
        f"**{feature}**: " + ", ".join(f"`{module}`" for module in modules) for feature, modules in FEATURES
    ) + ".", ""]
    for record in records:
        if record.get("error"):
            lines.append(f"- megatron-core {record['release']}: {record['error']}")
        if record["failures"]:
            lines.append(f"- megatron-core {record['release']}, failed:")
            lines += [f"  - `{name}`" for name in record["failures"]]
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {output}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--releases", nargs="+", default=list(RELEASES), help="megatron-core versions to test")
    parser.add_argument("--venvs", type=Path, default=ROOT / ".venvs", help="where the environments live")
    parser.add_argument("--megatron-lm", type=Path, default=os.environ.get("MEGATRON_LM_TREES", SHARED_TREES),
                        help="folder of Megatron-LM trees named core_v<version> (default: ../shared/megatron-lm)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "compatibility.md")
    parser.add_argument("--no-setup", dest="setup", action="store_false",
                        help="use the environments under --venvs as they are (ascendspeed importable there, e.g. "
                        "through PYTHONPATH and in-place builds) instead of running scripts/bootstrap.sh")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    results = args.venvs / "results"
    results.mkdir(parents=True, exist_ok=True)
    trees = Path(args.megatron_lm) if args.megatron_lm else None
    records = [test_release(release, args.venvs.resolve(), trees, results, args.pytest_args, args.setup)
               for release in args.releases]
    write_report(records, args.output)
    return 0 if all(not record["failures"] and not record.get("error") for record in records) else 1


if __name__ == "__main__":
    sys.exit(main())
