"""gloo: megatron-core's bucket reduce-scatter as an in-place all-reduce, which overlaps."""
from __future__ import annotations

import functools

import torch

from ascendspeed.patching import Patch, wrap


def wrap_reduce_scatter(original):
    """On gloo, reduce-scatter a bucket by all-reducing it in place.

    gloo implements reduce-scatter as a clone, an all-reduce and a copy, mostly on the calling thread
    and with a ``Work`` that has no future; the in-place all-reduce moves the same bytes, dispatches at
    once, has a future, and leaves the local shard (a view of the bucket) exactly as reduce-scatter would.
    """

    @functools.wraps(original)
    def reduce_scatter(output, input, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        distributed = torch.distributed
        if distributed.get_backend(group) == "gloo" and _is_shard_view(output, input, group):
            return distributed.all_reduce(input, op=op, group=group, async_op=async_op)
        return original(output, input, op=op, group=group, async_op=async_op)

    return reduce_scatter


def _is_shard_view(output, input, group) -> bool:
    """True when ``output`` is this rank's contiguous shard of ``input`` (as in megatron-core's buckets)."""
    if output.untyped_storage().data_ptr() != input.untyped_storage().data_ptr():
        return False
    size = torch.distributed.get_world_size(group)
    rank = torch.distributed.get_rank(group)
    shard = input.numel() // size
    return (
        output.is_contiguous() and input.is_contiguous() and output.numel() == shard
        and output.storage_offset() == input.storage_offset() + rank * shard
    )


def patches() -> list[Patch]:
    return [
        wrap("megatron.core.distributed.param_and_grad_buffer:dist_reduce_scatter_func", wrap_reduce_scatter,
             expect="(output, input, op=<RedOpType.SUM: 0>, group=None, async_op=False)", sweep=False,
             name="async ddp on gloo: reduce-scatter of a bucket as an in-place all-reduce"),
    ]
