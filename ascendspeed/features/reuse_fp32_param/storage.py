"""Where the fp32 main weights live when they share memory with the bf16 model weights.

A *unit* is a run of ``n`` weights whose fp32 main values can be laid out, during the optimizer step,
as ``n`` fp32 numbers in memory the model does not need at that moment:

* between steps (the *model layout*) the unit holds the bf16 weights ``high`` where the model reads
  them and the 16-bit remainders ``low`` beside them (``ascendspeed.ops.bf16_split`` defines the split);
* for the optimizer step (the *main layout*) ``bf16_join_`` turns both into the fp32 ``main`` region in
  place, the optimizer updates that region, and ``bf16_split_`` turns it back into the new bf16 weights
  (rounded to nearest even, as Megatron's copy) and remainders.

``ParameterUnit`` (Megatron's mixed-precision optimizer): one int32 buffer per parameter; its first
half, viewed as bf16, *is* the parameter's data, its second half the remainders, and the whole
buffer viewed as fp32 is the main weight. ``BucketShardUnit`` (the distributed optimizer): the main
weights of this rank's shard of a gradient bucket are laid out in the bucket's bf16 parameter buffer,
whose other ranks' parts are refilled by the all-gather that follows every step; only the
remainders (2 bytes per shard element) live elsewhere.

A layout switch is one call of an operator, one pass over the unit's memory. Its transient memory is
what the in-place overlap needs: for a ``ParameterUnit``, the remainders of the first half of the
elements (1 byte per element of the buffer), which no order of the pass can read before the fp32
values cover them; for a ``BucketShardUnit``, nothing.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from ascendspeed.ops import bf16_split as layout_ops


def ties_in_range(ties: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The positions of ``ties`` within ``[start, end)``, relative to ``start``."""
    if not ties.numel():
        return ties
    return ties[(ties >= start) & (ties < end)] - start


def replace_ties_in_range(ties: torch.Tensor, start: int, end: int, new: torch.Tensor) -> torch.Tensor:
    """``ties`` with those in ``[start, end)`` replaced by ``new`` (relative to ``start``), sorted."""
    kept = ties[(ties < start) | (ties >= end)] if ties.numel() else ties
    return torch.sort(torch.cat((kept, new + start))).values


