"""The contract every feature package fulfils.

A feature is one package under ``ascendspeed/features/`` holding its flags, their validation and its
patches, plus one line in ``registry.py``. Removing a feature is deleting that package and that line.

Features see the parsed arguments (Megatron-LM's, the pretraining entry's, or the namespace built by
``ascendspeed.features.enable_features`` for megatron-core users) and turn them into patches whose
configuration is bound explicitly: hot code never reads global arguments.
"""
from __future__ import annotations

import argparse
from typing import Any, ClassVar, Mapping, Sequence

from ascendspeed.patching import Patch


class FeatureArgumentError(ValueError):
    """An invalid flag or flag combination; the message names the flags and the fix."""


class Feature:
    """Base class of a feature. Subclasses override what they need."""

    #: Short unique name, used in patch reports and error messages.
    name: ClassVar[str] = ""

    #: Megatron-LM flags (dest -> default) the feature reads but does not own. The pretraining entry
    #: defines them itself and ``enable_features`` accepts them as keywords.
    megatron_arguments: ClassVar[Mapping[str, Any]] = {}

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the flags this feature owns (ones Megatron-LM does not already define)."""

    def extend_megatron_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Adjust flags Megatron-LM already defines (e.g. add a choice)."""

    def validate(self, args: argparse.Namespace) -> None:
        """Raise ``FeatureArgumentError`` for unsupported values or combinations."""

    def is_enabled(self, args: argparse.Namespace) -> bool:
        return False

    def patches(self, args: argparse.Namespace) -> Sequence[Patch]:
        """The patches that switch the feature on, configured from ``args``."""
        return ()

    def configure_transformer_config(self, config, args: argparse.Namespace) -> None:
        """Carry feature settings into a ``TransformerConfig`` built from ``args``."""


def add_choices(parser: argparse.ArgumentParser, flag: str, *choices: str) -> None:
    """Add ``choices`` to an existing flag of ``parser``; a flag that is missing is an error."""
    action = parser._option_string_actions.get(flag)
    if action is None:
        raise FeatureArgumentError(f"cannot extend {flag}: the parser does not define it")
    if action.choices is not None:
        action.choices = list(action.choices) + [c for c in choices if c not in action.choices]
