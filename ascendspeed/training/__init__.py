"""A small pretraining entry on megatron-core: ``python -m ascendspeed.training.pretrain_gpt``.

Building blocks for tests and benchmarks: ``parse_args`` (Megatron-LM flag names plus every feature's
flags), ``build_config`` / ``build_model`` / ``build_optimizer`` / ``build_scheduler``, and ``train``,
which returns a ``TrainResult`` with the losses and perplexities of the run.

Names load lazily, so ``python -m ascendspeed.training.pretrain_gpt`` installs the device shims before
anything imports megatron.
"""
import importlib

_EXPORTS = {
    "build_parser": "arguments",
    "parse_args": "arguments",
    "build_config": "model",
    "build_model": "model",
    "build_optimizer": "model",
    "build_scheduler": "model",
    "EvalResult": "trainer",
    "TrainResult": "trainer",
    "train": "trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
