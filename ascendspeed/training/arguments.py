"""Command-line arguments of the pretraining entry: Megatron-LM's flag names, ascendspeed's features.

The entry defines the subset of Megatron-LM's flags it implements, with the same names, destinations and
meanings, so a Megatron-LM command line carries over. Defaults differ where Megatron-LM has none or where
the embedded default job (a small byte-level GPT on the shipped novel) wants another value; they are
listed by ``--help``. Every ascendspeed feature adds its flags through the feature registry, exactly as it
does for Megatron-LM's own parser.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from typing import Optional, Sequence

from ascendspeed.features import FeatureArgumentError, add_feature_arguments, all_features, validate_features
from ascendspeed.training.data import parse_split


#: Megatron-LM fusions implemented by optional libraries (apex, Transformer Engine, Megatron-LM's CUDA
#: extensions): flag destination -> (library, the value that switches the fusion off). Megatron-LM switches
#: them on by default and fails where the library is missing; the entry switches off those whose library
#: is not installed, and all of them on the CPU.
FUSION_LIBRARIES = {
    "gradient_accumulation_fusion": ("fused_weight_gradient_mlp_cuda", False),
    "masked_softmax_fusion": ("scaled_masked_softmax_cuda", False),
    "apply_rope_fusion": ("transformer_engine", False),
    "no_persist_layer_norm": ("apex", True),
}


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--num-layers", type=int, default=4)
    group.add_argument("--hidden-size", type=int, default=128)
    group.add_argument("--ffn-hidden-size", type=int, default=None,
                       help="default 4 * hidden size; with --swiglu 2/3 of that, rounded down to a multiple of 64")
    group.add_argument("--num-attention-heads", type=int, default=4)
    group.add_argument("--group-query-attention", action="store_true")
    group.add_argument("--num-query-groups", type=int, default=1)
    group.add_argument("--kv-channels", type=int, default=None, help="default hidden size / attention heads")
    group.add_argument("--seq-length", type=int, default=128)
    group.add_argument("--max-position-embeddings", type=int, default=None, help="default --seq-length")
    # The ones of Megatron-LM's choices (features.megatron_flags.POSITION_EMBEDDING_TYPES) this entry's
    # GPTModel builds: yarn and mrope need flags it does not offer, relative is T5's. Features add theirs.
    group.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"])
    group.add_argument("--rotary-percent", type=float, default=1.0)
    group.add_argument("--rotary-base", type=int, default=10000)
    group.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    group.add_argument("--norm-epsilon", type=float, default=1e-5)
    group.add_argument("--swiglu", action="store_true", help="gated SiLU MLP (LLaMA)")
    group.add_argument("--no-swiglu", action="store_false", dest="swiglu",
                       help="Megatron's default GeLU MLP instead of the default job's SwiGLU")
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    group.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    group.add_argument("--attention-dropout", type=float, default=0.0)
    group.add_argument("--attention-backend", default="auto", choices=["auto", "flash", "fused", "unfused", "local"],
                       help="auto, flash, fused: the core attention on the device's fused kernel wherever it computes "
                       "Megatron's function (docs/features/fused-attention.md); unfused, local: Megatron's "
                       "materialised scores")
    group.add_argument("--hidden-dropout", type=float, default=0.0)
    group.add_argument("--init-method-std", type=float, default=0.02)
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    group.add_argument("--attention-softmax-in-fp32", action="store_true")
    group.add_argument("--transformer-impl", default="local", choices=["local"],
                       help="megatron-core's own modules (Transformer Engine is not used)")
    group.add_argument("--use-cpu-initialization", action="store_true", default=None,
                       help="initialise weights on the CPU (always on for the CPU device)")
    for flag, dest in (
        ("--no-masked-softmax-fusion", "masked_softmax_fusion"),
        ("--no-bias-gelu-fusion", "bias_gelu_fusion"),
        ("--no-bias-swiglu-fusion", "bias_swiglu_fusion"),
        ("--no-bias-dropout-fusion", "bias_dropout_fusion"),
        ("--no-rope-fusion", "apply_rope_fusion"),
        ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion"),
    ):
        group.add_argument(flag, action="store_false", dest=dest)
    group.add_argument("--no-persist-layer-norm", action="store_true")


def _add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallelism")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--context-parallel-size", type=int, default=1,
                       help="ranks sharing each sequence (see --context-parallel-algo)")
    group.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    group.add_argument("--sequence-parallel", action="store_true")
    group.add_argument("--use-distributed-optimizer", action="store_true")
    group.add_argument("--overlap-grad-reduce", action="store_true")
    group.add_argument("--no-overlap-grad-reduce", action="store_false", dest="overlap_grad_reduce",
                       help="reduce gradients after the backward pass, as Megatron does by default")
    group.add_argument("--no-align-grad-reduce", action="store_false", dest="align_grad_reduce")
    group.add_argument("--ddp-bucket-size", type=int, default=None,
                       help="elements per gradient bucket (default max(4e7, 1e6 * data-parallel size))")
    group.add_argument("--ddp-average-in-collective", action="store_true")
    group.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    group.add_argument("--distributed-backend", default=None, choices=["gloo", "nccl", "hccl"],
                       help="default: nccl on CUDA, hccl on NPU; the CPU always uses gloo")
    group.add_argument("--distributed-timeout-minutes", type=int, default=10)
    group.add_argument("--rank-stall-timeout-seconds", type=float, default=120.0,
                       help="stop every rank, naming the one at fault, when a rank's heartbeat stops for this long "
                            "(a frozen or stopped process); 0 switches the watchdog off")


def _add_moe_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's mixture-of-experts flags (their names, defaults and choices)."""
    group = parser.add_argument_group("mixture of experts (megatron-core's MoELayer, local experts)")
    group.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (every layer); default: dense")
    group.add_argument("--moe-router-topk", type=int, default=2, help="experts each token goes to")
    group.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="each expert's; default --ffn-hidden-size")
    group.add_argument("--expert-model-parallel-size", type=int, default=1,
                       help="ranks the experts are divided over (within the data- and context-parallel ranks)")
    group.add_argument("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall"])
    group.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                       choices=["aux_loss", "seq_aux_loss", "none"])
    group.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="weight of the load-balancing loss")
    group.add_argument("--moe-z-loss-coeff", type=float, default=None, help="weight of the router z-loss")
    group.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                       help="tokens an expert takes, as a multiple of its even share; more are dropped")
    group.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                       help="with a capacity factor, pad every expert's tokens to its capacity")
    group.add_argument("--moe-permute-fusion", action="store_true",
                       help="permute tokens with fused operators (ascendspeed's where Transformer Engine is missing)")
    group.add_argument("--moe-grouped-gemm", action="store_true",
                       help="run a layer's local experts as grouped GEMMs (megatron-core's TEGroupedMLP; "
                            "ascendspeed's grouped linears where Transformer Engine is missing)")


