"""Freed host memory kept for reuse on CPU ranks, as an accelerator's caching allocator keeps device memory.

A training step frees and allocates the same large buffers every iteration (activations, their gradients,
attention and MLP intermediates). glibc's malloc gives each block above its mmap threshold (128 KiB, raised
dynamically up to 32 MiB) a mapping of its own and unmaps it when freed, and trims the free top of its heap
back to the kernel: the next iteration's buffers are then fresh pages that the kernel faults in and zeroes
on first touch, about as much work as writing them. CUDA's and the NPU's caching allocators keep freed
blocks instead. ``keep_freed_host_memory`` asks glibc to do the same through ``mallopt``: large blocks come
from the heap (``M_MMAP_MAX`` 0), the heap is not trimmed (``M_TRIM_THRESHOLD`` 2 GiB) and grows in steps of
``M_TOP_PAD``. The process then holds its peak memory until it exits, as a device caching allocator does.

Applied on CPU ranks by ``accelerator.install`` unless ``ASCENDSPEED_CPU_ALLOCATOR=system`` keeps glibc's
defaults; nothing happens where the C library is not glibc (musl, macOS) or is already set by the
``MALLOC_*_`` environment variables.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Optional

logger = logging.getLogger("ascendspeed")

ENVIRONMENT_VARIABLE = "ASCENDSPEED_CPU_ALLOCATOR"
CHOICES = ("keep", "system")

# glibc's <malloc.h> parameter numbers
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4

#: What is asked of glibc, and the environment variable through which a user may have set it already.
SETTINGS = (
    (M_MMAP_MAX, 0, "MALLOC_MMAP_MAX_"),
    (M_TRIM_THRESHOLD, 2**31 - 1, "MALLOC_TRIM_THRESHOLD_"),  # the largest mallopt takes: 2 GiB of free top
    (M_TOP_PAD, 64 << 20, "MALLOC_TOP_PAD_"),
)


def requested_policy() -> str:
    """``keep`` (the default) or ``system``, from ``ASCENDSPEED_CPU_ALLOCATOR``; anything else is an error."""
    value = os.environ.get(ENVIRONMENT_VARIABLE, "keep").strip().lower() or "keep"
    if value not in CHOICES:
        raise ValueError(f"{ENVIRONMENT_VARIABLE}={value!r}: expected one of {', '.join(CHOICES)} ('keep' keeps "
                         "freed host memory for reuse, 'system' leaves glibc's malloc defaults)")
    return value


def _glibc() -> Optional[ctypes.CDLL]:
    """The process's C library when it is glibc (it has ``gnu_get_libc_version`` and ``mallopt``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - present only in glibc
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        return libc
    except (OSError, AttributeError):
        return None


def keep_freed_host_memory() -> bool:
    """Set glibc's malloc to keep freed memory (see the module docstring); True when it was set."""
    libc = _glibc()
    if libc is None:
        return False
    for parameter, value, variable in SETTINGS:
        if variable in os.environ:
            continue
        if libc.mallopt(parameter, value) != 1:
            logger.warning("ascendspeed: glibc's mallopt(%d, %d) failed; freed host memory is not kept", parameter,
                           value)
            return False
    return True


def apply_requested_policy() -> bool:
    """``keep_freed_host_memory`` unless ``ASCENDSPEED_CPU_ALLOCATOR=system``; True when the policy was set."""
    return requested_policy() == "keep" and keep_freed_host_memory()
