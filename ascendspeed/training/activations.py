"""What autograd keeps for backward, counted exactly: a saved-tensor hook sees every tensor an operation saves,
and the wrapper it returns lives exactly as long as autograd keeps the tensor. A storage saved several times
counts once, while any of its savers lives; the model's state (weights, gradients and their buffers: a linear
saves its weight) is not an activation and is left out.

Accounts nest: torch uses only the innermost pair of saved-tensor hooks, so one pair serves every account that
is recording, and a tensor saved while several record is counted by each (the pretraining entry's activation
line around a step, adaptive recompute's per-layer profile inside it).
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch

_RECORDING: list["SavedTensorAccount"] = []


def _storage_key(tensor: torch.Tensor) -> Optional[tuple]:
    storage = tensor.untyped_storage()
    pointer = storage.data_ptr()
    return (tensor.device, pointer) if pointer else None


def model_state_tensors(model_chunks) -> list:
    """The tensors of megatron DDP model chunks that are not activations: parameters, their gradients and the
    DDP buffers behind them."""
    tensors = []
    for chunk in model_chunks:
        for param in chunk.parameters():
            tensors += [param, getattr(param, "main_grad", None), param.grad]
        for buffer in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", [])):
            tensors += [getattr(buffer, "grad_data", None), getattr(buffer, "param_data", None)]
    return tensors


class _Saved:
    __slots__ = ("tensor", "key", "accounts")

    def __init__(self, tensor, key, accounts):
        self.tensor, self.key, self.accounts = tensor, key, accounts

    def __del__(self):
        for account in self.accounts:
            account._release(self.key)


def _pack(tensor: torch.Tensor):
    key = _storage_key(tensor)
    if key is None:
        return tensor
    counted = tuple(account for account in _RECORDING if account._count(tensor, key))
    return _Saved(tensor, key, counted) if counted else tensor


def _unpack(saved):
    return saved.tensor if isinstance(saved, _Saved) else saved


class SavedTensorAccount:
    """Live and peak bytes of the activations autograd keeps, while ``recording()`` is active."""

    def __init__(self, excluded: Iterable[torch.Tensor] = ()):
        self._excluded = {key for key in (_storage_key(t) for t in excluded if t is not None) if key}
        self._savers: dict = {}
        self.live = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.live

    def _count(self, tensor: torch.Tensor, key: tuple) -> bool:
        if key in self._excluded:
            return False
        entry = self._savers.get(key)
        if entry is None:
            nbytes = tensor.untyped_storage().nbytes()
            self._savers[key] = [1, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1
        return True

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
        hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack) if not _RECORDING else None
        if hooks is not None:
            hooks.__enter__()
        _RECORDING.append(self)
        try:
            yield self
        finally:
            _RECORDING.remove(self)
            if hooks is not None:
                hooks.__exit__(None, None, None)