def _add_training_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training")
    group.add_argument("--micro-batch-size", type=int, default=8)
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="default micro batch size * data-parallel size (one micro-batch per rank)")
    group.add_argument("--train-iters", type=int, default=800)
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--fp16", action="store_true")
    group.add_argument("--loss-scale", type=float, default=None, help="static fp16 loss scale (default dynamic)")
    group.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    group.add_argument("--min-loss-scale", type=float, default=1.0)
    group.add_argument("--loss-scale-window", type=float, default=1000)
    group.add_argument("--hysteresis", type=int, default=2)


def _add_optimizer_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("optimizer and learning rate")
    group.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    group.add_argument("--lr", type=float, default=5e-3)
    group.add_argument("--min-lr", type=float, default=5e-4)
    group.add_argument("--lr-decay-style", default="cosine",
                       choices=["constant", "linear", "cosine", "inverse-square-root"])
    group.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    group.add_argument("--lr-warmup-iters", type=int, default=None,
                       help="default 20, at most a tenth of --lr-decay-iters (so a short run needs no flag)")
    group.add_argument("--lr-warmup-init", type=float, default=0.0)
    group.add_argument("--weight-decay", type=float, default=0.1)
    group.add_argument("--clip-grad", type=float, default=1.0)
    group.add_argument("--adam-beta1", type=float, default=0.9)
    group.add_argument("--adam-beta2", type=float, default=0.95)
    group.add_argument("--adam-eps", type=float, default=1e-8)
    group.add_argument("--sgd-momentum", type=float, default=0.9)


