"""``--warm-allocator`` for the operator benchmarks: rerun the script with freed memory kept for reuse.

glibc returns every buffer of 32 MiB and more to the kernel when it is freed, so each fresh output of a
large operator is new memory whose pages the kernel zeroes when they are first touched: about as much
work as writing the output itself. A GPU or NPU caching allocator, or torch's CPU users with jemalloc or
tcmalloc, reuse freed memory instead. With ``--warm-allocator`` the script runs again with glibc told to
keep its memory (no separate mappings for large blocks, no trimming), so the timings are those of the
kernels on memory that is already mapped, as in a training step after the first.
"""
from __future__ import annotations

import os
import sys

WARM_ALLOCATOR = {
    "MALLOC_MMAP_MAX_": "0",  # large blocks come from the heap, not from mappings of their own
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),  # the heap is never trimmed back to the kernel
    "MALLOC_TOP_PAD_": str(1 << 30),  # and grows in 1 GiB steps
}


def warm_allocator_active() -> bool:
    return all(os.environ.get(name) == value for name, value in WARM_ALLOCATOR.items())


def rerun_with_warm_allocator() -> None:
    """Replace this process by the same command with the warm-allocator environment (once)."""
    if warm_allocator_active():
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **WARM_ALLOCATOR})
