"""The tensor-parallel collectives of the chunked linears, issued asynchronously and waited for later.

``all_gather``, ``reduce_scatter`` and ``all_reduce`` return a ``Pending``: the collective is in flight and
``wait()`` finishes it. On gloo a reduce-scatter is an in-place all-reduce of the chunk followed, at the
wait, by a copy of this rank's rows: gloo runs its own reduce-scatter mostly on the calling thread (a clone,
an all-reduce, a copy) with a work that has no future, so it would not overlap; the all-reduce moves the
same bytes on gloo's thread. Elsewhere (HCCL, NCCL) the backend's reduce-scatter runs.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ascendspeed.features.tp_comm_overlap.telemetry import TpCommRecorder


@dataclasses.dataclass(frozen=True)
class TpGroup:
    """A tensor-parallel process group as the chunked linears use it."""

    group: dist.ProcessGroup
    size: int
    rank: int
    gloo: bool
    recorder: Optional[TpCommRecorder] = None

    @classmethod
    def of(cls, group: dist.ProcessGroup, recorder: Optional[TpCommRecorder] = None) -> "TpGroup":
        return cls(group, dist.get_world_size(group), dist.get_rank(group), dist.get_backend(group) == "gloo",
                   recorder)


class Pending:
    """One collective in flight: ``wait()`` blocks until it is done, then runs its completion step."""

    def __init__(self, work, group: TpGroup, nbytes: int, then: Optional[Callable[[], None]] = None):
        self.work = work
        self.then = then
        self.recorder = group.recorder
        self.slot = self.recorder.issued(work, nbytes) if self.recorder is not None else None

    def wait(self) -> None:
        started = time.perf_counter()
        self.work.wait()
        if self.recorder is not None:
            self.recorder.waited(self.slot, started)
        if self.then is not None:
            self.then()


def all_gather(output: torch.Tensor, input: torch.Tensor, group: TpGroup) -> Pending:
    """Gather ``input`` of every rank into ``output`` (``[size, *input.shape]``, rank-major)."""
    work = dist.all_gather_into_tensor(output.view(-1, *input.shape[1:]), input, group=group.group,
                                       async_op=True)
    return Pending(work, group, output.numel() * output.element_size())


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: TpGroup) -> Pending:
    """Sum ``input`` (``[size, *output.shape]``) over ranks; this rank's row of the sum lands in ``output``.
    ``input`` is overwritten on gloo."""
    nbytes = input.numel() * input.element_size()
    if group.gloo:
        work = dist.all_reduce(input, group=group.group, async_op=True)
        return Pending(work, group, nbytes, then=lambda: output.copy_(input[group.rank]))
    work = dist.reduce_scatter_tensor(output, input.view(-1, *output.shape[1:]), group=group.group,
                                      async_op=True)
    return Pending(work, group, nbytes)


def all_reduce(tensor: torch.Tensor, group: TpGroup) -> Pending:
    """Sum ``tensor`` over ranks in place."""
    work = dist.all_reduce(tensor, group=group.group, async_op=True)
    return Pending(work, group, tensor.numel() * tensor.element_size())
