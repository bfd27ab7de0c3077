"""Per-module views of the saved-tensor account (``training.activations``): what each layer, core attention
and MLP keeps for backward, and how long its forward takes."""
from __future__ import annotations

import time

import torch

from ascendspeed.training.activations import SavedTensorAccount


def _in_backward() -> bool:
    """Whether autograd's engine is running on this thread (a recomputation inside backward)."""
    return torch._C._current_graph_task_id() != -1


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