class Unit:
    """Common bookkeeping: the views subclasses define, the layout switches, piecewise access."""

    numel: int
    ties: torch.Tensor

    def high(self) -> torch.Tensor:
        """int16 view of the bf16 weights (valid in the model layout)."""
        raise NotImplementedError

    def low(self) -> torch.Tensor:
        """int16 remainders (valid in the model layout)."""
        raise NotImplementedError

    def main_pairs(self) -> torch.Tensor:
        """The main region as int16 pairs ``[numel, 2]`` (fp32 in the main layout)."""
        raise NotImplementedError

    def layout(self) -> tuple[torch.Tensor, int, Optional[torch.Tensor]]:
        """``(halves, high_offset, low)``: the arguments of ``bf16_split_`` / ``bf16_join_``."""
        raise NotImplementedError

    def main(self) -> torch.Tensor:
        return self.main_pairs().view(torch.float32).view(-1)

    def to_main_layout(self, preserve_model: bool = False) -> None:
        """Lay out the fp32 main weights. ``preserve_model``: keep model weights the region displaces
        that the split will not rewrite (only units that displace any do something with it)."""
        halves, high_offset, low = self.layout()
        layout_ops.bf16_join_(halves, self.ties, high_offset, low)

    def to_model_layout(self) -> None:
        self.ties = layout_ops.bf16_split_(*self.layout())

    def read(self, start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """The exact fp32 main weights ``[start, end)`` as a new tensor (model layout)."""
        end = self.numel if end is None else end
        count = end - start
        halves = torch.empty(2 * count, dtype=torch.int16, device=self.ties.device)
        halves[:count].copy_(self.high()[start:end])
        layout_ops.bf16_join_(halves, ties_in_range(self.ties, start, end), 0, self.low()[start:end])
        return halves.view(torch.float32)

    def write(self, values: torch.Tensor, start: int = 0) -> None:
        """Set the main weights ``[start, start + len(values))`` to ``values`` (model layout); the bf16
        weights become their rounding, as after an optimizer step."""
        values = values.detach().to(torch.float32).reshape(-1)
        end = start + values.numel()
        halves = values.view(torch.int16).clone()  # contiguous, and the caller's tensor stays as it is
        ties = layout_ops.bf16_split_(halves, 0, self.low()[start:end])
        self.high()[start:end].copy_(halves[: values.numel()])
        self.ties = replace_ties_in_range(self.ties, start, end, ties)

    def reset_from_model(self) -> None:
        """Main weights := the bf16 weights exactly (Megatron's ``reload_model_params``)."""
        self.low().zero_()
        self.ties = self.ties.new_empty(0)

    def storage_tensors(self) -> list[torch.Tensor]:
        """Tensors holding main-weight state that are not model weights (for the memory account)."""
        return [self.ties]


class ParameterUnit(Unit):
    """bf16 parameters re-homed into one int32 buffer: ``[bf16 weights | remainders]`` between steps,
    their fp32 main weights one after the other during the step. Grouping small parameters saves
    per-tensor work; the size of a group bounds the transient memory of a layout switch (1 byte per
    element: the remainders of the buffer's first half, staged by the operators)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        for param in params:
            if param.dtype != torch.bfloat16:
                raise TypeError(f"--reuse-fp32-param shares memory only with bf16 weights, got {param.dtype}")
        self.offsets = [0]
        for param in params:
            self.offsets.append(self.offsets[-1] + param.numel())
        self.numel = self.offsets[-1]
        self.buffer = torch.zeros(self.numel, dtype=torch.int32, device=params[0].device)
        halves = self.buffer.view(torch.int16)
        self.shapes = [param.shape for param in params]
        with torch.no_grad():
            for param, start, end in zip(params, self.offsets, self.offsets[1:]):
                halves[start:end].copy_(param.detach().reshape(-1).view(torch.int16))
                param.data = halves[start:end].view(torch.bfloat16).view(param.shape)
        self.ties = torch.empty(0, dtype=torch.int64, device=params[0].device)

    def high(self):
        return self.buffer.view(torch.int16)[: self.numel]

    def low(self):
        return self.buffer.view(torch.int16)[self.numel:]

    def main_pairs(self):
        return self.buffer.view(torch.int16).view(self.numel, 2)

    def layout(self):
        return self.buffer.view(torch.int16), 0, None

    def main_params(self) -> list[torch.Tensor]:
        """The fp32 main weights the optimizer updates: views of the buffer as fp32, one per parameter."""
        main = self.buffer.view(torch.float32)
        return [main[start:end].view(shape) for start, end, shape in zip(self.offsets, self.offsets[1:], self.shapes)]

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.offsets, self.offsets[1:]))


def group_parameters(params: list[torch.nn.Parameter], max_elements: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive groups of ``params`` of at most ``max_elements`` elements (a larger one is alone)."""
    groups, current, size = [], [], 0
    for param in params:
        if current and size + param.numel() > max_elements:
            groups.append(current)
            current, size = [], 0
        current.append(param)
        size += param.numel()
    if current:
        groups.append(current)
    return groups


class BucketShardUnit(Unit):
    """This rank's shard ``[rank * m, (rank + 1) * m)`` of a distributed-optimizer bucket's bf16
    parameter buffer, with its main weights laid out in the buffer's first ``2 m`` slots."""

    def __init__(self, param_data: torch.Tensor, rank: int, size: int, remainders: torch.Tensor):
        numel = param_data.numel()
        if size < 2:
            raise ValueError(
                "--reuse-fp32-param with --use-distributed-optimizer needs a data-parallel size of at least 2: "
                "the shard's fp32 main weights are laid out in the other ranks' part of the parameter buffer "
                "during the step. With one data-parallel rank drop --use-distributed-optimizer (it shards "
                "nothing) and keep --reuse-fp32-param."
            )
        if numel % size or (numel // size) * 2 > numel or param_data.storage_offset() % 2:
            raise ValueError(f"bucket of {numel} elements cannot hold its shard's fp32 main weights")
        self.param_data = param_data
        self.numel = numel // size
        self.start = rank * self.numel
        self.remainders = remainders
        self.ties = torch.empty(0, dtype=torch.int64, device=param_data.device)
        self.displaced: Optional[torch.Tensor] = None

    def high(self):
        return self.param_data.view(torch.int16)[self.start: self.start + self.numel]

    def low(self):
        return self.remainders

    def main_pairs(self):
        return self.param_data.view(torch.int16)[: 2 * self.numel].view(self.numel, 2)

    def layout(self):
        return self.param_data.view(torch.int16), self.start, self.remainders

    def to_main_layout(self, preserve_model: bool = False) -> None:
        """With ``preserve_model`` the other ranks' bf16 weights the main region displaces are kept and
        put back by ``to_model_layout`` (checkpoint loading: no all-gather follows it)."""
        self.displaced = self.main_pairs().clone() if preserve_model else None
        super().to_main_layout()

    def to_model_layout(self) -> None:
        super().to_model_layout()
        if self.displaced is not None:
            halves, displaced = self.param_data.view(torch.int16), self.displaced.view(-1)
            halves[: self.start].copy_(displaced[: self.start])
            end = self.start + self.numel
            if end < displaced.numel():
                halves[end: displaced.numel()].copy_(displaced[end:])
            self.displaced = None

    def storage_tensors(self):
        return [self.remainders, self.ties]


class ReuseState:
    """The units of one optimizer and which layout they are in."""

    def __init__(self, units: Iterable[Unit]):
        self.units = list(units)
        self.in_main_layout = False
        self.depth = 0

    def to_main_layout(self, preserve_model: bool = False) -> None:
        if self.in_main_layout:
            return
        for unit in self.units:
            unit.to_main_layout(preserve_model)
        self.in_main_layout = True

    def to_model_layout(self) -> None:
        if not self.in_main_layout:
            return
        for unit in self.units:
            unit.to_model_layout()
        self.in_main_layout = False

    def reset_from_model(self) -> None:
        self._require_model_layout("reload the main weights from the model weights")
        for unit in self.units:
            unit.reset_from_model()

    def _require_model_layout(self, action: str) -> None:
        if self.in_main_layout:
            raise RuntimeError(f"--reuse-fp32-param: cannot {action} while the optimizer step is running")

    def storage_tensors(self) -> list[torch.Tensor]:
        return [tensor for unit in self.units for tensor in unit.storage_tensors()]


class main_layout:
    """``with main_layout(state):`` the fp32 main weights are laid out (and the bf16 ones are not);
    ``preserve_model=True`` when no all-gather follows (checkpoint loading) keeps every model weight.

    Re-entrant: only the outermost block switches layouts, so a loader that calls another wrapped
    loader keeps the main layout until it is done."""

    def __init__(self, state: Optional[ReuseState], preserve_model: bool = False):
        self.state = state
        self.preserve_model = preserve_model

    def __enter__(self):
        if self.state is not None:
            if self.state.depth == 0:
                self.state.to_main_layout(self.preserve_model)
            self.state.depth += 1
        return self.state

    def __exit__(self, *exc_info):
        if self.state is not None:
            self.state.depth -= 1
            if self.state.depth == 0:
                self.state.to_model_layout()
        return False
