"""What autograd keeps for backward, counted exactly: a saved-tensor hook sees every tensor an operation saves,
and the wrapper it returns lives exactly as long as autograd keeps the tensor. A storage saved several times
counts once, while any of its savers lives; weights and gradient buffers (a linear saves its weight) are not
activations and are left out. Per-layer bytes are the growth of the live total across a layer's forward.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterable, Optional

import torch


def _in_backward() -> bool:
    """Whether autograd's engine is running on this thread (a recomputation inside backward)."""
    return torch._C._current_graph_task_id() != -1


def _storage_key(tensor: torch.Tensor) -> Optional[tuple]:
    storage = tensor.untyped_storage()
    pointer = storage.data_ptr()
    return (tensor.device, pointer) if pointer else None


class _Saved:
    __slots__ = ("tensor", "key", "account")

    def __init__(self, tensor, key, account):
        self.tensor, self.key, self.account = tensor, key, account

    def __del__(self):
        self.account._release(self.key)


class SavedTensorAccount:
    """Live and peak bytes of the activations autograd keeps, while ``recording()`` is active."""

    def __init__(self, excluded: Iterable[torch.Tensor] = ()):
        self._excluded = {key for key in (_storage_key(t) for t in excluded if t is not None) if key}
        self._savers: dict = {}
        self.live = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.live

    def _pack(self, tensor: torch.Tensor):
        key = _storage_key(tensor)
        if key is None or key in self._excluded:
            return tensor
        entry = self._savers.get(key)
        if entry is None:
            nbytes = tensor.untyped_storage().nbytes()
            self._savers[key] = [1, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1
        return _Saved(tensor, key, self)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key) -> None:
        entry = self._savers.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._savers[key]

    @contextlib.contextmanager
    def recording(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield


class ModuleProbe:
    """Forward hooks on modules: per module, the live saved bytes its forward added, its forward seconds and
    the bytes of its input hidden states (what a full recompute keeps), summed over the forward passes (not
    the recomputations inside backward) since the last ``take``."""

    def __init__(self, account: SavedTensorAccount, modules: dict):
        self.account = account
        self.handles = []
        self.totals = {}
        self._open = {}
        for name, module in modules.items():
            self.handles.append(module.register_forward_pre_hook(self._before(name), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._after(name)))

    def _before(self, name):
        def hook(module, args, kwargs):
            if not _in_backward():
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                nbytes = hidden.untyped_storage().nbytes() if isinstance(hidden, torch.Tensor) else 0
                self._open[name] = (self.account.live, time.perf_counter(), nbytes)
        return hook

    def _after(self, name):
        def hook(module, args, output):
            opened = self._open.pop(name, None)
            if opened is None:
                return
            live, started, input_bytes = opened
            saved, seconds, inputs, calls = self.totals.get(name, (0, 0.0, 0, 0))
            self.totals[name] = (saved + self.account.live - live, seconds + time.perf_counter() - started,
                                 inputs + input_bytes, calls + 1)
        return hook

    def take(self) -> dict:
        totals, self.totals = self.totals, {}
        return totals

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
