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


class _AbsentOnly:
    """Marker for ``replace`` patches that add a name the target module lacks (it must be missing)."""

    def __repr__(self) -> str:
        return "ABSENT"


#: ``expect=ABSENT``: the attribute must not exist; the replacement adds it and ``revert`` deletes it again.
ABSENT = _AbsentOnly()


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


def _stubbed_class_init(obj: Any) -> Any:
    """The ``__init__`` of a class whose base was a ``unittest.mock`` object, or None.

    A library stubs an absent optional dependency with ``dep = MagicMock()``; ``class C(dep.Base): ...`` then
    makes ``C`` a mock whose return value is the class body's namespace (the mock type is called with
    ``(name, bases, namespace)``). The body's ``__init__`` is what callers of ``C(...)`` depend on.
    """
    mock = sys.modules.get("unittest.mock")
    if mock is None or not isinstance(obj, mock.NonCallableMock):
        return None
    body = getattr(obj, "_mock_return_value", None)
    if isinstance(body, dict) and "__qualname__" in body and callable(body.get("__init__")):
        return body["__init__"]
    return None


def describe_signature(obj: Any) -> str:
    """What a caller of ``obj`` depends on: parameter names, kinds and defaults, written like a signature.

    Annotations are left out: they change spelling with ``from __future__ import annotations`` (newer
    megatron-core) without the signature changing. A class is described as calling it is (``__new__`` or
    ``__init__`` without its first parameter); so is a class stubbed on a mocked base
    (``_stubbed_class_init``).
    """
    stub_init = _stubbed_class_init(obj)
    if stub_init is not None:
        signature = inspect.signature(stub_init)
        parameters = [parameter.replace(annotation=inspect.Parameter.empty)
                      for parameter in list(signature.parameters.values())[1:]]
        return str(signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty))
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
