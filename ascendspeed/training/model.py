"""The GPT, its data-parallel wrapping, optimizer and learning-rate schedule, from megatron-core parts.

Each builder takes the parsed arguments (see ``arguments.py``) so tests and benchmarks can build exactly
what the entry trains. Model parallelism must be initialised first (``initialize.initialize_parallel``).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core import optimizer as megatron_optimizer
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.module import Float16Module

from ascendspeed.features import configure_transformer_config
from ascendspeed.training.data import ByteTokenizer, padded_vocab_size


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def build_config(args: argparse.Namespace) -> TransformerConfig:
    """The ``TransformerConfig`` Megatron-LM would build from these flags, then each feature's changes."""
    dtype = params_dtype(args)
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        add_bias_linear=args.add_bias_linear,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        bias_activation_fusion=args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion,
        bias_dropout_fusion=args.bias_dropout_fusion,
        masked_softmax_fusion=args.masked_softmax_fusion,
        apply_rope_fusion=args.apply_rope_fusion,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        persist_layer_norm=not args.no_persist_layer_norm,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        attention_backend=AttnBackend[args.attention_backend],
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        fp16=args.fp16,
        bf16=args.bf16,
        use_cpu_initialization=bool(args.use_cpu_initialization),
        **_moe_config(args),
    )
    return configure_transformer_config(config, args)


def _moe_config(args: argparse.Namespace) -> dict:
    """The ``TransformerConfig`` fields of Megatron-LM's MoE flags (none for a dense model)."""
    if not args.num_experts:
        return {}
    return dict(
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_permute_fusion=args.moe_permute_fusion,
        moe_grouped_gemm=args.moe_grouped_gemm,
    )


def vocab_size(args: argparse.Namespace) -> int:
    return padded_vocab_size(ByteTokenizer().vocab_size, args.make_vocab_size_divisible_by,
                             args.tensor_model_parallel_size)


def _layer_spec(args: argparse.Namespace):
    """megatron-core's local layer; with ``--moe-grouped-gemm`` its MoE layer is the Transformer Engine spec's
    (``TEGroupedMLP``, the one spec with grouped experts), on ascendspeed's grouped linears where TE is missing."""
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False,
                                    normalization=args.normalization)
    if args.num_experts and args.moe_grouped_gemm:
        spec.submodules.mlp = get_moe_module_spec(use_te=True, num_experts=args.num_experts, moe_grouped_gemm=True)
    return spec


def _gpt_chunk(args: argparse.Namespace, config: TransformerConfig, vp_stage) -> GPTModel:
    """The layers of one (virtual) pipeline stage; only the first holds the embedding, the last the head."""
    vp_size = args.virtual_pipeline_model_parallel_size
    first_chunk = vp_stage is None or vp_stage == 0
    last_chunk = vp_stage is None or vp_stage == vp_size - 1
    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(args),
        vocab_size=vocab_size(args),
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True) and first_chunk,
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True) and last_chunk,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        vp_stage=vp_stage,
    )
    model.vp_stage = vp_stage
    return model


def ddp_config(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """The one builder of the ``DistributedDataParallelConfig`` that Megatron-LM's flags describe.

    Reads ``args.accumulate_allreduce_grads_in_fp32``, ``overlap_grad_reduce``, ``use_distributed_optimizer``,
    ``ddp_average_in_collective`` and ``ddp_bucket_size`` (elements; None: Megatron-LM's
    ``max(4e7, 1e6 * data-parallel size)``, which needs model parallelism initialised). Gradients are bucketed
    only when their reduction overlaps the backward pass; otherwise one reduction runs after it.
    """
    bucket_size = args.ddp_bucket_size
    if bucket_size is None and args.overlap_grad_reduce:
        bucket_size = max(40_000_000, 1_000_000 * parallel_state.get_data_parallel_world_size())
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
        average_in_collective=args.ddp_average_in_collective,
        bucket_size=bucket_size if args.overlap_grad_reduce else None,
    )


def build_model(args: argparse.Namespace, config: TransformerConfig,
                device: torch.device = torch.device("cpu")) -> list[DistributedDataParallel]:
    """This rank's model chunks (one per virtual pipeline stage), on ``device``, wrapped in Megatron's DDP.

    As in Megatron-LM, only the first chunk uses gradient buckets: the communication of later chunks
    overlaps with the backward pass of the earlier ones anyway.
    """
    vp_size = args.virtual_pipeline_model_parallel_size
    stages = [None] if vp_size is None else list(range(vp_size))
    chunks = [_gpt_chunk(args, config, stage) for stage in stages]
    for chunk in chunks:
        for param in chunk.parameters():
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        chunk.to(device)
    if args.fp16 or args.bf16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    settings = ddp_config(args)
    return [
        DistributedDataParallel(config=config, ddp_config=settings, module=chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]


def build_optimizer(args: argparse.Namespace, model: list[DistributedDataParallel]):
    """Megatron's optimizer: no weight decay on biases and norms, mixed-precision master weights, clipping."""
    config = OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        fp16=args.fp16,
        bf16=args.bf16,
        params_dtype=params_dtype(args),
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    # through the module: features wrap megatron-core's function, and ascendspeed's own bindings are not swept
    return megatron_optimizer.get_megatron_optimizer(config, model)


def build_scheduler(args: argparse.Namespace, optimizer) -> OptimizerParamScheduler:
    """Learning rate per iteration (Megatron-LM counts samples; one step here is one iteration).

    On resume ``checkpointing.load_checkpoint`` has already refused schedule flags that differ from the
    checkpoint unless ``--override-opt_param-scheduler`` (flags win) or ``--use-checkpoint-opt_param-scheduler``
    (checkpoint wins) says which one wins; the scheduler then takes the winner's values.
    """
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters,
        wd_incr_style="constant",
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=not args.override_opt_param_scheduler,
    )


def unwrap(chunk) -> GPTModel:
    """The ``GPTModel`` inside DDP and ``Float16Module`` wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def local_parameter_count(model: list[DistributedDataParallel]) -> tuple[int, int]:
    """This rank's share of the model's parameter count, as (dense, expert): summed over the ranks of a
    model-parallel group the first gives the dense parameters (replicated tensors and the last stage's copy
    of a tied embedding count once), summed over an expert-tensor-model-pipeline group the second gives the
    experts (megatron-core marks expert parameters ``allreduce=False``: they are divided over the
    expert-parallel ranks, which are data-parallel ranks of the dense model)."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    dense = expert = 0
    for chunk in model:
        gpt = unwrap(chunk)
        for name, param in gpt.named_parameters():
            if name == "output_layer.weight" and gpt.share_embeddings_and_output_weights and not gpt.pre_process:
                continue
            if not getattr(param, "allreduce", True):
                if getattr(param, "tensor_model_parallel", False) or parallel_state.get_expert_tensor_parallel_rank() == 0:
                    expert += param.numel()
            elif getattr(param, "tensor_model_parallel", False) or tp_rank == 0:
                dense += param.numel()
    return dense, expert
