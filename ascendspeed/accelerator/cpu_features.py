"""The CPU's instruction-set flags, for choices that depend on them (which kernel is the faster one)."""
from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags Linux's /proc/cpuinfo lists for this CPU (its first processor: they are alike); empty where
    that cannot be read."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((frozenset(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith("flags")),
                        frozenset())
    except OSError:
        return frozenset()
