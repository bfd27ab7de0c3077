"""Megatron-LM's training package for the tests that use it (a checkout named by ``MEGATRON_LM_PATH``)."""
from __future__ import annotations

import os
import sys

MEGATRON_LM_PATH = os.environ.get("MEGATRON_LM_PATH")


def add_megatron_lm_to_path() -> None:
    """Make ``megatron.training`` importable from the checkout, for the rest of this process.

    The checkout goes *last* on ``sys.path``: ``megatron`` is a namespace package, so its ``training``
    joins the installed megatron-core's ``megatron.core`` (the release under test, not the checkout's
    copy), and the checkout's own top-level ``tests`` package cannot shadow this repository's (worker
    processes unpickle ``tests.helpers`` functions by name).
    """
    if MEGATRON_LM_PATH not in sys.path:
        sys.path.append(MEGATRON_LM_PATH)
