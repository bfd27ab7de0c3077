"""Transformer Engine's grouped linears (``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``)
without TE: the layers of megatron-core's ``TEGroupedMLP`` (``--moe-grouped-gemm``), run by ascendspeed's
``grouped_linear`` operator.

A grouped linear holds one linear layer per local expert, TE's way: parameters ``weight0`` ... ``weight{n-1}``
(``[out, in]`` of this expert-tensor-parallel rank) and ``bias0`` ...; ``forward(x, m_splits)`` runs expert
``g`` on ``m_splits[g]`` consecutive rows of ``x`` and returns ``(output, bias)`` (``bias``: the per-expert
biases when ``skip_bias_add``, else None). As in TE's layers for experts, no communication happens inside:
megatron-core's token dispatcher moves tokens across expert and expert-tensor ranks.

Everything else is what megatron-core's per-expert ``ColumnParallelLinear`` / ``RowParallelLinear`` (the
layers of ``SequentialMLP``) do, so a grouped MLP trains as ``SequentialMLP`` does: weights initialised per
expert under the expert-parallel RNG, parameter attributes (``allreduce`` for expert data-parallel reduction,
the tensor-parallel partition, ``sequence_parallel`` on a row-parallel bias), and the distributed-checkpoint
layout of TE's grouped linears, which ``TEGroupedMLP`` maps onto ``SequentialMLP``'s keys (a checkpoint of one
loads into the other).
"""
from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import get_pg_rank, get_pg_size

from ascendspeed import accelerator
from ascendspeed.accelerator.cpu_half_gemm import multiplies_in_fp32, widened_dtypes
from ascendspeed.ops.grouped_linear import grouped_linear

_WHERE = "ascendspeed's TE grouped-linear stand-in"


def _expert_groups(tp_group, pg_collection):
    """(expert-parallel, expert-tensor-parallel, expert-data-parallel) groups: the collection's (megatron-core
    >= 0.16 passes one), else the global ones (0.15 passes the expert-tensor-parallel group alone)."""
    if pg_collection is not None:
        return pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
    return (parallel_state.get_expert_model_parallel_group(),
            tp_group if tp_group is not None else parallel_state.get_expert_tensor_parallel_group(),
            parallel_state.get_expert_data_parallel_group())


@functools.lru_cache(maxsize=None)
def _takes_process_groups() -> bool:
    """``make_sharded_tensors_for_checkpoint`` takes ``tp_group`` / ``dp_cp_group`` from megatron-core 0.16."""
    return "dp_cp_group" in inspect.signature(make_sharded_tensors_for_checkpoint).parameters


def _drop_per_expert_extra_states(module, state_dict, prefix, *_) -> None:
    """A distributed checkpoint gives one ``_extra_state{g}`` per expert (TE's layout, ``sharded_state_dict``);
    the module keeps one, as TE's does, and there is nothing in it to merge (no fp8 metadata)."""
    for g in range(1, module.num_gemms):
        state_dict.pop(f"{prefix}_extra_state{g}", None)


