"""Hooks into Megatron-LM's ``megatron.training.arguments``, applied whenever that module loads.

This module owns every hook on Megatron-LM's argument handling (device specifics come from
``ascendspeed.accelerator``):

* ``add_megatron_arguments`` is wrapped so the parser Megatron-LM builds knows every ascendspeed flag
  (and extended choices such as ``--position-embedding-type alibi``), with CPU-capable defaults on the CPU;
* ``validate_args`` is wrapped so that, after Megatron's own checks, ascendspeed validates and applies
  the features the arguments select, before any model is built (on the CPU, explicit flags the CPU
  cannot honour are refused first, naming the flag to use; where Transformer Engine is absent, the flags
  that need TE itself; and hybrid layer patterns with layers whose CUDA packages are missing,
  ``hybrid_layers.py``);
* ``core_transformer_config_from_args`` is wrapped so enabled features carry their settings into the
  ``TransformerConfig``;
* ``megatron.core.datasets.utils.compile_helpers`` (called by ``initialize_megatron``) builds the dataset
  helpers without ``make`` only when they are missing or stale (``dataset_helpers.py``): the megatron-core
  wheel ships them but no Makefile.

Megatron-LM looks these functions up by module attribute at call time (``parse_args`` calls
``add_megatron_arguments``), and copies bound by ``from ... import`` are swept by the patch manager.
"""
from __future__ import annotations

import contextlib
import functools
import sys

from ascendspeed.integration import dataset_helpers, hybrid_layers, mock_dataset
from ascendspeed.patching import PatchManager, wrap

FEATURE_NAME = "megatron_lm"

def _on_cpu() -> bool:
    from ascendspeed import accelerator

    return accelerator.device_type() == "cpu"


def _wrap_add_megatron_arguments(original):
    @functools.wraps(original)
    def add_megatron_arguments(parser):
        from ascendspeed.accelerator import cpu_megatron_lm
        from ascendspeed.features import add_feature_arguments

        parser = original(parser)
        if _on_cpu():
            cpu_megatron_lm.set_cpu_defaults(parser)
        return add_feature_arguments(parser)

    return add_megatron_arguments


def _wrap_validate_args(original):
    @functools.wraps(original)
    def validate_args(args, defaults={}):  # noqa: B006 - mirrors Megatron-LM's signature
        from ascendspeed.accelerator import cpu_megatron_lm, te_fallback
        from ascendspeed.features import apply_features

        if te_fallback.needed():
            te_fallback.check_arguments(args)
        hybrid_layers.check_hybrid_pattern(args)
        environment = contextlib.nullcontext()
        if _on_cpu():
            cpu_megatron_lm.check_cpu_arguments(args)
            environment = cpu_megatron_lm.validation_environment(args)
        with environment:
            result = original(args, defaults)
        enabled = apply_features(args)
        if getattr(args, "rank", 0) == 0:
            # One line in the training log saying which features this run really has switched on, written in
            # one call (print writes the newline separately: another rank's output could land before it).
            sys.stdout.write(f"> ascendspeed features: {', '.join(f.name for f in enabled) or 'none'}\n")
            sys.stdout.flush()
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
        wrap("megatron.training.arguments:add_megatron_arguments", _wrap_add_megatron_arguments,
             expect="(parser)", name="megatron-lm: ascendspeed's flags (CPU defaults on the CPU)"),
        wrap("megatron.training.arguments:validate_args", _wrap_validate_args, expect="(args, defaults={})",
             name="megatron-lm: validate and apply the selected features after Megatron's checks"),
        wrap("megatron.training.arguments:core_transformer_config_from_args",
             _wrap_core_transformer_config_from_args, expect="(args, config_class=None)", megatron="<0.18",
             name="megatron-lm: features carry their settings into the TransformerConfig"),
        wrap("megatron.training.argument_utils:core_transformer_config_from_args",
             _wrap_core_transformer_config_from_args, expect="(args, config_class=None)", megatron=">=0.18",
             name="megatron-lm: features carry their settings into the TransformerConfig"),
        *dataset_helpers.patches(),
        *mock_dataset.patches(),
    ]


def install(manager: PatchManager) -> None:
    manager.apply(FEATURE_NAME, patches())
