"""Megatron-LM's training package (``megatron.training``, ``pretrain_gpt.py``) for the tests that use it.

Only megatron-core is on the package registry, so the tree comes from a folder, the first of:

1. ``MEGATRON_LM_PATH``: a user's own checkout;
2. ``../shared/megatron-lm/`` beside this repository (what developers and CI have): the tree of the
   installed megatron-core's tag (``core_v0.19.2``), else the newest tag of its minor release.

Tests marked ``megatron_lm`` skip when neither exists, unless ``ASCENDSPEED_REQUIRE_MEGATRON_LM=1`` (CI sets
it), where they fail instead: a CI run that silently skipped Megatron-LM would test less than it says.
A tree whose tag is of another minor release than the installed megatron-core fails the tests too.
"""
from __future__ import annotations

import os
import re
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Optional

REPOSITORY = Path(__file__).resolve().parents[2]
#: The Megatron-LM trees beside the checkout, one folder per tag (``core_v0.15.3``, ...).
SHARED_TREES = REPOSITORY.parent / "shared" / "megatron-lm"
REQUIRE_VARIABLE = "ASCENDSPEED_REQUIRE_MEGATRON_LM"


def minor_release(release: str) -> str:
    return ".".join(release.split(".")[:2])


def tree_for_release(trees: Path, release: str) -> Optional[Path]:
    """``trees/core_v<release>``, else the newest ``core_v<major.minor>.N`` in ``trees``, else None."""
    if not trees.is_dir():
        return None
    exact = trees / f"core_v{release}"
    if exact.is_dir():
        return exact
    pattern = re.compile(rf"^core_v{re.escape(minor_release(release))}\.(\d+)$")
    candidates = sorted((int(m.group(1)), path) for path in trees.iterdir() if (m := pattern.match(path.name)))
    return candidates[-1][1] if candidates else None


def installed_megatron_core() -> Optional[str]:
    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return None


def tree_tag(tree: Path) -> Optional[str]:
    """The tag a tree was taken from (its ``SOURCE`` file, else its folder name), e.g. ``core_v0.19.0``."""
    source = tree / "SOURCE"
    if source.is_file():
        words = source.read_text().split()
        if words:
            return words[0]
    return tree.name if tree.name.startswith("core_v") else None


def find_megatron_lm() -> Optional[str]:
    explicit = os.environ.get("MEGATRON_LM_PATH")
    if explicit:
        return explicit
    release = installed_megatron_core()
    tree = tree_for_release(SHARED_TREES, release) if release else None
    return str(tree) if tree else None


MEGATRON_LM_PATH = find_megatron_lm()


def unusable_reason() -> Optional[str]:
    """Why the Megatron-LM tests cannot run here, or None when they can."""
    if MEGATRON_LM_PATH is None:
        return (f"no Megatron-LM tree: set MEGATRON_LM_PATH to a checkout, or put the trees in {SHARED_TREES}")
    tree = Path(MEGATRON_LM_PATH)
    if not (tree / "megatron" / "training").is_dir() or not (tree / "pretrain_gpt.py").is_file():
        return f"MEGATRON_LM_PATH={MEGATRON_LM_PATH} holds no megatron/training and pretrain_gpt.py"
    tag, release = tree_tag(tree), installed_megatron_core()
    if tag and release and minor_release(tag.removeprefix("core_v")) != minor_release(release):
        return (f"MEGATRON_LM_PATH={MEGATRON_LM_PATH} is Megatron-LM {tag}, but megatron-core {release} is "
                f"installed: use a core_v{minor_release(release)}.x tree")
    return None


def add_megatron_lm_to_path() -> None:
    """Make ``megatron.training`` importable from the tree, for the rest of this process.

    The tree goes *last* on ``sys.path``: ``megatron`` is a namespace package, so its ``training``
    joins the installed megatron-core's ``megatron.core`` (the release under test, not the tree's
    copy), and the tree's own top-level ``tests`` package cannot shadow this repository's (worker
    processes unpickle ``tests.helpers`` functions by name).
    """
    if MEGATRON_LM_PATH not in sys.path:
        sys.path.append(MEGATRON_LM_PATH)
