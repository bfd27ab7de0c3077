"""What a patch is: a target, an explicit kind (replace or wrap), and what it expects to find."""
from __future__ import annotations

import dataclasses
import enum
import inspect
import os
import sys
from typing import Any, Callable, Optional

from ascendspeed.patching.versions import VersionRange


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
    ``expect`` is the signature the original must have as ``describe_signature`` writes it (parameter
    names, kinds and defaults; annotations are not compared), or ``EXISTS`` for targets whose signature
    is not ours to pin. For ``REPLACE`` the ``function`` is the new value; for ``WRAP`` it is a factory
    ``function(original) -> new`` so a wrapper always receives what it wraps. ``megatron`` is the range
    of megatron-core releases the patch is written for (all when None); ``defined_at`` is the
    ``file:line`` that created the patch, filled in by ``replace``/``wrap``.
    """

    target: str
    kind: PatchKind
    function: Callable[..., Any]
    expect: Any
    name: str = ""
    sweep: bool = True
    megatron: Optional[VersionRange] = None
    defined_at: str = ""

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


def _caller_location(depth: int = 2) -> str:
    """``path:line`` of the code that called ``replace``/``wrap``, relative to the repository root."""
    frame = sys._getframe(depth)
    path = os.path.abspath(frame.f_code.co_filename)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if path.startswith(root + os.sep):
        path = os.path.relpath(path, root)
    return f"{path}:{frame.f_lineno}"


def replace(target: str, replacement: Any, *, expect: Any, name: str = "", sweep: bool = True,
            megatron: Optional[str] = None) -> Patch:
    """A patch that puts ``replacement`` where ``target`` was."""
    return Patch(target, PatchKind.REPLACE, replacement, expect, name, sweep,
                 VersionRange.parse(megatron) if megatron else None, _caller_location())


def wrap(target: str, wrapper_factory: Callable[[Any], Any], *, expect: Any, name: str = "",
         sweep: bool = True, megatron: Optional[str] = None) -> Patch:
    """A patch that puts ``wrapper_factory(original)`` where ``target`` was."""
    return Patch(target, PatchKind.WRAP, wrapper_factory, expect, name, sweep,
                 VersionRange.parse(megatron) if megatron else None, _caller_location())


def describe_signature(obj: Any) -> str:
    """What a caller of ``obj`` depends on: parameter names, kinds and defaults, written like a signature.

    Annotations are left out: they change spelling with ``from __future__ import annotations`` (newer
    megatron-core) without the signature changing.
    """
    function = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return f"<no signature: {type(function).__name__}>"
    parameters = [parameter.replace(annotation=inspect.Parameter.empty)
                  for parameter in signature.parameters.values()]
    return str(signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty))


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
