"""Whether an optional accelerator package's kernels import here: Transformer Engine, mamba_ssm, fla.

megatron-core tests each with ``try: import ... except ImportError``; these packages can also fail with other
errors where they are installed without their CUDA libraries or a GPU (triton), so any exception counts as absent.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util


@functools.lru_cache(maxsize=None)
def importable(module: str) -> bool:
    """Whether ``import module`` works (a missing top-level package is not imported at all)."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return False
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - CUDA packages raise more than ImportError without their libraries
        return False
    return True
