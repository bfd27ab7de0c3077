"""megatron-core's local modules with Transformer Engine's constructor and forward contracts.

Built by the stand-ins of ``standins.py`` where TE is absent. Each class keeps TE's parameters (a TE argument the
local module cannot honour is an error naming it) and TE's forward: ``(output, bias or None)`` for the linears,
the context ``[s, b, heads * v_channels]`` for the attention.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from ascendspeed.accelerator.cpu_half_gemm import multiplies_in_fp32, widened_dtypes
from ascendspeed.features.local_mla.attention import set_head_sizes
from ascendspeed.features.local_norm.norm import LocalNorm
from ascendspeed.ops.core_attention import fused_core_attention, packed_core_attention

_WHERE = "Transformer Engine is not installed; ascendspeed builds megatron-core's local modules for its classes"


def _names(name: Optional[str]) -> dict:
    """``name`` reaches megatron-core's linears only where they take it (0.18 and newer)."""
    return {} if name is None else {"name": name}


def local_norm_for_te_modes(config, hidden_size: int, eps: float):
    """``LocalNorm`` where the config asks for what TE's norm has and megatron-core's ``WrappedTorchNorm`` refuses
    (sequence parallelism, zero-centred gamma) and ascendspeed's ``local_norm`` feature does not already build
    it; else None."""
    needs_te_modes = config.sequence_parallel or config.layernorm_zero_centered_gamma
    if needs_te_modes and config.normalization in ("LayerNorm", "RMSNorm") and not _local_norm_applied():
        return LocalNorm(config.normalization, hidden_size, eps, sequence_parallel=config.sequence_parallel,
                         zero_centered_gamma=config.layernorm_zero_centered_gamma, fused=False,
                         dtype=config.params_dtype)
    return None


def local_te_norm(config, hidden_size: int, eps: float = 1e-5, has_residual: bool = False) -> torch.nn.Module:
    """``TENorm``: the norm of megatron-core's local spec (``WrappedTorchNorm``; with ascendspeed's ``local_norm``
    on, sequence-parallel, zero-centred or fused). TE's norm always supports sequence parallelism and
    zero-centred gamma, which megatron-core's ``WrappedTorchNorm`` refuses: where a model built without
    ascendspeed's arguments (megatron-core's own tests, a user's script) asks for them, ``LocalNorm`` serves."""
    if has_residual and getattr(config, "fused_residual_rmsnorm", False):
        raise ValueError(f"{_WHERE}: the fused residual RMSNorm is a TE kernel; drop --fused-residual-rmsnorm")
    norm = local_norm_for_te_modes(config, hidden_size, eps)
    if norm is not None:
        return norm
    # TE's norms hold their weights in params_dtype; torch's LayerNorm/RMSNorm are made in the default dtype.
    return WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=eps).to(dtype=config.params_dtype)


def _local_norm_applied() -> bool:
    from ascendspeed.patching import MANAGER

    return "local_norm" in MANAGER.features()


class LocalTELinearBase:
    """Marks what ``TELinear(...)`` builds (``isinstance(module, TELinear)`` asks for it)."""


class LocalTEColumnParallelLinear(ColumnParallelLinear):
    """``TEColumnParallelLinear``: ``ColumnParallelLinear`` (output never gathered, as in TE)."""

    def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias, skip_bias_add,
                 is_expert, skip_weight_param_allocation=False, tp_comm_buffer_name=None, tp_group=None, stride=1,
                 name=None):
        if gather_output:
            raise ValueError("Transformer Engine linear layers do not support gather_output = True")
        super().__init__(
            input_size, output_size, config=config, init_method=init_method, bias=bias, gather_output=False,
            stride=stride, skip_bias_add=skip_bias_add, skip_weight_param_allocation=skip_weight_param_allocation,
            is_expert=is_expert, tp_comm_buffer_name=tp_comm_buffer_name, tp_group=tp_group, **_names(name),
        )


