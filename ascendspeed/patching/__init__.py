"""A generic, reversible patch manager (see ``manager.py`` for the rules it enforces)."""
from ascendspeed.patching.manager import MANAGER, PatchManager
from ascendspeed.patching.patch import ABSENT, EXISTS, Patch, PatchError, PatchKind, describe_signature, replace, wrap
from ascendspeed.patching.versions import VersionRange, release

__all__ = [
    "ABSENT",
    "EXISTS",
    "MANAGER",
    "Patch",
    "PatchError",
    "PatchKind",
    "PatchManager",
    "VersionRange",
    "describe_signature",
    "release",
    "replace",
    "wrap",
]
