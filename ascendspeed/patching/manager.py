"""The patch manager: applies, stacks, sweeps, reports and reverts patches. Knows nothing of Megatron.

Rules it enforces:

* a target module that is already imported is patched at once; one that is not is patched the moment it
  finishes loading (an import hook), so the adaptor can be imported before or after Megatron;
* copies of the original bound elsewhere by ``from module import name`` are swept and swapped too, in
  every loaded module and in every module that loads later (ascendspeed's own modules excepted: they
  keep originals on purpose; others ask ``PatchManager.original(target)``); the pass over the loaded
  modules happens once per ``apply`` call, for all its newly patched targets, and never again for them:
  later patches on a target and ``revert`` rewrite only the copies on record;
* at most one ``replace`` per target: a second one, from any feature, is an error naming both;
* wraps stack on top of the replacement (or the original) in the order they were applied, the last
  applied outermost;
* applying the same patch for the same feature twice is a no-op; ``revert`` restores originals
  everywhere, swept copies included.
"""
from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Any, Iterable, Optional

from ascendspeed.patching.patch import (
    ABSENT,
    EXISTS,
    Patch,
    PatchError,
    PatchKind,
    describe_signature,
    installed_version,
    resolve_owner,
)


@dataclasses.dataclass
class _AppliedPatch:
    feature: str
    patch: Patch

    @property
    def key(self) -> tuple:
        return (self.feature, self.patch.target, self.patch.kind, self.patch.name)


@dataclasses.dataclass
class _Target:
    """Everything needed to recompute and undo one patched attribute."""

    target: str
    owner: Any
    attribute: str
    original: Any
    owned_original: bool
    sweep: bool
    applied: list = dataclasses.field(default_factory=list)
    current: Any = None
    swept: dict = dataclasses.field(default_factory=dict)

    def effective_value(self) -> Any:
        base = self.original
        for entry in self.applied:
            if entry.patch.kind is PatchKind.REPLACE:
                base = entry.patch.function
        for entry in self.applied:
            if entry.patch.kind is PatchKind.WRAP:
                base = _apply_wrapper(entry.patch.function, base)
        return base


def _apply_wrapper(factory, original):
    """Wrap plain functions directly; static and class methods keep their descriptor type."""
    if isinstance(original, staticmethod):
        return staticmethod(factory(original.__func__))
    if isinstance(original, classmethod):
        return classmethod(factory(original.__func__))
    return factory(original)


def _is_own_module(module) -> bool:
    """ascendspeed's modules keep references to originals on purpose (fallbacks): never sweep them."""
    name = getattr(module, "__name__", "") or ""
    return name == "ascendspeed" or name.startswith("ascendspeed.")


