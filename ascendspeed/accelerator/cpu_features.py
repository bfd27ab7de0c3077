"""The CPU's instruction-set flags, for choices that depend on them (which kernel is the faster one)."""
from __future__ import annotations

import functools
from typing import Optional


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


def has_fast_bf16_gemm() -> bool:
    """Whether torch multiplies bf16 matrices on this CPU with oneDNN (which needs AVX-512; AVX512-BF16 and
    AMX make it faster still), torch's own answer (``cpu_half_gemm.slow_half_gemm_dtypes``). Elsewhere torch's
    bf16 matmul is a scalar fallback loop."""
    import torch

    from ascendspeed.accelerator.cpu_half_gemm import slow_half_gemm_dtypes

    return torch.bfloat16 not in slow_half_gemm_dtypes()


def slow_bf16_warning(flag: str = "--bf16") -> Optional[str]:
    """What a bf16 run on this CPU should be told before it starts, or None where its GEMMs are fast.

    Without AVX-512 torch's bf16 GEMM is a scalar loop: on a 2-vCPU AMD EPYC (Zen 3, AVX2) a linear layer's
    products took 7x to 158x the fp32 time (``bench/bf16_gemm.py``, ``bench/results/bf16_gemm_avx2.json``).
    There ascendspeed multiplies Megatron's bf16 linear layers and core attention in fp32
    (``cpu_half_gemm``), unless ``ASCENDSPEED_CPU_HALF_GEMM=native`` says not to: only then is the run told."""
    import torch

    from ascendspeed.accelerator.cpu_half_gemm import ENVIRONMENT_VARIABLE, widened_dtypes

    if has_fast_bf16_gemm() or torch.bfloat16 in widened_dtypes():
        return None
    return (f"ascendspeed: {flag} on a CPU without AVX-512 with {ENVIRONMENT_VARIABLE}=native: torch has no fast "
            f"bf16 matrix multiply here (oneDNN's needs AVX-512), so every bf16 linear layer runs torch's scalar "
            f"fallback GEMM, tens of times slower than fp32 (bench/bf16_gemm.py measures it on this machine). "
            f"Training is correct, only slow; unset {ENVIRONMENT_VARIABLE} to multiply bf16 in fp32, or leave out "
            f"{flag} to train in fp32.")