def _add_data_and_logging_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data, evaluation, logging, checkpoints")
    group.add_argument("--data-path", nargs="+", default=None,
                       help="text files (.txt or .txt.gz) to train on, concatenated; default: the embedded novel")
    group.add_argument("--split", default="95,5",
                       help="train,validation[,test] weights over the text, in that order (test is unused)")
    group.add_argument("--log-interval", type=int, default=25)
    group.add_argument("--eval-interval", type=int, default=100)
    group.add_argument("--eval-iters", type=int, default=10,
                       help="global batches per periodic validation (the final one uses the whole split)")
    group.add_argument("--eval-seq-lengths", type=int, nargs="*", default=None,
                       help="sequence lengths of the final validation (default: 1x, 2x and 4x --seq-length); "
                            "lengths past the position embedding's reach are reported as skipped")
    group.add_argument("--save", default=None, help="checkpoint directory to write")
    group.add_argument("--load", default=None, help="checkpoint directory to resume from (if it holds one)")
    group.add_argument("--save-interval", type=int, default=None)
    group.add_argument("--no-load-optim", action="store_true")
    group.add_argument("--no-load-rng", action="store_true")
    group.add_argument("--allow-fresh-start", action="store_true",
                       help="start from scratch when --load holds no checkpoint yet (job scripts that always "
                            "pass --load); without it, a --load that finds nothing is an error")
    schedule = group.add_mutually_exclusive_group()
    schedule.add_argument("--override-opt_param-scheduler", action="store_true",
                          help="on resume, follow this run's --lr, --min-lr, --lr-warmup-iters, --lr-decay-iters, "
                               "--lr-decay-style and --weight-decay instead of the checkpoint's")
    schedule.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                          help="on resume, keep the checkpoint's learning-rate schedule and ignore those flags")
    group.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                       dest="check_for_nan_in_loss_and_grad",
                       help="keep training when the loss or gradient norm is NaN or infinite (default: stop)")


