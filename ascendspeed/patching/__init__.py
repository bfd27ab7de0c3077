"""A generic, reversible patch manager (see ``manager.py`` for the rules it enforces)."""
from ascendspeed.patching.manager import MANAGER, PatchManager
from ascendspeed.patching.patch import EXISTS, Patch, PatchError, PatchKind, describe_signature, replace, wrap

__all__ = [
    "EXISTS",
    "MANAGER",
    "Patch",
    "PatchError",
    "PatchKind",
    "PatchManager",
    "describe_signature",
    "replace",
    "wrap",
]