class LocalTELayerNormColumnParallelLinear(LocalTEColumnParallelLinear):
    """``TELayerNormColumnParallelLinear``: ``TENorm`` then ``ColumnParallelLinear``.

    The norm's parameters are this module's ``layer_norm_weight`` and ``layer_norm_bias`` (TE's names, so a
    state dict keeps TE's keys); the norm module itself is not a child. Under sequence parallelism the norm runs
    on this rank's part of the sequence, before the linear gathers it, as in TE.
    """

    def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias, skip_bias_add,
                 is_expert, skip_weight_param_allocation=False, tp_comm_buffer_name=None, tp_group=None, stride=1,
                 name=None):
        if is_expert:
            raise ValueError("Transformer Engine linear layers do not yet support MoE")
        super().__init__(
            input_size, output_size, config=config, init_method=init_method, gather_output=gather_output,
            bias=bias, skip_bias_add=skip_bias_add, is_expert=is_expert,
            skip_weight_param_allocation=skip_weight_param_allocation, tp_comm_buffer_name=tp_comm_buffer_name,
            tp_group=tp_group, stride=stride, name=name,
        )
        norm = local_te_norm(config, input_size, config.layernorm_epsilon)
        object.__setattr__(self, "_te_norm", norm)
        self.layer_norm_weight = norm.weight
        if getattr(norm, "bias", None) is not None:
            self.layer_norm_bias = norm.bias

    def forward(self, x, weight=None, runtime_gather_output=None):
        return super().forward(self._te_norm(x), weight=weight, runtime_gather_output=runtime_gather_output)


class LocalTELayerNormColumnParallelLinearGathered(LocalTELayerNormColumnParallelLinear):
    """megatron-core's heterogeneous-model ``TELayerNormColumnParallelLinearGathered`` (defined only where TE
    imports): a hidden-to-hidden layer-norm linear that stands in for a whole attention or MLP block, its
    tensor-parallel output brought back to the full hidden size by megatron-core's own gather (a
    reduce-scatter under sequence parallelism)."""

    def __init__(self, config, tp_comm_buffer_name, *args, **kwargs):
        super().__init__(
            config.hidden_size, config.hidden_size, config=config, init_method=config.init_method,
            gather_output=False, bias=config.add_bias_linear, skip_bias_add=False, is_expert=False,
            tp_comm_buffer_name=tp_comm_buffer_name,
        )

    def forward(self, x, **kwargs):
        from megatron.core.transformer.heterogeneous.linear_replacements import _gather_from_tensor_parallel_region

        output, bias = super().forward(x)
        return _gather_from_tensor_parallel_region(output, self.config), bias


class LocalTERowParallelLinear(RowParallelLinear):
    """``TERowParallelLinear``: ``RowParallelLinear`` (input always parallel, as in TE)."""

    def __init__(self, input_size, output_size, *, config, init_method, bias, input_is_parallel, skip_bias_add,
                 is_expert, tp_comm_buffer_name=None, tp_group=None, name=None):
        if not input_is_parallel:
            raise ValueError("Transformer Engine linear layers do not support input_is_parallel = False")
        super().__init__(
            input_size, output_size, config=config, init_method=init_method, bias=bias, input_is_parallel=True,
            skip_bias_add=skip_bias_add, is_expert=is_expert, tp_comm_buffer_name=tp_comm_buffer_name,
            tp_group=tp_group, **_names(name),
        )


class LocalTELinearColumn(LocalTELinearBase, LocalTEColumnParallelLinear):
    """``TELinear(parallel_mode="column")``."""


class LocalTELinearRow(LocalTELinearBase, LocalTERowParallelLinear):
    """``TELinear(parallel_mode="row")``."""


class LocalTELinearDuplicated(LocalTELinearBase, torch.nn.Module):
    """``TELinear(parallel_mode="duplicated")``: the whole weight on every tensor-parallel rank.

    Under sequence parallelism each rank sees part of the sequence, so the weights are marked as TE marks them
    (``sequence_parallel``): Megatron all-reduces their gradients over the tensor-parallel group.
    """

    def __init__(self, input_size, output_size, *, config, init_method, bias, skip_bias_add):
        super().__init__()
        self.config = config
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add = skip_bias_add
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization:
            with torch.no_grad():
                init_method(self.weight)
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype)) if bias else None
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel
            param.allreduce = True

    def forward(self, x):
        if self.skip_bias_add:
            return F.linear(x, self.weight), self.bias
        return F.linear(x, self.weight, self.bias), None

    def extra_repr(self) -> str:
        return f"in_features={self.input_size}, out_features={self.output_size}, bias={self.bias is not None}"