#: The default job shows what ascendspeed is for: ALiBi (and so perplexity at 2x and 4x the training
#: length), a SwiGLU MLP on the fused operator, and gradients reduced while backward runs. These are
#: Megatron-LM's flags with other defaults; Megatron's own are ``--position-embedding-type
#: learned_absolute --no-swiglu --no-overlap-grad-reduce``. ``use_fused_swiglu`` None means "with --swiglu".
DEFAULT_JOB_FEATURES = {
    "position_embedding_type": "alibi",
    "swiglu": True,
    "use_fused_swiglu": None,
    "overlap_grad_reduce": True,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m ascendspeed.training.pretrain_gpt",
        description="Pretrain a GPT with megatron-core and ascendspeed's features. "
                    "Without flags: a small byte-level GPT on the embedded public-domain novel.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    _add_model_arguments(parser)
    _add_parallel_arguments(parser)
    _add_moe_arguments(parser)
    _add_training_arguments(parser)
    _add_optimizer_arguments(parser)
    _add_data_and_logging_arguments(parser)
    add_feature_arguments(parser)
    parser.add_argument("--no-use-fused-swiglu", action="store_false", dest="use_fused_swiglu",
                        help="with --swiglu, megatron-core's own SwiGLU instead of the fused operator")
    parser.set_defaults(**DEFAULT_JOB_FEATURES)
    # Megatron-LM flags a feature reads but the entry does not offer keep the feature's default.
    defined = {action.dest for action in parser._actions}
    for feature in all_features():
        missing = {dest: default for dest, default in feature.megatron_arguments.items() if dest not in defined}
        parser.set_defaults(**missing)
    return parser


#: Sizes and counts that must be positive: flag -> destination. Checked before anything is derived from
#: them, so a 0 is reported with its flag instead of as a ZeroDivisionError or a shape error in the model.
POSITIVE = {
    "--num-layers": "num_layers",
    "--hidden-size": "hidden_size",
    "--ffn-hidden-size": "ffn_hidden_size",
    "--num-attention-heads": "num_attention_heads",
    "--num-query-groups": "num_query_groups",
    "--kv-channels": "kv_channels",
    "--seq-length": "seq_length",
    "--max-position-embeddings": "max_position_embeddings",
    "--make-vocab-size-divisible-by": "make_vocab_size_divisible_by",
    "--tensor-model-parallel-size": "tensor_model_parallel_size",
    "--pipeline-model-parallel-size": "pipeline_model_parallel_size",
    "--context-parallel-size": "context_parallel_size",
    "--num-layers-per-virtual-pipeline-stage": "num_layers_per_virtual_pipeline_stage",
    "--distributed-timeout-minutes": "distributed_timeout_minutes",
    "--micro-batch-size": "micro_batch_size",
    "--global-batch-size": "global_batch_size",
    "--train-iters": "train_iters",
    "--lr-decay-iters": "lr_decay_iters",
    "--log-interval": "log_interval",
    "--eval-iters": "eval_iters",
    "--save-interval": "save_interval",
    "--hysteresis": "hysteresis",
    "--norm-epsilon": "norm_epsilon",
    "--adam-eps": "adam_eps",
    "--initial-loss-scale": "initial_loss_scale",
    "--min-loss-scale": "min_loss_scale",
    "--loss-scale-window": "loss_scale_window",
    "--loss-scale": "loss_scale",
    "--rotary-base": "rotary_base",
    "--num-experts": "num_experts",
    "--moe-router-topk": "moe_router_topk",
    "--moe-ffn-hidden-size": "moe_ffn_hidden_size",
    "--expert-model-parallel-size": "expert_model_parallel_size",
    "--moe-expert-capacity-factor": "moe_expert_capacity_factor",
}

#: Values that may be 0 but not negative (``--eval-interval 0`` switches periodic validation off,
#: ``--clip-grad 0`` switches clipping off, as in Megatron-LM).
NON_NEGATIVE = {
    "--lr": "lr",
    "--min-lr": "min_lr",
    "--lr-warmup-iters": "lr_warmup_iters",
    "--lr-warmup-init": "lr_warmup_init",
    "--weight-decay": "weight_decay",
    "--clip-grad": "clip_grad",
    "--init-method-std": "init_method_std",
    "--sgd-momentum": "sgd_momentum",
    "--eval-interval": "eval_interval",
    "--rank-stall-timeout-seconds": "rank_stall_timeout_seconds",
    "--moe-aux-loss-coeff": "moe_aux_loss_coeff",
    "--moe-z-loss-coeff": "moe_z_loss_coeff",
}

_PROBABILITY = ("[0, 1)", lambda value: 0 <= value < 1)
_SHARE = ("(0, 1]", lambda value: 0 < value <= 1)

#: Probabilities and shares: flag -> (destination, interval, test).
FRACTIONS = {
    "--attention-dropout": ("attention_dropout", *_PROBABILITY),
    "--hidden-dropout": ("hidden_dropout", *_PROBABILITY),
    "--adam-beta1": ("adam_beta1", *_PROBABILITY),
    "--adam-beta2": ("adam_beta2", *_PROBABILITY),
    "--rotary-percent": ("rotary_percent", *_SHARE),
}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise FeatureArgumentError(message)


def check_ranges(args: argparse.Namespace) -> None:
    """Every size, count, rate and probability on its own: finite and in range (None means "default")."""
    for flag, dest in {**POSITIVE, **NON_NEGATIVE}.items():
        value = getattr(args, dest)
        if value is None:
            continue
        _require(math.isfinite(value), f"{flag} must be a finite number, got {value}")
        if flag in POSITIVE:
            _require(value > 0, f"{flag} must be positive, got {value}")
        else:
            _require(value >= 0, f"{flag} must not be negative, got {value}")
    for flag, (dest, interval, inside) in FRACTIONS.items():
        value = getattr(args, dest)
        _require(inside(value), f"{flag} must be in {interval}, got {value}")
    _require(all(length > 0 for length in args.eval_seq_lengths or []), "--eval-seq-lengths must be positive")
    parse_split(args.split)


def _lr_warmup_default(decay_iters: int) -> int:
    """Warm up over 20 iterations, but never more than a tenth of the decay: ``--train-iters 8`` alone runs."""
    return min(20, decay_iters // 10)


def finalize_args(args: argparse.Namespace, world_size: int, device: str) -> argparse.Namespace:
    """Check every flag and fill the derived values, as Megatron-LM's ``validate_args`` does.

    This is the entry's one argument validation: ranges first (``check_ranges``), then the consistency of
    the parallel layout, the model shape and the schedule. Features check their own flags in their
    ``validate`` (run after this by ``parse_args``). Raises ``FeatureArgumentError`` naming the flags.
    """
    check_ranges(args)
    args.world_size = world_size
    args.device = device
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    _require(world_size % (tp * pp * cp) == 0,
             f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) x context ({cp}) "
             f"parallel size")
    args.data_parallel_size = world_size // (tp * pp * cp)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    _require(args.global_batch_size % per_step == 0,
             f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
             f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}")
    args.num_microbatches = args.global_batch_size // per_step
    _finalize_pipeline(args)
    if args.use_fused_swiglu is None:
        args.use_fused_swiglu = args.swiglu
    _finalize_model_shape(args)
    _finalize_moe(args)
    _finalize_schedule(args)

    if not args.add_bias_linear:
        args.bias_gelu_fusion = False
    for dest, (library, off) in FUSION_LIBRARIES.items():
        if device == "cpu" or importlib.util.find_spec(library) is None:
            setattr(args, dest, off)
    if device == "cpu":
        args.use_cpu_initialization = True
        args.distributed_backend = "gloo"
    elif args.distributed_backend is None:
        args.distributed_backend = {"cuda": "nccl", "npu": "hccl"}[device]
    return args


