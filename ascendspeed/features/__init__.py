"""Feature selection: from parsed arguments (Megatron-LM, the pretraining entry) or from Python."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import weakref
from typing import Any, Iterable, Optional

from ascendspeed.features.base import Feature, FeatureArgumentError, FeatureTelemetry
from ascendspeed.features.megatron_flags import add_megatron_arguments
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
    applied = [AppliedFeature(feature, settings, feature.new_state(settings))
               for feature, settings in enabled_settings(args)]
    _apply_all(applied, manager)
    return applied


def applied_features() -> list[AppliedFeature]:
    """The features the latest ``apply_features`` (or ``enable_features``) switched on in this process."""
    return list(_APPLIED)


def configure_transformer_config(config, args: argparse.Namespace):
    """Let each enabled feature carry its settings into ``config``."""
    for feature, settings in enabled_settings(args):
        feature.configure_transformer_config(config, settings)
    return config


def feature_parser() -> argparse.ArgumentParser:
    """Every feature flag and every Megatron-LM flag features read, with their choices, types and defaults:
    the one declaration ``default_arguments`` and ``enable_features`` check values against."""
    parser = argparse.ArgumentParser(add_help=False)
    for feature in all_features():
        feature.add_arguments(parser)
    defaults: dict = {}
    for feature in all_features():
        for dest, default in feature.megatron_arguments.items():
            defaults.setdefault(dest, default)
    add_megatron_arguments(parser, defaults)
    for feature in all_features():
        feature.extend_megatron_arguments(parser)
    return parser


def default_arguments() -> argparse.Namespace:
    """The defaults of every feature flag and of the Megatron flags features read."""
    return feature_parser().parse_args([])


def _checked(action: argparse.Action, key: str, value):
    """``value`` for ``action``'s flag, refused unless argparse would accept it (choices, type, on/off)."""
    flag = action.option_strings[0]
    if action.nargs == 0:
        if not isinstance(value, bool):
            raise FeatureArgumentError(f"enable_features: {key} ({flag}) is an on/off flag: pass True or False, "
                                       f"got {type(value).__name__} {value!r}")
        return value
    if value is None and action.default is None:
        return value
    values = value if action.nargs == "+" else [value]
    if action.nargs == "+" and not (isinstance(value, (list, tuple)) and value):
        raise FeatureArgumentError(f"enable_features: {key} ({flag}) takes a non-empty list, got {value!r}")
    for item in values:
        kind = action.type
        if kind is float and isinstance(item, int) and not isinstance(item, bool):
            continue
        if kind is not None and (not isinstance(item, kind) or (kind is int and isinstance(item, bool))):
            raise FeatureArgumentError(f"enable_features: {key} ({flag}) must be {kind.__name__}, "
                                       f"got {type(item).__name__} {item!r}")
        if action.choices is not None and item not in action.choices:
            raise FeatureArgumentError(f"enable_features: {key}={item!r} is not a choice of {flag}; "
                                       f"choose from {', '.join(map(repr, action.choices))}")
    return float(value) if action.type is float and value is not None else value


#: What the last ``enable_features`` call applied, per manager: the next call reverts it first.
_ENABLED_BY_CALL: "weakref.WeakKeyDictionary[PatchManager, list]" = weakref.WeakKeyDictionary()


def _apply_all(features: list[AppliedFeature], manager: PatchManager) -> None:
    """Apply each feature's patches bound to its state; all or none (a failure reverts those this call
    applied). What applied becomes ``applied_features()``."""
    applied = []
    try:
        for feature in features:
            applied.append(feature.name)
            manager.apply(feature.name, feature.feature.patches(feature.settings, feature.state))
    except Exception:
        for name in applied:
            manager.revert(name)
        raise
    _APPLIED[:] = features


def enable_features(manager: PatchManager = MANAGER, **settings) -> argparse.Namespace:
    """The Python switch for megatron-core users, e.g. ``enable_features(swiglu=True, use_fused_swiglu=True)``.

    Keywords are flag destinations (``--use-fused-swiglu`` -> ``use_fused_swiglu``), checked as the flags
    are (choices, types). Each call states the whole selection: a second call replaces the first (its
    patches are reverted, then the new set applied), so calls never accumulate. A call that fails its
    checks, or whose patches do not apply, leaves the previous selection in place. Returns the namespace
    the features were configured from.
    """
    parser = feature_parser()
    args = parser.parse_args([])
    actions = {action.dest: action for action in parser._actions}
    unknown = sorted(set(settings) - set(vars(args)))
    if unknown:
        raise FeatureArgumentError(
            f"unknown ascendspeed setting(s) {', '.join(unknown)}; known: {', '.join(sorted(vars(args)))}"
        )
    for key, value in settings.items():
        setattr(args, key, _checked(actions[key], key, value))
    enabled = [AppliedFeature(feature, values, feature.new_state(values))
               for feature, values in enabled_settings(args)]
    previous = _ENABLED_BY_CALL.pop(manager, [])
    for feature in previous:
        manager.revert(feature.name)
    try:
        _apply_all(enabled, manager)
    except Exception:
        _apply_all(previous, manager)
        _ENABLED_BY_CALL[manager] = previous
        raise
    _ENABLED_BY_CALL[manager] = enabled
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
    "feature_parser",
    "validate_features",
]
