"""What the overlap telemetries of several features share: interval arithmetic, sums over ranks, rank-0 lines."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def covered_seconds(intervals) -> float:
    """Seconds covered by the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def sum_over_ranks(values: Sequence[float]) -> list[float]:
    """``values`` summed over every rank of the job (a collective: every rank calls it); as is without one."""
    from ascendspeed.accelerator import current_device

    packed = torch.tensor(list(values), dtype=torch.float64, device=current_device())
    if dist.is_initialized():
        dist.all_reduce(packed)
    return packed.tolist()


def print_on_rank_0(line: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)
