"""Recompute without outputs (``CheckpointWithoutOutput``) where Transformer Engine is absent.

``megatron.core.tensor_parallel.random.CheckpointWithoutOutput.__init__(fp8=False)`` stores
``self.fp8 = fp8 is not None``: True for its own default, so every ``CheckpointWithoutOutput()`` takes the
fp8 branch of its forward, which calls Transformer Engine's ``FP8GlobalStateManager``. With TE installed that
is harmless (fp8 is off); without it the name is undefined and the forward raises ``NameError: name
'FP8GlobalStateManager' is not defined``. Every release from 0.15 to 0.19 does this, and the callers are
selective recompute of the layer norms (``--recompute-modules layernorm``), of MoE expert activations
(``moe_act``) and of MLA's up projections (``mla_up_proj``): each failed on any device without TE.

Without TE fp8 cannot be on (the fallback refuses ``--fp8-format`` at validation), so the wrap records what
was asked for: fp8 only when ``fp8`` names a recipe.
"""
from __future__ import annotations

import functools

from ascendspeed.patching import wrap


def wrap_checkpoint_without_output_init(original):
    """``CheckpointWithoutOutput.__init__`` with ``self.fp8`` true only for an fp8 recipe."""

    @functools.wraps(original)
    def __init__(self, fp8=False):
        original(self, fp8)
        self.fp8 = fp8 not in (None, False)

    return __init__


def patches():
    return [
        wrap("megatron.core.tensor_parallel.random:CheckpointWithoutOutput.__init__",
             wrap_checkpoint_without_output_init, expect="(self, fp8=False)",
             name="TE fallback: wrap CheckpointWithoutOutput.__init__, fp8 only when asked for (no TE to call)"),
    ]
