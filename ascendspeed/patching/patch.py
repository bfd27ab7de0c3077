"""What a patch is: a target, an explicit kind (replace or wrap), and what it expects to find."""
from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import sys
from typing import Any, Callable, Optional


class PatchKind(enum.Enum):
    REPLACE = "replace"
    WRAP = "wrap"


class _ExistsOnly:
    """Marker for patches on non-callable targets: only their existence is checked."""

    def __repr__(self) -> str:
        return "EXISTS"


EXISTS = _ExistsOnly()


class PatchError(RuntimeError):
    """A patch cannot be applied: its target is missing, changed, or claimed twice."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One change to one attribute.

    ``target`` is ``"package.module:Qualified.name"``: the module to import, then the attribute path
    inside it (a function, a class, or a class attribute such as ``Class.method``).
    ``expect`` is the ``str(inspect.signature(...))`` the original must have, or ``EXISTS`` for
    non-callable targets. For ``REPLACE`` the ``function`` is the new value; for ``WRAP`` it is a
    factory ``function(original) -> new`` so a wrapper always receives what it wraps.
    """

    target: str
    kind: PatchKind
    function: Callable[..., Any]
    expect: Any
    name: str = ""
    sweep: bool = True

    def __post_init__(self):
        if ":" not in self.target:
            raise ValueError(f"patch target {self.target!r} must be 'module:attribute.path'")
        if not self.name:
            object.__setattr__(self, "name", f"{self.kind.value} {self.target}")

    @property
    def module_name(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def attribute_path(self) -> tuple[str, ...]:
        return tuple(self.target.split(":", 1)[1].split("."))


def replace(target: str, replacement: Any, *, expect: Any, name: str = "", sweep: bool = True) -> Patch:
    """A patch that puts ``replacement`` where ``target`` was."""
    return Patch(target, PatchKind.REPLACE, replacement, expect, name, sweep)


def wrap(target: str, wrapper_factory: Callable[[Any], Any], *, expect: Any, name: str = "",
         sweep: bool = True) -> Patch:
    """A patch that puts ``wrapper_factory(original)`` where ``target`` was."""
    return Patch(target, PatchKind.WRAP, wrapper_factory, expect, name, sweep)


def describe_signature(obj: Any, annotations: bool = True) -> str:
    """The signature string patches compare against, or a description of why there is none."""
    function = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return f"<no signature: {type(function).__name__}>"
    if not annotations:
        signature = signature.replace(
            parameters=[p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()],
            return_annotation=inspect.Signature.empty,
        )
    return str(signature)


def installed_version(distribution: str = "megatron-core") -> str:
    try:
        from importlib.metadata import version

        return version(distribution)
    except Exception:  # noqa: BLE001 - a report helper must never raise
        return "not installed"


def resolve_owner(patch: Patch, module) -> tuple[Any, str]:
    """The object holding the patched attribute and the attribute's name."""
    owner = module
    *parents, leaf = patch.attribute_path
    for part in parents:
        owner = getattr(owner, part)
    return owner, leaf


def import_target_module(patch: Patch):
    return sys.modules.get(patch.module_name) or importlib.import_module(patch.module_name)
