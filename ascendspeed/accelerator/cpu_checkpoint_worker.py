"""Megatron's persistent checkpoint worker (``--async-save --use-persistent-ckpt-worker``) with ascendspeed in it.

megatron-core starts the worker with multiprocessing's *spawn* method: a fresh interpreter that imports its
target, ``PersistentAsyncCaller.async_loop``, by name, and nothing of the training rank's set-up. Its first
line, ``torch.cuda.set_device(rank % torch.cuda.device_count())``, divides by zero on the CPU; the worker dies
before it reads its queue, and the training rank waits for it forever (Megatron-LM 0.19 saves asynchronously
only through this worker). The worker's target becomes ``async_loop_with_ascendspeed``, a function of this
module: the worker imports it by name, installs ascendspeed as the training rank has it (the same device,
from the inherited environment), and runs megatron-core's loop.
"""
from __future__ import annotations

from ascendspeed.patching import EXISTS, wrap

_megatron_async_loop = None


def async_loop_with_ascendspeed(*args, **kwargs):
    """megatron-core's worker loop, in a process with ascendspeed installed."""
    import ascendspeed.megatron_adaptor  # noqa: F401  installs ascendspeed in the spawned worker
    import megatron.core.dist_checkpointing.strategies.async_utils  # noqa: F401  its patches apply on import

    return _megatron_async_loop(*args, **kwargs)


def wrap_async_loop(original):
    """The loop, started through this module so that the spawned worker installs ascendspeed first. Not
    ``functools.wraps``: the worker finds its target by this function's own module and name."""
    global _megatron_async_loop
    _megatron_async_loop = original
    return async_loop_with_ascendspeed


def patches():
    # The loop's arguments are passed through untouched, so its signature need not be pinned.
    return [
        wrap("megatron.core.dist_checkpointing.strategies.async_utils:PersistentAsyncCaller.async_loop",
             wrap_async_loop, expect=EXISTS,
             name="cpu checkpoint worker: wrap PersistentAsyncCaller.async_loop, the spawned worker installs "
                  "ascendspeed"),
    ]
