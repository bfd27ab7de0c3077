"""Feature selection: from parsed arguments (Megatron-LM, the pretraining entry) or from Python."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
from typing import Any, Iterable, Optional

from ascendspeed.features.base import Feature, FeatureArgumentError, FeatureTelemetry
from ascendspeed.features.registry import FEATURE_MODULES
from ascendspeed.patching import MANAGER, PatchManager


@functools.lru_cache(maxsize=None)
def all_features() -> tuple[Feature, ...]:
    return tuple(importlib.import_module(path).FEATURE for path in FEATURE_MODULES)


def add_feature_arguments(parser: argparse.ArgumentParser, extend_megatron: bool = True) -> argparse.ArgumentParser:
    """Register every feature's flags (and, with ``extend_megatron``, its changes to Megatron's flags)."""
    for feature in all_features():
        feature.add_arguments(parser)
        if extend_megatron:
            feature.extend_megatron_arguments(parser)
    return parser


def validate_features(args: argparse.Namespace) -> list[Feature]:
    """Validate every feature against ``args``; return the enabled ones."""
    for feature in all_features():
        feature.validate(args)
    return [feature for feature in all_features() if feature.is_enabled(args)]


def enabled_settings(args: argparse.Namespace) -> list[tuple[Feature, object]]:
    """Validate every feature; ``(feature, settings)`` of the enabled ones, in registry order."""
    return [(feature, feature.settings(args)) for feature in validate_features(args)]


@dataclasses.dataclass(frozen=True)
class AppliedFeature:
    """A feature as ``apply_features`` switched it on: its settings and the state its patches are bound to."""

    feature: Feature
    settings: Any
    state: Any

    @property
    def name(self) -> str:
        return self.feature.name

    def telemetry(self) -> Optional[FeatureTelemetry]:
        return self.feature.telemetry(self.state)


#: What the latest ``apply_features`` switched on (``applied_features()``); features revert by name.
_APPLIED: list[AppliedFeature] = []


def apply_features(args: argparse.Namespace, manager: PatchManager = MANAGER) -> list[AppliedFeature]:
    """Validate, then apply the patches of every enabled feature, each bound to a new state. Returns the
    enabled features (``.name``, ``.telemetry()``), in registry order."""
    applied = []
    for feature, settings in enabled_settings(args):
        state = feature.new_state(settings)
        manager.apply(feature.name, feature.patches(settings, state))
        applied.append(AppliedFeature(feature, settings, state))
    _APPLIED[:] = applied
    return applied


def applied_features() -> list[AppliedFeature]:
    """The features the latest ``apply_features`` (or ``enable_features``) switched on in this process."""
    return list(_APPLIED)


def configure_transformer_config(config, args: argparse.Namespace):
    """Let each enabled feature carry its settings into ``config``."""
    for feature, settings in enabled_settings(args):
        feature.configure_transformer_config(config, settings)
    return config


def default_arguments() -> argparse.Namespace:
    """The defaults of every feature flag and of the Megatron flags features read."""
    parser = argparse.ArgumentParser(add_help=False)
    add_feature_arguments(parser, extend_megatron=False)
    args = parser.parse_args([])
    for feature in all_features():
        for dest, default in feature.megatron_arguments.items():
            setattr(args, dest, getattr(args, dest, default))
    return args


def enable_features(manager: PatchManager = MANAGER, **settings) -> argparse.Namespace:
    """The Python switch for megatron-core users, e.g. ``enable_features(swiglu=True, use_fused_swiglu=True)``.

    Keywords are flag destinations (``--use-fused-swiglu`` -> ``use_fused_swiglu``). Returns the namespace
    the features were configured from.
    """
    args = default_arguments()
    unknown = sorted(set(settings) - set(vars(args)))
    if unknown:
        raise FeatureArgumentError(
            f"unknown ascendspeed setting(s) {', '.join(unknown)}; known: {', '.join(sorted(vars(args)))}"
        )
    for key, value in settings.items():
        setattr(args, key, value)
    apply_features(args, manager)
    return args


def disable_features(names: Optional[Iterable[str]] = None, manager: PatchManager = MANAGER) -> None:
    """Revert the patches of the named features (all features when ``names`` is None)."""
    for feature in all_features():
        if names is None or feature.name in names:
            manager.revert(feature.name)


__all__ = [
    "AppliedFeature",
    "Feature",
    "FeatureArgumentError",
    "FeatureTelemetry",
    "add_feature_arguments",
    "all_features",
    "applied_features",
    "apply_features",
    "configure_transformer_config",
    "default_arguments",
    "disable_features",
    "enable_features",
    "enabled_settings",
    "validate_features",
]
