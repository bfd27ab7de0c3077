"""megatron-core's torch optimizers, made from an ``OptimizerConfig`` without a learning rate, as TE's are.

``OptimizerConfig.lr`` defaults to ``None``: Megatron's learning-rate scheduler writes every group's ``lr``
before the first step. Transformer Engine's (and apex's) ``FusedAdam`` / ``FusedSGD`` store ``lr=None`` as
given. Where neither imports, megatron-core falls back to ``torch.optim.Adam`` / ``AdamW`` / ``SGD``, which
refuse it (``TypeError: '<=' not supported between instances of 'float' and 'NoneType'``), so a config that
builds on a GPU with TE (Megatron's checkpoint tests build theirs so) fails on every device without it.

Without a rate the torch optimizer is built with ``lr=0.0``, a step that moves nothing until the scheduler (or
the caller) sets the groups' rates, and the config is handed back as it came.
"""
from __future__ import annotations

import functools
import sys

from ascendspeed.patching import EXISTS, wrap


def _uses_torch_optimizers() -> bool:
    """Whether megatron-core fell back to torch's optimizers (neither TE nor apex imported)."""
    return getattr(sys.modules["megatron.core.optimizer"], "USING_PYTORCH_OPTIMIZER", False)


def wrap_optimizer_builder(original):
    """The builder, given ``lr=0.0`` for torch's optimizers when the config names none."""

    @functools.wraps(original)
    def build(config, *args, **kwargs):
        if config.lr is not None or not _uses_torch_optimizers():
            return original(config, *args, **kwargs)
        config.lr = 0.0
        try:
            return original(config, *args, **kwargs)
        finally:
            config.lr = None

    return build


def patches():
    # The wrapper reads only the config, the first argument in every release; the rest differs between them.
    return [
        wrap("megatron.core.optimizer:_get_megatron_optimizer_based_on_param_groups", wrap_optimizer_builder,
             expect=EXISTS, name="TE fallback: wrap the optimizer builder, torch's optimizers without a config lr"),
    ]
