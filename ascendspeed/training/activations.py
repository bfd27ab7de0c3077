"""What autograd keeps for backward, counted exactly: a saved-tensor hook sees every tensor an operation saves,
and the wrapper it returns lives exactly as long as autograd keeps the tensor. A storage saved several times
counts once, while any of its savers lives; the model's state (weights, gradients and their buffers: a linear
saves its weight) is not an activation and is left out.

Accounts nest: torch uses only the innermost pair of saved-tensor hooks, so one pair serves every account that
is recording, and a tensor saved while several record is counted by each (the pretraining entry's activation
line around a step, adaptive recompute's per-layer profile inside it).

A storage freed while saved (megatron-core's norm recompute frees the norm's output, which the next linear
saved, and recomputes it in backward) stops counting when it is freed (``stop_counting``); its
re-materialisation inside backward is not counted.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch

_RECORDING: list["SavedTensorAccount"] = []


def storage_key(tensor: torch.Tensor) -> Optional[tuple]:
    """How an account knows a storage (None for an empty one)."""
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


class _Storage:
    """One saved storage in one account: its savers alive, and its bytes while they hold it."""

    __slots__ = ("key", "savers", "nbytes")

    def __init__(self, key: tuple, nbytes: int):
        self.key, self.savers, self.nbytes = key, 0, nbytes


class _Saved:
    __slots__ = ("tensor", "counted")

    def __init__(self, tensor, counted):
        self.tensor, self.counted = tensor, counted

    def __del__(self):
        for account, storage in self.counted:
            account._release(storage)


def _pack(tensor: torch.Tensor):
    key = storage_key(tensor)
    if key is None:
        return tensor
    counted = tuple((account, storage) for account in _RECORDING
                    for storage in (account._count(tensor, key),) if storage is not None)
    return _Saved(tensor, counted) if counted else tensor


def _unpack(saved):
    return saved.tensor if isinstance(saved, _Saved) else saved


class SavedTensorAccount:
    """Live and peak bytes of the activations autograd keeps, while ``recording()`` is active."""

    def __init__(self, excluded: Iterable[torch.Tensor] = ()):
        self._excluded = {key for key in (storage_key(t) for t in excluded if t is not None) if key}
        self._savers: dict = {}
        self.live = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.live

    def _count(self, tensor: torch.Tensor, key: tuple) -> Optional[_Storage]:
        if key in self._excluded:
            return None
        storage = self._savers.get(key)
        if storage is None:
            storage = self._savers[key] = _Storage(key, tensor.untyped_storage().nbytes())
            self.live += storage.nbytes
            self.peak = max(self.peak, self.live)
        storage.savers += 1
        return storage

    def _release(self, storage: _Storage) -> None:
        storage.savers -= 1
        if storage.savers == 0:
            self.live -= storage.nbytes
            storage.nbytes = 0
            if self._savers.get(storage.key) is storage:
                del self._savers[storage.key]

    def _discard(self, key: tuple) -> None:
        """The storage at ``key`` was freed while its savers live (its bytes come back when backward
        recomputes it): no longer counted, and its address free for another storage."""
        storage = self._savers.pop(key, None)
        if storage is not None:
            self.live -= storage.nbytes
            storage.nbytes = 0

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


def stop_counting(keys) -> None:
    """The storages at ``keys`` were freed though autograd still holds them (megatron-core's norm recompute
    frees a norm's output that the next linear saved, and recomputes it in backward): every recording account
    stops counting them."""
    for key in keys:
        for account in _RECORDING:
            account._discard(key)