def _finalize_pipeline(args: argparse.Namespace) -> None:
    pp = args.pipeline_model_parallel_size
    _require(args.num_layers % pp == 0,
             f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is None:
        return
    layers_per_stage = args.num_layers // pp
    _require(pp > 1, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    _require(layers_per_stage % args.num_layers_per_virtual_pipeline_stage == 0,
             f"{layers_per_stage} layers per pipeline stage are not divisible by "
             f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage}")
    virtual_stages = layers_per_stage // args.num_layers_per_virtual_pipeline_stage
    if virtual_stages > 1:
        args.virtual_pipeline_model_parallel_size = virtual_stages
        _require(args.num_microbatches % pp == 0,
                 f"the interleaved pipeline schedule needs the number of micro-batches ({args.num_microbatches}) "
                 f"to be a multiple of --pipeline-model-parallel-size; raise --global-batch-size")


def _finalize_model_shape(args: argparse.Namespace) -> None:
    tp = args.tensor_model_parallel_size
    heads = args.num_attention_heads
    _require(heads % tp == 0,
             f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}")
    _require(args.hidden_size % heads == 0 or args.kv_channels is not None,
             f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {heads}; set --kv-channels")
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // heads
    if args.group_query_attention:
        groups = args.num_query_groups
        _require(heads % groups == 0,
                 f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}: every query "
                 f"group needs the same number of heads")
        _require(groups % tp == 0,
                 f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp}")
    else:
        args.num_query_groups = heads
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
        if args.swiglu:
            args.ffn_hidden_size = int(args.ffn_hidden_size * 2 / 3) // 64 * 64 or 64
    _require(args.ffn_hidden_size % tp == 0,
             f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    _require(args.position_embedding_type != "learned_absolute" or args.seq_length <= args.max_position_embeddings,
             f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}")
    if tp == 1:
        args.sequence_parallel = False
    _require(not args.sequence_parallel or args.seq_length % tp == 0,
             f"--sequence-parallel splits each sequence over the {tp} tensor-parallel ranks: --seq-length "
             f"{args.seq_length} must be divisible by --tensor-model-parallel-size {tp}")
    _require(not (args.fp16 and args.bf16), "--fp16 and --bf16 are exclusive")
    _finalize_eval_seq_lengths(args)


def _finalize_moe(args: argparse.Namespace) -> None:
    """The expert layout: experts divide over --expert-model-parallel-size ranks taken from the data- and
    context-parallel ranks of one tensor-parallel group (megatron-core's expert grid)."""
    ep = args.expert_model_parallel_size
    if not args.num_experts:
        _require(ep == 1, f"--expert-model-parallel-size {ep} needs --num-experts: this model has no experts")
        _require(not args.moe_permute_fusion, "--moe-permute-fusion needs --num-experts: this model has no experts")
        _require(not args.moe_grouped_gemm, "--moe-grouped-gemm needs --num-experts: this model has no experts")
        return
    _require(not (args.moe_grouped_gemm and args.add_bias_linear and args.bias_dropout_fusion),
             "--moe-grouped-gemm with biased linear layers cannot use the bias-dropout fusion (megatron-core's "
             "TEGroupedMLP refuses it): pass --no-bias-dropout-fusion, or --disable-bias-linear")
    _require(not (args.moe_grouped_gemm and not args.swiglu and args.bias_gelu_fusion),
             "--moe-grouped-gemm fuses the bias into SwiGLU only (megatron-core's TEGroupedMLP): pass "
             "--no-bias-gelu-fusion with --no-swiglu")
    _require(args.moe_router_topk <= args.num_experts,
             f"--moe-router-topk {args.moe_router_topk} exceeds --num-experts {args.num_experts}")
    _require(args.num_experts % ep == 0,
             f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}")
    spare = args.data_parallel_size * args.context_parallel_size
    _require(spare % ep == 0,
             f"--expert-model-parallel-size {ep} must divide data-parallel x context-parallel size ({spare}): "
             "the experts are divided over those ranks")
    _require(not args.moe_pad_expert_input_to_capacity or args.moe_expert_capacity_factor is not None,
             "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    _require(args.moe_ffn_hidden_size % args.tensor_model_parallel_size == 0,
             f"--moe-ffn-hidden-size {args.moe_ffn_hidden_size} is not divisible by --tensor-model-parallel-size "
             f"{args.tensor_model_parallel_size}")


def _finalize_eval_seq_lengths(args: argparse.Namespace) -> None:
    """Default 1x, 2x and 4x --seq-length. Lengths the user gives follow the rules --seq-length follows
    where one is switched on (a context-parallel or sequence-parallel split); the defaults are multiples of
    --seq-length, so only --seq-length's own check (naming --seq-length) can refuse them."""
    if args.eval_seq_lengths is None:
        args.eval_seq_lengths = [args.seq_length * k for k in (1, 2, 4)]
        return
    lengths = args.eval_seq_lengths
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    if cp > 1:
        _require(all(length % (2 * cp) == 0 for length in lengths),
                 f"--eval-seq-lengths {' '.join(map(str, lengths))} must each divide by 2 x --context-parallel-size "
                 f"= {2 * cp}: context parallelism cuts every sequence into 2 x cp equal chunks")
    if args.sequence_parallel:
        _require(all(length % tp == 0 for length in lengths),
                 f"--eval-seq-lengths {' '.join(map(str, lengths))} must each divide by --tensor-model-parallel-size "
                 f"{tp}: --sequence-parallel splits every sequence over the tensor-parallel ranks")


def _finalize_schedule(args: argparse.Namespace) -> None:
    _require(args.min_lr <= args.lr, f"--min-lr {args.min_lr} exceeds --lr {args.lr}")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters is None:
        args.lr_warmup_iters = _lr_warmup_default(args.lr_decay_iters)
    _require(args.lr_warmup_iters < args.lr_decay_iters,
             f"--lr-warmup-iters {args.lr_warmup_iters} must be below --lr-decay-iters {args.lr_decay_iters} "
             f"(default --train-iters)")


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None,
               device: Optional[str] = None) -> argparse.Namespace:
    """Parse, derive and validate (feature checks included); usage errors exit like argparse's."""
    from ascendspeed.accelerator import select_device
    from ascendspeed.accelerator.cpu_features import slow_bf16_warning

    parser = build_parser()
    args = parser.parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        finalize_args(args, world_size, device or select_device())
        validate_features(args)
    except (FeatureArgumentError, ValueError) as error:
        parser.error(str(error))
    warning = slow_bf16_warning() if args.bf16 and args.device == "cpu" else None
    if warning is not None and int(os.environ.get("RANK", "0")) == 0:
        print(warning, file=sys.stderr, flush=True)
    return args
