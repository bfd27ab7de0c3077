"""The norm of megatron-core's local layer spec, with sequence parallelism and the fused RMSNorm.

Without apex or Transformer Engine, the local spec builds its norms through
``megatron.core.transformer.torch_norm.WrappedTorchNorm``, which refuses sequence parallelism (and
zero-centred gamma): so ``--sequence-parallel`` cannot run on a CPU or an NPU. A norm needs nothing from
the other tensor-parallel ranks to normalise its own tokens; under sequence parallelism each rank holds a
slice of the sequence, so the norm's weights are replicated while their gradients are partial sums. Megatron
marks such parameters ``sequence_parallel = True`` and ``finalize_model_grads`` all-reduces their gradients
over the tensor-parallel group. ``LocalNorm`` is that norm: LayerNorm or RMSNorm over the last dimension,
weights marked as Megatron marks them, zero-centred gamma as Megatron defines it (the weight is stored as
``gamma - 1``, initialised to zero), and RMSNorm on ``ascendspeed.ops.rms_norm`` when fused.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from ascendspeed.patching import Patch, wrap


@dataclasses.dataclass(frozen=True)
class LocalNormSettings:
    """``fused_rmsnorm``: RMSNorm runs on the fused operator (``--use-fused-rmsnorm``)."""

    fused_rmsnorm: bool = False


class LocalNorm(torch.nn.Module):
    """LayerNorm or RMSNorm of ``hidden_size`` features, sequence-parallel capable.

    Parameter names match ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` (``weight``, ``bias``), so
    checkpoints move between this norm and Megatron's.
    """

    def __init__(self, normalization: str, hidden_size: int, eps: float, *, sequence_parallel: bool,
                 zero_centered_gamma: bool, fused: bool, dtype=None):
        super().__init__()
        if normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"LocalNorm normalises with LayerNorm or RMSNorm, not {normalization!r}")
        self.normalization = normalization
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.fused = fused and normalization == "RMSNorm"
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=dtype))
        self.bias = (torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
                     if normalization == "LayerNorm" else None)
        for param in self.parameters():
            param.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from ascendspeed.ops.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, zero_centered_gamma=self.zero_centered_gamma)
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        if self.normalization == "LayerNorm":
            return F.layer_norm(x, (self.hidden_size,), weight, self.bias, self.eps)
        return F.rms_norm(x, (self.hidden_size,), weight, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalization}({self.hidden_size}, eps={self.eps}, fused={self.fused}, "
                f"zero_centered_gamma={self.zero_centered_gamma})")


def wrap_torch_norm_new(settings: LocalNormSettings):
    """``WrappedTorchNorm(config, hidden_size, eps, ...)`` builds a ``LocalNorm`` for LayerNorm and RMSNorm
    (megatron-core's own class for anything else, L2Norm)."""

    def factory(original):
        @functools.wraps(original)
        def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                    normalization="LayerNorm"):
            if config.normalization not in ("LayerNorm", "RMSNorm"):
                return original(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                                normalization)
            if config.memory_efficient_layer_norm:
                raise ValueError("memory_efficient_layer_norm is an apex LayerNorm option; the local norm has "
                                 "no such mode: drop --memory-efficient-layer-norm")
            return LocalNorm(
                config.normalization, hidden_size, eps,
                sequence_parallel=config.sequence_parallel,
                zero_centered_gamma=config.layernorm_zero_centered_gamma,
                fused=settings.fused_rmsnorm,
                dtype=config.params_dtype,
            )

        return __new__

    return factory


def patches(settings: LocalNormSettings) -> list[Patch]:
    return [
        wrap("megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__", wrap_torch_norm_new(settings),
             expect="(cls, config, hidden_size, eps=1e-05, persist_layer_norm=False, zero_centered_gamma=False, "
                    "normalization='LayerNorm')",
             name="local norm: sequence parallel, zero-centred gamma, fused RMSNorm"),
    ]
