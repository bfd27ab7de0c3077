"""megatron-core's Mamba layers without ``mamba_ssm`` and ``causal_conv1d`` (feature ``accelerator.mamba_fallback``).

``megatron.core.ssm.mamba_mixer`` imports its kernels from ``mamba_ssm`` (triton) and ``causal_conv1d`` (CUDA).
Where they do not import, the names are None or absent, ``RMSNormGated`` is a ``MagicMock`` (so
``ExtendedRMSNorm``, a class derived from it, is a mock too) and ``MambaMixer.__init__`` raises "MambaSSM is not
installed". The fallback puts torch implementations with the same contracts there (``ssd.py``: the causal
convolution, Mamba-2's chunked scan, the gated RMSNorm), so Mamba layers (``M`` in a hybrid layer pattern)
build and train on every device, context parallelism and packed sequences (``seq_idx``) included. Inference's
decode steps, megatron-core's own triton kernels from 0.17 on (``causal_conv1d_update``,
``selective_state_update``), run as torch off CUDA (``decode.py``); before 0.17 they came from the same packages,
and megatron-core's own torch step serves them.
"""
from __future__ import annotations

from ascendspeed.accelerator.optional_packages import importable

FEATURE = "accelerator.mamba_fallback"


def needed() -> bool:
    """The fallback is installed where ``mamba_ssm`` does not import."""
    return not importable("mamba_ssm.ops.triton.ssd_combined")


def patches():
    from ascendspeed.accelerator.mamba_fallback import modules

    return modules.patches()
