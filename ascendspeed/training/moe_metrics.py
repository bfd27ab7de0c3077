"""The MoE routers' auxiliary losses of a logging interval, as Megatron-LM's log shows them.

megatron-core's routers record each MoE layer's auxiliary losses (``load_balancing_loss``, ``z_loss``, ...;
without their coefficients) into a tracker during the forward passes of a step, one value per layer summed over
the micro-batches: ``MoEMetricsTracker`` from 0.18, a module-level dict before. Megatron-LM then reduces them
over the pipeline stages, the groups the router names and the data-parallel ranks, divides by the micro-batches
and averages over the MoE layers. This does the same for the pretraining entry and clears the tracker.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state


def _tracked() -> dict:
    """name -> (per-layer values, reduce group, average group, whether to average over data parallelism)."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:  # before 0.18
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        return {name: (entry["values"], entry.get("reduce_group"), entry.get("avg_group"),
                       entry.get("needs_dp_avg", True))
                for name, entry in get_moe_layer_wise_logging_tracker().items()}
    return {name: (entry.values, entry.reduce_group, entry.avg_group, entry.needs_dp_avg)
            for name, entry in get_moe_metrics_tracker().metrics.items()}


def aux_losses(num_microbatches: int, num_moe_layers: int) -> dict[str, float]:
    """The auxiliary losses the tracker summed since it was last zeroed, over ``num_microbatches`` micro-batches
    (those of every step since then), as their mean per micro-batch and MoE layer; the tracker then zeroed.
    Called once per logging interval (the reductions are linear: reducing the interval's sums once equals
    averaging each step's), on every rank: the reductions are collectives."""
    losses = {}
    data_parallel = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for name, (values, reduce_group, avg_group, average_over_data_parallel) in sorted(_tracked().items()):
        torch.distributed.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())
        if reduce_group is not None:
            torch.distributed.all_reduce(values, group=reduce_group)
        if avg_group is not None:
            torch.distributed.all_reduce(values, group=avg_group, op=torch.distributed.ReduceOp.AVG)
        if average_over_data_parallel:
            torch.distributed.all_reduce(values, group=data_parallel, op=torch.distributed.ReduceOp.AVG)
        losses[name] = values.sum().item() / num_microbatches / num_moe_layers
        values.zero_()
    return losses