def local_te_linear(input_size, output_size, *, parallel_mode, config, init_method, bias, skip_bias_add,
                    skip_weight_param_allocation, tp_comm_buffer_name=None, is_expert=False, symmetric_ar_type=None,
                    tp_group=None, name=None, gtp_remat_group=None):
    """``TELinear``: by ``parallel_mode``, a column- or row-parallel linear, or a duplicated one (None too)."""
    if symmetric_ar_type is not None:
        raise ValueError(f"{_WHERE}: symmetric all-reduce ({symmetric_ar_type}) needs TE and NCCL; "
                         "drop --symmetric-ar-type")
    if gtp_remat_group is not None:
        raise ValueError(f"{_WHERE}: TELinear's gtp_remat_group has no local equivalent")
    if parallel_mode == "column":
        return LocalTELinearColumn(
            input_size, output_size, config=config, init_method=init_method, gather_output=False, bias=bias,
            skip_bias_add=skip_bias_add, is_expert=is_expert,
            skip_weight_param_allocation=skip_weight_param_allocation, tp_comm_buffer_name=tp_comm_buffer_name,
            tp_group=tp_group, name=name,
        )
    if skip_weight_param_allocation:
        raise ValueError(f"{_WHERE}: TELinear(parallel_mode={parallel_mode!r}) cannot skip its weight")
    if parallel_mode == "row":
        return LocalTELinearRow(
            input_size, output_size, config=config, init_method=init_method, bias=bias, input_is_parallel=True,
            skip_bias_add=skip_bias_add, is_expert=is_expert, tp_comm_buffer_name=tp_comm_buffer_name,
            tp_group=tp_group, name=name,
        )
    if parallel_mode not in ("duplicated", None):
        raise ValueError(f"TELinear: parallel_mode must be 'column', 'row', 'duplicated' or None, "
                         f"got {parallel_mode!r}")
    if is_expert:
        raise ValueError(f"{_WHERE}: a duplicated expert TELinear has no local equivalent")
    return LocalTELinearDuplicated(input_size, output_size, config=config, init_method=init_method, bias=bias,
                                   skip_bias_add=skip_bias_add)


def _context_parallel_feature_applied() -> bool:
    from ascendspeed.features import applied_features

    return any(feature.name == "context_parallel" for feature in applied_features())


#: TE's context-parallel communication types the stand-in serves, and ascendspeed's algorithm for each
#: (``a2a+p2p``: Ulysses inside groups of ``hierarchical_context_parallel_sizes[0]`` ranks, ring across them).
CP_COMM_TYPES = {"p2p": "megatron_cp_algo", "a2a": "ulysses_cp_algo", "a2a+p2p": "hybrid_cp_algo"}


def _te_context_parallel_settings(config, attn_mask_type, cp_comm_type):
    """TE's own context parallelism, for a model built from a config alone (the ``context_parallel`` feature,
    switched on by flags, serves it otherwise): ascendspeed's ring (TE's ``p2p``, its default), Ulysses
    (``a2a``) or hybrid (``a2a+p2p``) attention over the context-parallel group; a layer whose mask type is not
    causal applies its ``attention_mask`` (``general``), or in a THD pack attends within each sequence."""
    from ascendspeed.features.context_parallel.settings import ContextParallelSettings

    cp_comm_type = "p2p" if cp_comm_type is None else cp_comm_type  # TEDotProductAttention's default
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"{_WHERE}: context parallelism with cp_comm_type {cp_comm_type!r} has no local equivalent; "
                         f"use one of {', '.join(CP_COMM_TYPES)}")
    ulysses_degree = 1
    if cp_comm_type == "a2a+p2p":
        sizes = config.hierarchical_context_parallel_sizes
        if not sizes or len(sizes) != 2 or sizes[0] * sizes[1] != config.context_parallel_size:
            raise ValueError(f"{_WHERE}: cp_comm_type 'a2a+p2p' needs hierarchical_context_parallel_sizes [a2a, p2p] "
                             f"whose product is context_parallel_size {config.context_parallel_size}, got {sizes}")
        ulysses_degree = sizes[0]
    return ContextParallelSettings(algorithm=CP_COMM_TYPES[cp_comm_type], ulysses_degree=ulysses_degree,
                                   mask_type="causal" if "causal" in attn_mask_type.name else "general")


