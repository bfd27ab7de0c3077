"""Let modules whose only fault is an unguarded ``import triton`` be imported where triton is absent.

Megatron-LM's ``initialize.py`` imports ``enable_batch_invariant_mode`` from
``megatron.core.transformer.custom_layers.batch_invariant_kernels``, which starts with ``import triton``.
Triton ships with CUDA builds of torch only, so on CPU (and NPU) Megatron-LM cannot even start, although
it only calls into that module with ``--batch-invariant-mode``. This shim answers such an import with a
stand-in module whose every attribute, when called, raises an ImportError naming triton and the module.
Only imports that fail because *triton itself* is missing are answered, only for the listed modules;
all other imports go through unchanged, and with triton installed the guard is not installed at all.
"""
from __future__ import annotations

import functools
import importlib.util
import types
from typing import Callable

from ascendspeed.patching import EXISTS, wrap

#: Modules that import triton at top level but are imported by code paths that never use it.
TRITON_ONLY_MODULES = frozenset({
    "megatron.core.transformer.custom_layers.batch_invariant_kernels",
})


class TritonFreeStandIn(types.ModuleType):
    """Stands for a module that needs triton; using any of its attributes says so."""

    def __init__(self, name: str, reason: ModuleNotFoundError):
        super().__init__(name, f"stand-in for {name}, which needs triton ({reason})")
        self.__ascendspeed_reason__ = str(reason)

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        module, reason = self.__name__, self.__ascendspeed_reason__

        def unavailable(*args, **kwargs):
            raise ImportError(
                f"{module}.{attribute} needs triton, which is not installed ({reason}); "
                "triton comes with CUDA builds of torch: run on CUDA or do not use this feature"
            )

        unavailable.__name__ = attribute
        return unavailable


def _missing_triton(error: ModuleNotFoundError) -> bool:
    return error.name == "triton" or (error.name or "").startswith("triton.")


def _wrap_import(original):
    @functools.wraps(original)
    def __import__(name, globals=None, locals=None, fromlist=(), level=0):
        try:
            return original(name, globals, locals, fromlist, level)
        except ModuleNotFoundError as error:
            if level == 0 and fromlist and name in TRITON_ONLY_MODULES and _missing_triton(error):
                return TritonFreeStandIn(name, error)
            raise

    return __import__


def triton_on_cuda_only(step: Callable) -> Callable:
    """A factory for ``wrap``: megatron-core's own triton kernel on CUDA tensors, the torch function ``step``
    (same contract) on every other device, where the kernel cannot run."""

    def factory(original):
        @functools.wraps(original)
        def call(first, *args, **kwargs):
            return (original if first.device.type == "cuda" else step)(first, *args, **kwargs)

        return call

    return factory


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def patches():
    """The guard, where triton is missing (with triton installed nothing needs guarding)."""
    return [] if triton_installed() else guard_patches()


def guard_patches():
    return [
        wrap("builtins:__import__", _wrap_import, expect=EXISTS, sweep=False,
             name="triton guard: stand-in for modules that only fail on 'import triton'"),
    ]
