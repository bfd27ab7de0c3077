"""The suite runs with ``TORCH_COMPILE_DISABLE=1`` (tests/conftest.py); a job that must run Megatron's
torch.compile'd fusions as users do takes its environment from ``with_torch_compile``."""
from __future__ import annotations

import os
from typing import Mapping, Optional


def with_torch_compile(environment: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """``environment`` (default: this process's) without the suite's switch that turns torch.compile off."""
    environment = dict(os.environ if environment is None else environment)
    environment.pop("TORCH_COMPILE_DISABLE", None)
    return environment
