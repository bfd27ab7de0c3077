"""Feature selection: from parsed arguments (Megatron-LM, the pretraining entry) or from Python."""
from __future__ import annotations

import argparse
import functools
import importlib
import weakref
from typing import Iterable, Optional

from ascendspeed.features.base import Feature, FeatureArgumentError
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


def apply_features(args: argparse.Namespace, manager: PatchManager = MANAGER) -> list[str]:
    """Validate, then apply the patches of every enabled feature. Returns the enabled feature names."""
    enabled = enabled_settings(args)
    for feature, settings in enabled:
        manager.apply(feature.name, feature.patches(settings))
    return [feature.name for feature, _ in enabled]


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


def _apply_all(enabled: list, manager: PatchManager) -> None:
    """Apply ``(feature, settings)`` pairs; all or none (a failure reverts those this call applied)."""
    applied = []
    try:
        for feature, settings in enabled:
            applied.append(feature.name)
            manager.apply(feature.name, feature.patches(settings))
    except Exception:
        for name in applied:
            manager.revert(name)
        raise


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
    enabled = enabled_settings(args)
    previous = _ENABLED_BY_CALL.pop(manager, [])
    for feature, _ in previous:
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
    "Feature",
    "FeatureArgumentError",
    "add_feature_arguments",
    "all_features",
    "apply_features",
    "configure_transformer_config",
    "default_arguments",
    "disable_features",
    "enable_features",
    "enabled_settings",
    "feature_parser",
    "validate_features",
]
