"""Which device Megatron runs on (npu, cuda or cpu) and the shims that device needs.

``import ascendspeed.megatron_adaptor`` calls ``install()`` once:

* ``npu`` when ``torch_npu`` imports and reports an NPU: torch_npu's own CUDA-to-NPU redirection
  (``torch_npu.contrib.transfer_to_npu``) makes Megatron's ``torch.cuda`` calls reach the NPU;
* ``cuda`` when torch sees a CUDA device: Megatron's native platform, nothing is patched;
* ``cpu`` otherwise: the shims of feature ``accelerator.cpu`` give Megatron's CUDA spellings CPU meanings
  (see ``cpu_runtime``, ``cpu_tensors``, ``cpu_megatron_core``, ``cpu_megatron_lm``, ``triton_guard``), and
  feature ``accelerator.cpu.gloo_p2p`` keeps gloo from swapping pipeline messages (``cpu_megatron_core``);
  feature ``accelerator.cpu.fp32_half_gemm`` multiplies bf16 / fp16 linear layers in fp32 where this CPU has
  no fast GEMM for them (``cpu_half_gemm``; ``ASCENDSPEED_CPU_HALF_GEMM=auto|fp32|native``);
  glibc's malloc keeps freed host memory for reuse, as a device's caching allocator does (``cpu_allocator``).

On every device where Transformer Engine does not import, feature ``accelerator.te_fallback`` serves TE's layer
classes with megatron-core's local modules (``te_fallback``); where ``mamba_ssm`` does not import, feature
``accelerator.mamba_fallback`` serves megatron-core's Mamba layers with torch kernels (``mamba_fallback``), and
where ``fla`` does not, ``accelerator.gdn_fallback`` its gated delta net layers (``gdn_fallback``).

On every device, feature ``accelerator.torch_adam`` lets distributed-optimizer checkpoints resume where
megatron-core runs ``torch.optim.Adam`` because neither apex nor Transformer Engine is installed (every CPU,
an NPU without TE; ``torch_adam_checkpoints``); with either installed its patches leave Megatron's code alone.
Feature ``accelerator.model_space_checkpoints`` stores the distributed optimizer's reshardable form right when
its grad buffer has several buckets (``model_space_checkpoints``).

All of them are listed by ``python -m ascendspeed.megatron_adaptor --list`` and undone by ``uninstall()`` (or
``MANAGER.revert(name)`` for one of them).

``ASCENDSPEED_DEVICE=cpu|cuda|npu`` forces the choice (a device that is not there is an error).
Other code asks ``current_device()`` (a ``torch.device``) or ``device_type()`` instead of spelling "cuda".
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from ascendspeed.patching import MANAGER, PatchManager

DEVICES = ("npu", "cuda", "cpu")
ENVIRONMENT_VARIABLE = "ASCENDSPEED_DEVICE"
CPU_FEATURE = "accelerator.cpu"
GLOO_P2P_FEATURE = "accelerator.cpu.gloo_p2p"
CPU_HALF_GEMM_FEATURE = "accelerator.cpu.fp32_half_gemm"
NPU_FEATURE = "accelerator.npu"
TE_FALLBACK_FEATURE = "accelerator.te_fallback"
MAMBA_FALLBACK_FEATURE = "accelerator.mamba_fallback"
GDN_FALLBACK_FEATURE = "accelerator.gdn_fallback"
TORCH_ADAM_FEATURE = "accelerator.torch_adam"
MODEL_SPACE_CHECKPOINTS_FEATURE = "accelerator.model_space_checkpoints"
FEATURES = (CPU_FEATURE, GLOO_P2P_FEATURE, CPU_HALF_GEMM_FEATURE, NPU_FEATURE, TE_FALLBACK_FEATURE,
            MAMBA_FALLBACK_FEATURE, GDN_FALLBACK_FEATURE, TORCH_ADAM_FEATURE, MODEL_SPACE_CHECKPOINTS_FEATURE)

logger = logging.getLogger(__name__)

_installed: Optional[str] = None


class DeviceSelectionError(RuntimeError):
    """The requested device is unknown or not present."""


def _npu_absence() -> Optional[str]:
    """Why no NPU can be used, or None when one can."""
    try:
        import torch_npu  # noqa: F401 - registers torch.npu
    except Exception as error:  # noqa: BLE001 - torch_npu raises more than ImportError without its drivers
        return f"torch_npu does not import: {error}"
    if not (torch.npu.is_available() and torch.npu.device_count() > 0):
        return "torch_npu reports no NPU"
    return None


def _npu_present() -> bool:
    return _npu_absence() is None


def _cuda_present() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def forced_device() -> Optional[str]:
    """The device named by ``ASCENDSPEED_DEVICE``, or None when unset; an unknown name is an error."""
    value = os.environ.get(ENVIRONMENT_VARIABLE, "").strip().lower()
    if not value:
        return None
    if value not in DEVICES:
        raise DeviceSelectionError(
            f"{ENVIRONMENT_VARIABLE}={os.environ[ENVIRONMENT_VARIABLE]!r} is not a device ascendspeed knows; "
            f"use one of {', '.join(DEVICES)}, or unset it to pick the first present of npu, cuda, cpu"
        )
    return value


def select_device() -> str:
    """``"npu"``, ``"cuda"`` or ``"cpu"``: the forced device if present, else the first present."""
    forced = forced_device()
    if forced == "npu" and _npu_absence():
        raise DeviceSelectionError(f"{ENVIRONMENT_VARIABLE}=npu, but no NPU is usable ({_npu_absence()})")
    if forced == "cuda" and not _cuda_present():
        raise DeviceSelectionError(
            f"{ENVIRONMENT_VARIABLE}=cuda, but torch sees no CUDA device (torch.cuda.is_available() is False)"
        )
    if forced:
        return forced
    if _npu_present():
        return "npu"
    if _cuda_present():
        return "cuda"
    return "cpu"


def cpu_patches():
    """The shims of feature ``accelerator.cpu``, in the order they are applied."""
    from ascendspeed.accelerator import (cpu_checkpoint_worker, cpu_fusions, cpu_megatron_core, cpu_megatron_lm,
                                         cpu_optimizer, cpu_runtime, cpu_tensors, triton_guard)

    return (
        cpu_runtime.patches()
        + cpu_tensors.patches()
        + cpu_megatron_core.rng_patches()
        + cpu_megatron_core.process_group_patches()
        + cpu_megatron_core.moe_patches()
        + cpu_megatron_core.rope_patches()
        + cpu_megatron_lm.patches()
        + cpu_fusions.patches()
        + cpu_optimizer.patches()
        + cpu_checkpoint_worker.patches()
        + triton_guard.patches()
    )


def gloo_p2p_patches():
    """The shims of feature ``accelerator.cpu.gloo_p2p`` (separate so a test can show what it prevents)."""
    from ascendspeed.accelerator import cpu_megatron_core

    return cpu_megatron_core.p2p_patches()


def cpu_half_gemm_patches(widened=None):
    """Feature ``accelerator.cpu.fp32_half_gemm``: Megatron's linear layers in ``widened`` dtypes (default: per
    ``ASCENDSPEED_CPU_HALF_GEMM``, those this CPU has no fast GEMM for) multiplied in fp32 (``cpu_half_gemm``)."""
    from ascendspeed.accelerator import cpu_half_gemm

    return cpu_half_gemm.patches(cpu_half_gemm.widened_dtypes() if widened is None else widened)


def te_fallback_patches():
    """The stand-ins of feature ``accelerator.te_fallback``: Transformer Engine's classes on megatron-core's local
    modules (``te_fallback``), installed on any device where TE does not import."""
    from ascendspeed.accelerator import te_fallback

    return te_fallback.patches()


def mamba_fallback_patches():
    """Feature ``accelerator.mamba_fallback``: torch kernels for megatron-core's Mamba layers, installed on any
    device where ``mamba_ssm`` does not import (``mamba_fallback``)."""
    from ascendspeed.accelerator import mamba_fallback

    return mamba_fallback.patches()


def gdn_fallback_patches():
    """Feature ``accelerator.gdn_fallback``: torch kernels for megatron-core's gated delta net layers, installed on
    any device where ``fla`` does not import (``gdn_fallback``)."""
    from ascendspeed.accelerator import gdn_fallback

    return gdn_fallback.patches()


def torch_adam_patches():
    """The patches of feature ``accelerator.torch_adam`` (every device: they act only without apex and TE)."""
    from ascendspeed.accelerator import torch_adam_checkpoints

    return torch_adam_checkpoints.patches()


def model_space_checkpoints_patches():
    """The patch of feature ``accelerator.model_space_checkpoints`` (every device: a megatron-core bug with
    several grad-buffer buckets, not a missing dependency)."""
    from ascendspeed.accelerator import model_space_checkpoints

    return model_space_checkpoints.patches()


def _install_npu(manager: PatchManager) -> None:
    import torch_npu  # noqa: F401
    from torch_npu.contrib import transfer_to_npu  # noqa: F401 - redirects torch.cuda and "cuda" to the NPU

    from ascendspeed.accelerator import triton_guard

    manager.apply(NPU_FEATURE, triton_guard.patches())


def install(manager: PatchManager = MANAGER) -> str:
    """Select the device, install its shims, log the choice (once); returns the device name."""
    global _installed
    device = select_device()
    keeps_host_memory = False
    if device == "cpu":
        from ascendspeed.accelerator import cpu_allocator

        manager.apply(CPU_FEATURE, cpu_patches())
        manager.apply(GLOO_P2P_FEATURE, gloo_p2p_patches())
        manager.apply(CPU_HALF_GEMM_FEATURE, cpu_half_gemm_patches())
        keeps_host_memory = cpu_allocator.apply_requested_policy()
    elif device == "npu":
        _install_npu(manager)
    from ascendspeed.accelerator import te_fallback

    if te_fallback.needed():
        manager.apply(TE_FALLBACK_FEATURE, te_fallback_patches())
    from ascendspeed.accelerator import mamba_fallback

    if mamba_fallback.needed():
        manager.apply(MAMBA_FALLBACK_FEATURE, mamba_fallback_patches())
    from ascendspeed.accelerator import gdn_fallback

    if gdn_fallback.needed():
        manager.apply(GDN_FALLBACK_FEATURE, gdn_fallback_patches())
    manager.apply(TORCH_ADAM_FEATURE, torch_adam_patches())
    manager.apply(MODEL_SPACE_CHECKPOINTS_FEATURE, model_space_checkpoints_patches())
    if _installed != device:
        how = f"{ENVIRONMENT_VARIABLE}={device}" if forced_device() else "detected"
        logger.info("ascendspeed: running Megatron on %s (%s)%s", device, how,
                    "; freed host memory kept for reuse (ASCENDSPEED_CPU_ALLOCATOR=system: glibc's defaults)"
                    if keeps_host_memory else "")
        _installed = device
    return device


def uninstall(manager: PatchManager = MANAGER) -> None:
    """Revert every device shim (torch_npu's own redirection cannot be undone)."""
    global _installed
    for feature in FEATURES:
        manager.revert(feature)
    _installed = None


def device_type() -> str:
    """The device type name of the installed (or else the selectable) device."""
    return _installed or select_device()


def current_device() -> torch.device:
    """The ``torch.device`` this process computes on: what to pass where Megatron passes "cuda"."""
    kind = device_type()
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "npu":
        return torch.device("npu", torch.npu.current_device())
    return torch.device("cuda", torch.cuda.current_device())


__all__ = [
    "CPU_FEATURE",
    "DEVICES",
    "DeviceSelectionError",
    "FEATURES",
    "GDN_FALLBACK_FEATURE",
    "GLOO_P2P_FEATURE",
    "MAMBA_FALLBACK_FEATURE",
    "MODEL_SPACE_CHECKPOINTS_FEATURE",
    "NPU_FEATURE",
    "TE_FALLBACK_FEATURE",
    "TORCH_ADAM_FEATURE",
    "current_device",
    "device_type",
    "forced_device",
    "install",
    "select_device",
    "uninstall",
]
