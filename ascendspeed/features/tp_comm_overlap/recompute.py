"""Full recompute without redundant tensor-parallel collectives (``--optimize-recomp-communication-level``).

Megatron's full recompute (``tensor_parallel.checkpoint``) runs a chunk of layers forward without keeping
activations, then in backward runs it forward again and back-propagates from the chunk's outputs. Two
collectives of that second forward are redundant:

* level 1: the chunk's last row-parallel reduction (the MLP's ``linear_fc2`` of its last layer). Its result
  only flows into the residual add that forms the chunk's output, and backward from an output reads no
  output values (an add's and dropout's gradients do not depend on them), so the recomputed forward keeps
  the layer's partial product instead of reducing it; backward still runs the reduction's own backward (the
  sequence-parallel all-gather of the gradient).
* level 2, with sequence parallelism, also: every column-parallel linear of the recomputed forward keeps the
  input it has just all-gathered for its backward, which therefore does not gather it again.

Which reduction is the last is learnt from the checkpoint's first forward: each checkpoint call carries a
``CheckpointRecord`` numbering its row-parallel reductions, and the recomputation replays the same calls.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Callable, Optional

import torch

from ascendspeed.features.tp_comm_overlap.collectives import TpGroup, all_gather
from ascendspeed.patching import Patch, wrap


@dataclasses.dataclass
class CheckpointRecord:
    """The row-parallel reductions of one checkpointed chunk: counted in its first forward, replayed after."""

    reductions: int = 0
    replayed: int = 0


class RecomputeTracker:
    """Which checkpointed chunk (if any) this thread is running, and whether it is the recomputation."""

    def __init__(self):
        self._local = threading.local()

    def _stack(self) -> list:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    @contextlib.contextmanager
    def running(self, record: CheckpointRecord, recomputing: bool):
        if recomputing:
            record.replayed = 0
        stack = self._stack()
        stack.append((record, recomputing))
        try:
            yield
        finally:
            stack.pop()

    @property
    def recomputing(self) -> bool:
        stack = self._stack()
        return bool(stack) and stack[-1][1]

    def reduction_is_redundant(self) -> bool:
        """Count a row-parallel reduction of the running chunk; True for the recomputation's last one."""
        stack = self._stack()
        if not stack:
            return False
        record, recomputing = stack[-1]
        if not recomputing:
            record.reductions += 1
            return False
        record.replayed += 1
        return record.replayed == record.reductions


class KeepLocalRows(torch.autograd.Function):
    """Forward: this rank's rows of an unreduced partial product (the reduce-scatter skipped); backward: the
    reduce-scatter's backward, an all-gather of the gradient."""

    @staticmethod
    def forward(ctx, partial, group: TpGroup):
        ctx.group = group
        rows = partial.size(0) // group.size
        return partial[group.rank * rows:(group.rank + 1) * rows].clone()

    @staticmethod
    def backward(ctx, grad_output):
        group = ctx.group
        gathered = grad_output.new_empty((group.size,) + grad_output.shape)
        all_gather(gathered, grad_output.contiguous(), group).wait()
        return gathered.view((-1,) + grad_output.shape[1:]), None


def wrap_checkpoint(tracker: RecomputeTracker) -> Callable:
    """``tensor_parallel.checkpoint``: the checkpointed function runs under a record of its reductions."""

    def factory(original):
        @functools.wraps(original)
        def checkpoint(function, distribute_saved_activations, *args):
            record = CheckpointRecord()

            @functools.wraps(function)
            def tracked(*inputs):
                with tracker.running(record, recomputing=torch.is_grad_enabled()):
                    return function(*inputs)

            return original(tracked, distribute_saved_activations, *args)

        return checkpoint

    return factory


def partial_product_without_reduction(layer, input_, group: Optional[TpGroup]):
    """The row-parallel ``layer``'s output with its reduction skipped (the recomputation's last one)."""
    partial = layer._forward_impl(
        input=input_, weight=layer.weight, bias=None, gradient_accumulation_fusion=layer.gradient_accumulation_fusion,
        allreduce_dgrad=False, sequence_parallel=False, tp_group=None, grad_output_buffer=None)
    return KeepLocalRows.apply(partial, group) if layer.sequence_parallel else partial


def patches(tracker: RecomputeTracker) -> list[Patch]:
    return [
        wrap("megatron.core.tensor_parallel.random:checkpoint", wrap_checkpoint(tracker),
             expect="(function, distribute_saved_activations, *args)",
             name="recompute communication: wrap tensor_parallel.checkpoint, record the chunk's reductions"),
    ]
