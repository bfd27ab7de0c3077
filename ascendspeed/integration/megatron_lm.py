"""Hooks into Megatron-LM's ``megatron.training.arguments``, applied whenever that module loads.

* ``add_megatron_arguments`` is wrapped so the parser Megatron-LM builds knows every ascendspeed flag
  (and extended choices such as ``--position-embedding-type alibi``);
* ``validate_args`` is wrapped so that, after Megatron's own checks, ascendspeed validates and applies
  the features the arguments select, before any model is built;
* ``core_transformer_config_from_args`` is wrapped so enabled features carry their settings into the
  ``TransformerConfig``;
* ``megatron.core.datasets.utils.compile_helpers`` (called by ``initialize_megatron``) builds the dataset
  helpers without ``make`` only when they are missing or stale (``dataset_helpers.py``): the megatron-core
  wheel ships them but no Makefile.

Megatron-LM looks these functions up by module attribute at call time (``parse_args`` calls
``add_megatron_arguments``), and copies bound by ``from ... import`` are swept by the patch manager.
"""
from __future__ import annotations

import functools

from ascendspeed.integration import dataset_helpers
from ascendspeed.patching import PatchManager, wrap

FEATURE_NAME = "megatron_lm"
ARGUMENTS_MODULE = "megatron.training.arguments"

#: Hooks that run on Megatron-LM's parsed args before the features are applied (device defaults).
ARGUMENT_DEFAULTERS = []


def _wrap_add_megatron_arguments(original):
    @functools.wraps(original)
    def add_megatron_arguments(parser):
        from ascendspeed.features import add_feature_arguments

        parser = original(parser)
        return add_feature_arguments(parser)

    return add_megatron_arguments


def _wrap_validate_args(original):
    @functools.wraps(original)
    def validate_args(args, defaults={}):  # noqa: B006 - mirrors Megatron-LM's signature
        from ascendspeed.features import apply_features

        for set_defaults in ARGUMENT_DEFAULTERS:
            set_defaults(args)
        result = original(args, defaults)
        enabled = apply_features(args)
        if getattr(args, "rank", 0) == 0:
            # One line in the training log saying which features this run really has switched on.
            print(f"> ascendspeed features: {', '.join(enabled) or 'none'}", flush=True)
        return result

    return validate_args


def _wrap_core_transformer_config_from_args(original):
    @functools.wraps(original)
    def core_transformer_config_from_args(args, config_class=None):
        from ascendspeed.features import configure_transformer_config

        return configure_transformer_config(original(args, config_class), args)

    return core_transformer_config_from_args


def patches():
    return [
        wrap(f"{ARGUMENTS_MODULE}:add_megatron_arguments", _wrap_add_megatron_arguments,
             expect="(parser: argparse.ArgumentParser)"),
        wrap(f"{ARGUMENTS_MODULE}:validate_args", _wrap_validate_args, expect="(args, defaults={})"),
        wrap(f"{ARGUMENTS_MODULE}:core_transformer_config_from_args", _wrap_core_transformer_config_from_args,
             expect="(args, config_class=None)"),
        *dataset_helpers.patches(),
    ]


def install(manager: PatchManager) -> None:
    manager.apply(FEATURE_NAME, patches())
