"""What a rank's training state occupies, measured from the tensors' storages, not from a formula.

``account(model_chunks, optimizer)`` finds the storages behind the model weights, the optimizer's main
weights, the gradients and the optimizer state, and counts every byte of every distinct storage once.
Tensors that share memory (fp32 parameters that are their own main weights, gradient views into a
DDP buffer, main weights laid out in the parameter memory by ``--reuse-fp32-param``) are therefore
not counted twice: a byte belongs to the first of those four categories whose tensors cover it, and
bytes of a storage that no tensor covers (bucket padding) to the first category that uses the storage.
"""
from __future__ import annotations

import dataclasses
import resource
import sys
from typing import Iterable, Optional

import torch

CATEGORIES = ("model weights", "main weights", "gradients", "optimizer state")


@dataclasses.dataclass(frozen=True)
class MemoryAccount:
    """Bytes per category on this rank, and the number of parameters (elements) the rank holds."""

    parameters: int
    model_weights: int
    main_weights: int
    gradients: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.model_weights + self.main_weights + self.gradients + self.optimizer_state

    def per_parameter(self, value: int) -> float:
        return value / self.parameters if self.parameters else 0.0

    @property
    def bytes_per_parameter(self) -> float:
        return self.per_parameter(self.total)

    def line(self, activation_bytes: Optional[int] = None) -> str:
        """The account as one line; ``activation_bytes``: the activations of a step at their peak (what
        autograd kept for backward), appended."""
        parts = ", ".join(
            f"{name} {_megabytes(value)} ({self.per_parameter(value):.2f} B/param)"
            for name, value in zip(CATEGORIES, (self.model_weights, self.main_weights, self.gradients,
                                                self.optimizer_state))
        )
        line = (f"memory per rank: {parts}; total {_megabytes(self.total)} for {self.parameters:,} parameters "
                f"({self.bytes_per_parameter:.2f} bytes per parameter)")
        if activation_bytes is not None:
            line += f"; activations {_megabytes(activation_bytes)} at the step's peak (saved for backward)"
        return line


def _megabytes(value: int) -> str:
    return f"{value / 2**20:.2f} MiB"


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage ``tensor`` can address: ``[first, last + 1)``."""
    if tensor.numel() == 0:
        return 0, 0
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.storage_offset() * tensor.element_size()
    return start, start + extent * tensor.element_size()


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _overlap(ranges: list[tuple[int, int]], claimed: list[tuple[int, int]]) -> int:
    total = 0
    for start, end in ranges:
        for claimed_start, claimed_end in claimed:
            total += max(0, min(end, claimed_end) - max(start, claimed_start))
    return total


def storage_bytes(categories: Iterable[Iterable[torch.Tensor]]) -> list[int]:
    """Bytes per category of the distinct storages behind the tensors of each category (see module doc)."""
    categories = [list(tensors) for tensors in categories]
    storages: dict[tuple, dict] = {}
    for index, tensors in enumerate(categories):
        for tensor in tensors:
            if tensor is None or not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = (tensor.device, storage.data_ptr(), storage.nbytes())
            entry = storages.setdefault(key, {"nbytes": storage.nbytes(), "first": index, "ranges": {}})
            entry["ranges"].setdefault(index, []).append(_byte_range(tensor))
    totals = [0] * len(categories)
    for entry in storages.values():
        claimed: list[tuple[int, int]] = []
        for index in sorted(entry["ranges"]):
            ranges = _merge(entry["ranges"][index])
            covered = sum(end - start for start, end in ranges)
            totals[index] += covered - _overlap(ranges, claimed)
            claimed = _merge(claimed + ranges)
        totals[entry["first"]] += entry["nbytes"] - sum(end - start for start, end in claimed)
    return totals


def _optimizer_parts(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen, result = set(), []
    for tensor in tensors:
        if tensor is not None and id(tensor) not in seen:
            seen.add(id(tensor))
            result.append(tensor)
    return result


def account(model_chunks, optimizer) -> MemoryAccount:
    """The memory account of this rank's model chunks (megatron DDP modules) and megatron optimizer.

    Main weights are what the inner optimizers update, plus any tensors an optimizer lists in
    ``main_weight_tensors()`` (state of a main weight kept elsewhere, e.g. ``--reuse-fp32-param``'s
    remainders); gradients are the DDP gradient buffers and any ``.grad``/``main_grad`` tensors.
    """
    params = _unique(p for chunk in model_chunks for p in chunk.parameters())
    main, gradients, state = [], [], []
    for chunk in model_chunks:
        for buffer in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", [])):
            gradients.append(buffer.grad_data)
    for param in params:
        gradients += [getattr(param, "main_grad", None), param.grad]
    for part in _optimizer_parts(optimizer):
        inner = getattr(part, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            for main_param in group["params"]:
                main.append(main_param)
                gradients.append(main_param.grad)
        extra = getattr(part, "main_weight_tensors", None)
        if callable(extra):
            main += list(extra())
        for values in inner.state.values():
            state += [value for value in values.values() if isinstance(value, torch.Tensor)]
    sizes = storage_bytes([params, _unique(main), _unique(gradients), _unique(state)])
    return MemoryAccount(sum(p.numel() for p in params), *sizes)


def peak_resident_bytes() -> int:
    """The peak resident set size of this process so far (``getrusage``; kilobytes on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def peak_line() -> str:
    return f"peak resident memory of this process: {peak_resident_bytes() / 2**20:.1f} MiB"
