"""The contract every feature package fulfils.

A feature is one package under ``ascendspeed/features/`` holding its flags, their validation, its settings
and its patches, plus one line in ``registry.py``. Removing a feature is deleting that package and that line.

The flow is the same for every feature and every entry (Megatron-LM, the pretraining entry, or
``ascendspeed.features.enable_features`` for megatron-core users)::

    args --validate--> args --settings--> Settings (a frozen dataclass) --patches--> [Patch, ...]

so everything a patch does is decided by one typed settings object, bound into the patch where it is
made: hot code never reads global arguments. What an application of a feature keeps while it runs
(recorders, process groups it built) is its *state*: ``new_state(settings)`` makes it once per application,
``patches(settings, state)`` binds it, and ``telemetry(state)`` hands the entry what to report from it, so
no feature keeps module globals and no entry imports a feature's internals.
"""
from __future__ import annotations

import argparse
from typing import Any, ClassVar, Generic, Mapping, NamedTuple, Optional, Sequence, TypeVar

from ascendspeed.patching import Patch

SettingsT = TypeVar("SettingsT")


class FeatureArgumentError(ValueError):
    """An invalid flag or flag combination; the message names the flags and the fix."""


class Unsupported(NamedTuple):
    """A flag value a feature cannot run with: anything but ``default`` for ``dest`` is refused."""

    dest: str
    flag: str
    default: Any
    why: str


def refuse_unsupported(args: argparse.Namespace, rules: Sequence[Unsupported], what: str) -> None:
    """Raise ``FeatureArgumentError`` for the first rule whose flag is set away from its default."""
    for rule in rules:
        value = getattr(args, rule.dest, rule.default)
        if value != rule.default:
            raise FeatureArgumentError(f"{what} cannot run with {rule.flag} {value}: {rule.why}")


def defaults_of(rules: Sequence[Unsupported]) -> dict[str, Any]:
    """``{dest: default}`` of ``rules``, for a feature's ``megatron_arguments``."""
    return {rule.dest: rule.default for rule in rules}


class FeatureTelemetry:
    """What an entry reports for a feature while it trains: the pretraining entry calls ``step_started`` /
    ``step_finished`` around every training step, ``close_interval`` at every logging interval (its dict goes
    into that interval's progress entry under ``key``) and ``close_run`` at the end (into
    ``TrainResult.telemetry[key]``). Both closes are collectives: every rank calls them."""

    #: Name of the feature's entry in the progress entries and in ``TrainResult.telemetry``.
    key: ClassVar[str] = ""

    def step_started(self) -> None:
        """A training step begins (what ran since, e.g. validation, is not the step's)."""

    def step_finished(self) -> None:
        """The training step ended."""

    def close_interval(self, iteration: int) -> Optional[dict]:
        """The logging interval ending at ``iteration``, over all ranks (it may print a line on rank 0)."""
        return None

    def close_run(self) -> Any:
        """The run's totals over all ranks (any picklable value; None: nothing to report)."""
        return None


class Feature(Generic[SettingsT]):
    """Base class of a feature. Subclasses override what they need."""

    #: Short unique name, used in patch reports and error messages.
    name: ClassVar[str] = ""

    #: Megatron-LM flags (dest -> default) the feature reads but does not own. The pretraining entry
    #: defines them itself and ``enable_features`` accepts them as keywords.
    megatron_arguments: ClassVar[Mapping[str, Any]] = {}

    #: Flags that switch on every patch the feature has: the table of all patches in
    #: ``docs/patching.md`` (``python -m ascendspeed.megatron_adaptor --table``) lists what they apply.
    example_flags: ClassVar[tuple[str, ...]] = ()

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the flags this feature owns (ones Megatron-LM does not already define)."""

    def extend_megatron_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Adjust flags Megatron-LM already defines (e.g. add a choice)."""

    def is_enabled(self, args: argparse.Namespace) -> bool:
        return False

    def validate(self, args: argparse.Namespace) -> None:
        """Raise ``FeatureArgumentError`` for unsupported values or combinations."""

    def settings(self, args: argparse.Namespace) -> Optional[SettingsT]:
        """The typed settings the enabled feature runs with (pure: reads ``args``, changes nothing)."""
        return None

    def new_state(self, settings: SettingsT) -> Any:
        """The state one application of the feature owns (None: it keeps none)."""
        return None

    def patches(self, settings: SettingsT, state: Any = None) -> Sequence[Patch]:
        """The patches that switch the feature on, configured by ``settings`` and bound to ``state``."""
        return ()

    def telemetry(self, state: Any) -> Optional[FeatureTelemetry]:
        """What an entry reports for the application that owns ``state``, or None."""
        return None

    def configure_transformer_config(self, config, settings: SettingsT) -> None:
        """Carry settings into a ``TransformerConfig`` built by an entry that knows the flags."""


def add_choices(parser: argparse.ArgumentParser, flag: str, *choices: str) -> None:
    """Add ``choices`` to an existing flag of ``parser``; a flag that is missing is an error."""
    action = parser._option_string_actions.get(flag)
    if action is None:
        raise FeatureArgumentError(f"cannot extend {flag}: the parser does not define it")
    if action.choices is not None:
        action.choices = list(action.choices) + [c for c in choices if c not in action.choices]