def _is_sweepable(value: Any) -> bool:
    return callable(value) and not isinstance(value, (int, float, str, bytes, bool))


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Calls ``manager._on_module_loaded`` after each Python source module finishes executing."""

    def __init__(self, manager: "PatchManager"):
        self._manager = manager
        self._resolving = threading.local()

    def find_spec(self, fullname, path, target=None):
        resolving = self._resolving.__dict__.setdefault("names", set())
        if fullname in resolving:  # asked again by another hook that is asking every finder
            return None
        resolving.add(fullname)
        try:
            spec = self._find_with_other_finders(fullname, path, target)
        finally:
            resolving.discard(fullname)
        if spec is None:
            return None
        loader = spec.loader
        if isinstance(loader, importlib.machinery.SourceFileLoader):
            # Chain on whatever exec_module the loader has now: another manager's hook may have wrapped it.
            original_exec = loader.exec_module
            manager = self._manager

            def exec_module(module):
                original_exec(module)
                manager._on_module_loaded(module)

            loader.exec_module = exec_module
        return spec

    def _find_with_other_finders(self, fullname, path, target):
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    return spec
        return None


class PatchManager:
    def __init__(self):
        self._targets: dict[str, _Target] = {}
        self._pending: dict[str, list[_AppliedPatch]] = {}
        self._hook: Optional[_PostImportHook] = None
        self._lock = threading.RLock()

    # -- public API -------------------------------------------------------------------------
    def apply(self, feature: str, patches: Iterable[Patch]) -> None:
        """Apply ``patches`` on behalf of ``feature``; patches on unloaded modules wait for their import.

        A patch written for other megatron-core releases (``Patch.megatron``) is a variant for those
        releases: it is left out here, and the variant for the installed release applies instead.
        All or nothing: when a patch fails its check, the ones this call applied before it are withdrawn,
        so a feature is never left half applied.
        """
        installed = installed_version()
        with self._lock:
            added, new_targets = [], []
            try:
                for patch in patches:
                    if patch.megatron is not None and installed not in patch.megatron:
                        continue
                    entry = _AppliedPatch(feature, patch)
                    if self._is_known(entry):
                        continue
                    module = sys.modules.get(patch.module_name)
                    if module is None or self._is_loading(module):
                        self._pending.setdefault(patch.module_name, []).append(entry)
                        self._ensure_hook()
                    else:
                        new_targets.extend(self._apply_now(entry, module))
                    added.append(entry)
            except PatchError:
                self._withdraw(added)
                raise
            self._sweep_loaded_modules(new_targets)

    def _withdraw(self, entries: list) -> None:
        """Undo exactly ``entries`` (applied or pending), restoring originals where nothing else remains."""
        for entry in entries:
            waiting = self._pending.get(entry.patch.module_name, [])
            if entry in waiting:
                waiting.remove(entry)
                if not waiting:
                    del self._pending[entry.patch.module_name]
                continue
            record = self._targets.get(entry.patch.target)
            if record is None or entry not in record.applied:
                continue
            record.applied.remove(entry)
            if record.applied:
                self._install(record)
            else:
                self._restore(record)
                del self._targets[entry.patch.target]
        if not self._targets and not self._pending:
            self._remove_hook()

    def revert(self, feature: Optional[str] = None) -> None:
        """Undo the patches of ``feature`` (all features when None), restoring originals everywhere."""
        with self._lock:
            for module_name in list(self._pending):
                kept = [e for e in self._pending[module_name] if feature is not None and e.feature != feature]
                if kept:
                    self._pending[module_name] = kept
                else:
                    del self._pending[module_name]
            for name in list(self._targets):
                record = self._targets[name]
                kept = [e for e in record.applied if feature is not None and e.feature != feature]
                if len(kept) == len(record.applied):
                    continue
                record.applied = kept
                if record.applied:
                    self._install(record)
                else:
                    self._restore(record)
                    del self._targets[name]
            if not self._targets and not self._pending:
                self._remove_hook()

    def report(self) -> list[dict]:
        """One row per patch: feature, kind, target, name, state (applied or waiting for import)."""
        with self._lock:
            rows = []
            for record in self._targets.values():
                for entry in record.applied:
                    rows.append(self._row(entry, "applied", len(record.swept)))
            for entries in self._pending.values():
                rows.extend(self._row(entry, "pending import", 0) for entry in entries)
            return rows

    def original(self, target: str) -> Any:
        """What ``target`` held before any patch (sweeping rebinds other modules' copies, so ask here)."""
        with self._lock:
            record = self._targets.get(target)
            if record is None:
                raise KeyError(f"{target} is not patched")
            return record.original

    def features(self) -> set[str]:
        return {row["feature"] for row in self.report()}

    def format_report(self, markdown: bool = False) -> str:
        """The report as a text table (or a Markdown one): feature, kind, target, where it is defined."""
        if not self._targets and not self._pending:
            return "ascendspeed: no patches applied"
        return format_rows(self.report(), markdown)

    # -- applying -----------------------------------------------------------------------------
    @staticmethod
    def _row(entry: _AppliedPatch, state: str, swept: int) -> dict:
        return patch_row(entry.feature, entry.patch, state, swept)

    def _is_known(self, entry: _AppliedPatch) -> bool:
        record = self._targets.get(entry.patch.target)
        if record and any(e.key == entry.key for e in record.applied):
            return True
        return any(e.key == entry.key for e in self._pending.get(entry.patch.module_name, ()))

    @staticmethod
    def _is_loading(module) -> bool:
        spec = getattr(module, "__spec__", None)
        return bool(spec is not None and getattr(spec, "_initializing", False))

    def _apply_now(self, entry: _AppliedPatch, module) -> list[_Target]:
        """Install ``entry``; returns its target when this made it patched (a sweep of loaded modules is due)."""
        patch = entry.patch
        record = self._targets.get(patch.target)
        if record is None:
            record = self._new_record(entry, module)
        self._check_conflict(record, entry)
        record.applied.append(entry)
        self._install(record)
        if patch.target in self._targets:
            return []
        self._targets[patch.target] = record
        self._ensure_hook()
        return [record] if record.sweep else []

    def _new_record(self, entry: _AppliedPatch, module) -> _Target:
        patch = entry.patch
        try:
            owner, attribute = resolve_owner(patch, module)
        except AttributeError as exc:
            raise self._error(entry, "the target's parent does not exist", f"missing ({exc})") from None
        if patch.expect is ABSENT:
            if hasattr(owner, attribute):
                raise self._error(entry, "the attribute to be missing (the patch adds it)",
                                  f"{type(getattr(owner, attribute)).__name__} {getattr(owner, attribute)!r}")
            if patch.kind is not PatchKind.REPLACE:
                raise self._error(entry, "a replace patch (a missing attribute cannot be wrapped)", "a wrap")
            return _Target(target=patch.target, owner=owner, attribute=attribute, original=None,
                           owned_original=False, sweep=False, current=None)
        if not hasattr(owner, attribute):
            raise self._error(entry, "the attribute to exist", "missing")
        is_class = isinstance(owner, type)
        owned = not is_class or attribute in vars(owner)
        # A class's own __dict__ entry keeps staticmethod/classmethod descriptors intact.
        original = vars(owner)[attribute] if is_class and owned else getattr(owner, attribute)
        if patch.expect is not EXISTS:
            found = describe_signature(original)
            if found != patch.expect:
                raise self._error(entry, f"signature {patch.expect}", f"signature {found}")
        return _Target(
            target=patch.target,
            owner=owner,
            attribute=attribute,
            original=original,
            owned_original=owned,
            sweep=patch.sweep and not isinstance(owner, type) and _is_sweepable(original),
            current=original,
        )

    def _check_conflict(self, record: _Target, entry: _AppliedPatch) -> None:
        if entry.patch.kind is not PatchKind.REPLACE:
            return
        for other in record.applied:
            if other.patch.kind is PatchKind.REPLACE:
                raise PatchError(
                    f"ascendspeed: features {other.feature!r} (patch {other.patch.name!r}) and "
                    f"{entry.feature!r} (patch {entry.patch.name!r}) both replace {record.target}; "
                    "only one replacement per target is allowed: disable one of the two features, "
                    "or turn one patch into a wrap"
                )

    def _error(self, entry: _AppliedPatch, expected: str, found: str) -> PatchError:
        return PatchError(
            f"ascendspeed: patch {entry.patch.name!r} of feature {entry.feature!r} ({entry.patch.defined_at}) "
            f"cannot be applied to {entry.patch.target}: expected {expected}, found {found} "
            f"(installed megatron-core {installed_version()}). The upstream code changed: "
            "update the patch for this version or use a supported megatron-core."
        )

    # -- installing, sweeping, restoring --------------------------------------------------------
    def _install(self, record: _Target) -> None:
        """Set the target's effective value, and in every copy a sweep found (a new target is swept next)."""
        new = record.effective_value()
        setattr(record.owner, record.attribute, new)
        record.current = new
        for (_, key), namespace in record.swept.items():
            namespace[key] = new

    def _sweep_loaded_modules(self, records: list[_Target]) -> None:
        """Point copies of the targets' originals in every loaded module at the patches, remembering them.

        One pass over all modules for a whole batch of newly patched targets: once swept, a target's copies
        are known (modules loading later are handled on load), so patches added to or reverted from it
        later update those copies without another pass.
        """
        originals: dict[int, list[_Target]] = {}
        for record in records:
            originals.setdefault(id(record.original), []).append(record)
        if not originals:
            return
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if namespace is None or _is_own_module(module):
                continue
            copies = [(key, id(value)) for key, value in list(namespace.items()) if id(value) in originals]
            for key, identity in copies:
                for record in originals[identity]:
                    if module is not record.owner:
                        self._rebind(record, namespace, key)
                        break

    @staticmethod
    def _rebind(record: _Target, namespace: dict, key: str) -> None:
        namespace[key] = record.current
        record.swept[(id(namespace), key)] = namespace

    def _restore(self, record: _Target) -> None:
        if record.owned_original:
            setattr(record.owner, record.attribute, record.original)
        else:
            delattr(record.owner, record.attribute)
        for (_, key), namespace in record.swept.items():
            if namespace.get(key) is record.current:
                namespace[key] = record.original
        record.swept.clear()
        record.current = record.original

    def _on_module_loaded(self, module) -> None:
        """Apply patches waiting for ``module``, then sweep it in one pass over its namespace.

        A module that loads after a patch may hold the original (a circular import) or the patch itself
        (``from target import name``); the latter is remembered, so ``revert`` restores it, but only under
        the target's own name, so that a module defining the replacement is never mistaken for a copy.
        """
        with self._lock:
            new_targets = []
            for entry in self._pending.pop(module.__name__, []):
                new_targets.extend(self._apply_now(entry, module))
            self._sweep_loaded_modules(new_targets)
            namespace = getattr(module, "__dict__", None)
            records = [r for r in self._targets.values() if r.sweep and r.owner is not module]
            if namespace is None or not records or _is_own_module(module):
                return
            originals = {id(r.original): r for r in records}
            patched = {id(r.current): r for r in records}
            for key, value in list(namespace.items()):
                record = originals.get(id(value))
                if record is None:
                    record = patched.get(id(value))
                    if record is None or key != record.attribute:
                        continue
                self._rebind(record, namespace, key)

    def _ensure_hook(self) -> None:
        if self._hook is None:
            self._hook = _PostImportHook(self)
            sys.meta_path.insert(0, self._hook)

    def _remove_hook(self) -> None:
        if self._hook is not None:
            sys.meta_path.remove(self._hook)
            self._hook = None


def patch_row(feature: str, patch: Patch, state: str = "", swept: int = 0) -> dict:
    """One row of a report: what a patch is, for which feature, where it is defined, and its state."""
    return {
        "feature": feature,
        "kind": patch.kind.value,
        "target": patch.target,
        "name": patch.name,
        "state": state,
        "swept_copies": swept,
        "megatron": str(patch.megatron or "any"),
        "defined_at": patch.defined_at,
    }


def format_rows(rows: list[dict], markdown: bool = False) -> str:
    """Rows as a text table (feature, kind, state, swept copies, target, definition) or a Markdown table
    (feature, kind, target, megatron-core releases, definition), sorted by feature and target."""
    rows = sorted(rows, key=lambda r: (r["feature"], r["target"], r["megatron"], r["defined_at"]))
    if markdown:
        lines = ["| feature | kind | target | megatron-core | defined at |", "|---|---|---|---|---|"]
        lines += [f"| {r['feature']} | {r['kind']} | `{r['target']}` | {r['megatron']} | `{r['defined_at']}` |"
                  for r in rows]
        return "\n".join(lines)
    lines = [f"{'feature':<24} {'kind':<8} {'state':<15} {'copies':>6}  target  (defined at)"]
    for row in rows:
        lines.append(
            f"{row['feature']:<24} {row['kind']:<8} {row['state']:<15} {row['swept_copies']:>6}  "
            f"{row['target']}  ({row['defined_at']})"
        )
    return "\n".join(lines)


MANAGER = PatchManager()