class LocalTEGroupedLinear(torch.nn.Module):
    """TE's ``TEGroupedLinear`` constructor and forward contract (``parallel_mode`` "column" or "row")."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, parallel_mode: Optional[str], config,
                 init_method, bias: bool, skip_bias_add: bool, is_expert: bool = False,
                 tp_comm_buffer_name: Optional[str] = None, tp_group=None, pg_collection=None,
                 name: Optional[str] = None):
        super().__init__()
        if not is_expert:
            raise ValueError(f"{_WHERE}: grouped linears serve MoE experts only (is_expert=True)")
        if parallel_mode not in ("column", "row"):
            raise ValueError(f"{_WHERE}: parallel_mode must be 'column' or 'row', got {parallel_mode!r}")
        self.config = config
        self.num_gemms = num_gemms
        self.parallel_mode = parallel_mode
        self.use_bias = bias
        self.skip_bias_add = skip_bias_add
        self._ep_group, self._tp_group, self._edp_group = _expert_groups(tp_group, pg_collection)
        tp_size, tp_rank = get_pg_size(self._tp_group), get_pg_rank(self._tp_group)
        self.partition_dim = 0 if parallel_mode == "column" else 1
        self.in_features = input_size // tp_size if parallel_mode == "row" else input_size
        self.out_features = output_size // tp_size if parallel_mode == "column" else output_size
        use_expert_pgs = (config.expert_model_parallel_size > 1
                          or config.expert_tensor_parallel_size != config.tensor_model_parallel_size)
        device = torch.device("cpu") if config.use_cpu_initialization else accelerator.current_device()
        for g in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(self.out_features, self.in_features, device=device,
                                                    dtype=config.params_dtype))
            if not config.perform_initialization:
                set_tensor_model_parallel_attributes(weight, True, self.partition_dim, 1)
            elif config.use_cpu_initialization:
                per_partition = self.out_features if parallel_mode == "column" else self.in_features
                _initialize_affine_weight_cpu(weight, output_size, input_size, per_partition, self.partition_dim,
                                              init_method, params_dtype=config.params_dtype, rank=tp_rank,
                                              world_size=tp_size)
            else:
                _initialize_affine_weight_gpu(weight, init_method, self.partition_dim, is_expert=True)
            weight.allreduce = not use_expert_pgs
            self.register_parameter(f"weight{g}", weight)
            if bias:
                self.register_parameter(f"bias{g}", self._bias(device, use_expert_pgs))
        self.register_load_state_dict_pre_hook(_drop_per_expert_extra_states)
        #: half-precision dtypes this CPU has no fast GEMM for (``accelerator.cpu_half_gemm``): multiplied in fp32
        self._fp32_product_dtypes = widened_dtypes()

    def _bias(self, device, use_expert_pgs: bool) -> torch.nn.Parameter:
        bias = torch.nn.Parameter(torch.zeros(self.out_features, device=device, dtype=self.config.params_dtype))
        if self.parallel_mode == "column":
            set_tensor_model_parallel_attributes(bias, True, 0, 1)
        else:
            bias.sequence_parallel = self.config.sequence_parallel
        bias.allreduce = not use_expert_pgs
        return bias

    @property
    def weights(self) -> list[torch.Tensor]:
        return [getattr(self, f"weight{g}") for g in range(self.num_gemms)]

    @property
    def biases(self) -> list[torch.Tensor]:
        return [getattr(self, f"bias{g}") for g in range(self.num_gemms)] if self.use_bias else []

    def forward(self, x: torch.Tensor, m_splits):
        if isinstance(m_splits, torch.Tensor):
            m_splits = m_splits.tolist()
        add_bias = self.use_bias and not self.skip_bias_add
        out = grouped_linear(x, self.weights, m_splits, self.biases if add_bias else None,
                             fp32_products=multiplies_in_fp32(x, self._fp32_product_dtypes))
        if self.use_bias and self.skip_bias_add:
            return out, self.biases
        return out, None

    def backward_dw(self) -> None:
        """TE's delayed weight gradients (``--delay-wgrad-compute``) are refused without TE: nothing is delayed."""

    def get_extra_state(self) -> None:
        """TE keeps fp8 metadata here; there is none (as megatron-core's local linears say)."""
        return None

    def set_extra_state(self, state) -> None:
        """A TE checkpoint's extra state (fp8 metadata) does not apply: ignored, as by the local linears."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """TE's layout: expert ``g`` of this rank saved under the global expert index, sharded along the expert
        axis (``TEGroupedMLP`` renames the keys to ``SequentialMLP``'s); weights split along the tensor-parallel
        dimension, a column-parallel bias too."""
        metadata = metadata or {}
        tp_axis = {}
        for g in range(self.num_gemms):
            tp_axis[f"{g}.weight"] = self.partition_dim
            if self.parallel_mode == "column":
                tp_axis[f"{g}.bias"] = 0
        singleton_local_shards = metadata.get("singleton_local_shards", False)
        first_expert = get_pg_rank(self._ep_group) * self.num_gemms
        num_experts = get_pg_size(self._ep_group) * self.num_gemms
        groups = {"tp_group": self._tp_group, "dp_cp_group": metadata.get("dp_cp_group")} \
            if _takes_process_groups() else {}
        sharded = {}
        for g in range(self.num_gemms):
            expert = first_expert + g
            state = {f"{g}.weight": getattr(self, f"weight{g}"), f"{g}._extra_state": None}
            if self.use_bias:
                state[f"{g}.bias"] = getattr(self, f"bias{g}")
            if singleton_local_shards:
                expert_prefix, offsets = f"{expert}.{prefix}", sharded_offsets
            else:
                expert_prefix, offsets = prefix, (*sharded_offsets, (len(sharded_offsets), expert, num_experts))
            expert_sd = make_sharded_tensors_for_checkpoint(state, "", tp_axis, offsets, **groups)
            replace_prefix_for_sharding(expert_sd, f"{g}.", expert_prefix)
            sharded[f"{prefix}weight{g}"] = expert_sd[f"{g}.weight"]
            sharded[f"{prefix}_extra_state{g or ''}"] = expert_sd[f"{g}._extra_state"]
            if self.use_bias:
                sharded[f"{prefix}bias{g}"] = expert_sd[f"{g}.bias"]
        # Experts are replicated over expert data parallelism, not over data parallelism.
        edp_rank = get_pg_rank(self._edp_group)
        for entry in sharded.values():
            entry.replica_id = (*entry.replica_id[:2], edp_rank)
        return sharded

    def extra_repr(self) -> str:
        return (f"{self.num_gemms} x [in={self.in_features}, out={self.out_features}], bias={self.use_bias}, "
                f"parallel_mode={self.parallel_mode}")


class LocalTEColumnParallelGroupedLinear(LocalTEGroupedLinear):
    """``TEColumnParallelGroupedLinear``: the experts' fc1 (TE's keyword arguments, ``parallel_mode`` fixed)."""

    def __init__(self, num_gemms, input_size, output_size, **kwargs):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="column", **kwargs)


class LocalTERowParallelGroupedLinear(LocalTEGroupedLinear):
    """``TERowParallelGroupedLinear``: the experts' fc2 (TE's keyword arguments, ``parallel_mode`` fixed)."""

    def __init__(self, num_gemms, input_size, output_size, **kwargs):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="row", **kwargs)