class LocalTEDotProductAttention(DotProductAttention):
    """``TEDotProductAttention``: megatron-core's ``DotProductAttention``, with TE's separate key and value head
    sizes (``k_channels``, ``v_channels``: multi-latent attention), TE's forward signature and TE's context
    parallelism (``_te_context_parallel_settings``)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, num_splits=None, cp_comm_type="p2p",
                 pg_collection=None):
        if num_splits is not None:
            raise ValueError(f"{_WHERE}: num_splits (flash-decoding) has no local equivalent")
        from ascendspeed.features.context_parallel import megatron_attention

        serves_context_parallel = config.context_parallel_size > 1 and not _context_parallel_feature_applied()
        settings = (_te_context_parallel_settings(config, attn_mask_type, cp_comm_type) if serves_context_parallel
                    else None)
        built = megatron_attention.unsharded(config) if serves_context_parallel else config
        super().__init__(
            built, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
            softmax_scale=softmax_scale, cp_comm_type=None if built.context_parallel_size == 1 else cp_comm_type,
            pg_collection=pg_collection,
        )
        if serves_context_parallel:
            self.te_context_parallel = megatron_attention.attach_context_parallel(
                self, config, settings, megatron_attention.ContextParallelState(), pg_collection,
                causal_layer="causal" in attn_mask_type.name)
        set_head_sizes(self, k_channels, v_channels, softmax_scale)
        self._fp32_product_dtypes = widened_dtypes()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, num_splits=None):
        if num_splits is not None:
            raise ValueError(f"{_WHERE}: num_splits (flash-decoding) has no local equivalent")
        context_parallel = self.__dict__.get("te_context_parallel")
        if context_parallel is not None:
            if attention_bias is not None:
                raise ValueError(f"{_WHERE}: its context-parallel attention does not take an attention_bias")
            return context_parallel(self, query, key, value, attention_mask, packed_seq_params)
        if packed_seq_params is not None and query.dim() == 3 and attention_bias is None:
            # TE's THD packs, which megatron-core's local attention refuses: on the fused kernel, with the
            # pack's block-diagonal mask (ascendspeed.ops.core_attention), products in fp32 where this CPU has no
            # fast GEMM for the dtype.
            context = packed_core_attention(self, query, key, value, packed_seq_params,
                                            fp32_gemms=multiplies_in_fp32(query, self._fp32_product_dtypes))
            if context is not None:
                return context
        plan = self._fused_plan(query, key, attention_mask, attention_bias) if packed_seq_params is None else None
        if plan is not None:
            return fused_core_attention(self, query, key, value, plan,
                                        fp32_gemms=multiplies_in_fp32(query, self._fp32_product_dtypes))
        _make_the_global_memory_buffer_where_missing()
        return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                               attention_bias=attention_bias, packed_seq_params=packed_seq_params)

    def _fused_plan(self, query, key, attention_mask, attention_bias):
        """TE's attention is a fused kernel: it never holds the [b, heads, sq, sk] scores that megatron-core's
        local attention materialises (with the softmax's output, for backward). The stand-in runs ascendspeed's
        fused kernel wherever that computes megatron-core's function (the ``fused_attention`` feature's rules: no
        bias, ALiBi or training-time dropout, a mask it reproduces exactly), so a TE-spec model keeps TE's memory
        (torch's CPU SDPA with dropout materialises the scores too, so dropout gains nothing); the plan, or None."""
        from ascendspeed.features.fused_attention import attention as fused_attention

        settings = fused_attention.FusedAttentionSettings(cpu_fp32_gemm_dtypes=self._fp32_product_dtypes)
        return fused_attention.fused_plan(self, query, key, attention_mask, attention_bias, settings)


def _make_the_global_memory_buffer_where_missing() -> None:
    """megatron-core's local attention takes its scores from ``parallel_state``'s global memory buffer, which
    ``initialize_model_parallel`` makes; TE's attention needs no model-parallel state, so a model built on
    explicit process groups alone (``HyperCommGrid``: Megatron's multi-module pipeline tests) stopped at "global
    memory buffer is not initialized". The buffer is made where it is missing."""
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
