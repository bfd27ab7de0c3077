"""The pretraining entry's command line: Megatron-LM's flag names, derived values, feature flags."""
import importlib.util

import pytest

from ascendspeed.accelerator.cpu_features import has_fast_bf16_gemm
from ascendspeed.features import all_features
from ascendspeed.training.arguments import build_parser, parse_args

MEGATRON_COMMAND = """
--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 --seq-length 64
--max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 8 --tensor-model-parallel-size 1
--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --bf16 --swiglu
--normalization RMSNorm --position-embedding-type rope --overlap-grad-reduce --use-distributed-optimizer
--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0
--train-iters 10 --log-interval 1 --eval-interval 5 --eval-iters 1 --seed 42 --save /tmp/ckpt --load /tmp/ckpt
--save-interval 5 --data-path corpus.txt --untie-embeddings-and-output-weights --disable-bias-linear
--attention-dropout 0.0 --hidden-dropout 0.0 --transformer-impl local --no-gradient-accumulation-fusion
--no-persist-layer-norm --no-rope-fusion --no-masked-softmax-fusion --distributed-backend gloo
--split 969,30,1
""".split()


def test_a_megatron_lm_command_line_parses():
    args = parse_args(MEGATRON_COMMAND, world_size=2, device="cpu")
    assert args.data_parallel_size == 1
    assert args.virtual_pipeline_model_parallel_size == 2
    assert args.num_microbatches == 4
    one_virtual_stage = MEGATRON_COMMAND + ["--num-layers-per-virtual-pipeline-stage", "2"]
    assert parse_args(one_virtual_stage, world_size=2, device="cpu").virtual_pipeline_model_parallel_size is None
    assert args.add_bias_linear is False
    assert args.bf16 and args.swiglu and args.untie_embeddings_and_output_weights
    assert args.data_path == ["corpus.txt"]


@pytest.mark.parametrize("policy", ["native", "auto"])
def test_bf16_on_a_cpu_without_a_bf16_gemm_is_told_before_training(capsys, monkeypatch, policy):
    """Without AVX-512 torch's bf16 matmul is a scalar loop (bench/bf16_gemm.py), which ascendspeed replaces with
    fp32 products unless ASCENDSPEED_CPU_HALF_GEMM=native: a --bf16 run on such a CPU with that setting is told
    so once, on rank 0, with the fix; an fp32 run, another rank or a fast-bf16 CPU hears nothing."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("ASCENDSPEED_CPU_HALF_GEMM", policy)
    parse_args(["--bf16"], world_size=2, device="cpu")
    told = "no fast bf16 matrix multiply here" in capsys.readouterr().err
    assert told == (policy == "native" and not has_fast_bf16_gemm())
    parse_args([], world_size=2, device="cpu")
    monkeypatch.setenv("RANK", "1")
    parse_args(["--bf16"], world_size=2, device="cpu")
    assert "bf16" not in capsys.readouterr().err


def test_defaults_are_the_embedded_job():
    args = parse_args([], world_size=2, device="cpu")
    assert args.data_path is None
    assert args.data_parallel_size == 2
    assert args.global_batch_size == args.micro_batch_size * 2
    assert args.num_microbatches == 1
    assert args.max_position_embeddings == args.seq_length
    assert args.ffn_hidden_size == (4 * args.hidden_size * 2 // 3) // 64 * 64  # SwiGLU's, as Megatron-LM sizes it
    assert args.kv_channels == args.hidden_size // args.num_attention_heads
    assert args.eval_seq_lengths == [args.seq_length, 2 * args.seq_length, 4 * args.seq_length]
    assert args.lr_decay_iters == args.train_iters
    # what the default job shows: ALiBi, SwiGLU on the fused operator, overlapped gradient reduction
    assert (args.position_embedding_type, args.swiglu, args.use_fused_swiglu, args.overlap_grad_reduce) == (
        "alibi", True, True, True)


def test_megatron_defaults_are_one_flag_each_away():
    args = parse_args(["--position-embedding-type", "learned_absolute", "--no-swiglu", "--no-overlap-grad-reduce"],
                      world_size=2, device="cpu")
    assert (args.position_embedding_type, args.swiglu, args.use_fused_swiglu, args.overlap_grad_reduce) == (
        "learned_absolute", False, False, False)
    assert args.ffn_hidden_size == 4 * args.hidden_size
    assert not parse_args(["--no-use-fused-swiglu"], world_size=2, device="cpu").use_fused_swiglu
    with pytest.raises(SystemExit):  # explicitly asked for, the fused SwiGLU still needs --swiglu
        parse_args(["--no-swiglu", "--use-fused-swiglu"], world_size=2, device="cpu")


def test_cpu_turns_off_cuda_only_fusions_and_uses_gloo():
    args = parse_args([], world_size=1, device="cpu")
    assert args.use_cpu_initialization
    assert args.distributed_backend == "gloo"
    assert not (args.gradient_accumulation_fusion or args.masked_softmax_fusion or args.apply_rope_fusion)
    assert args.no_persist_layer_norm


def test_sequence_parallel_runs_on_the_local_norm_and_needs_a_divisible_sequence(capsys):
    args = parse_args(["--tensor-model-parallel-size", "2", "--sequence-parallel"], world_size=2, device="cpu")
    assert args.sequence_parallel
    with pytest.raises(SystemExit):
        parse_args(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "127"],
                   world_size=2, device="cpu")
    assert "--seq-length 127 must be divisible by --tensor-model-parallel-size 2" in capsys.readouterr().err


def test_swiglu_sizes_the_mlp_like_megatron():
    args = parse_args(["--swiglu", "--hidden-size", "256"], world_size=1, device="cpu")
    assert args.ffn_hidden_size == 640


@pytest.mark.parametrize("flags, message", [
    (["--global-batch-size", "6", "--micro-batch-size", "4"], "--global-batch-size 6"),
    (["--lr-warmup-iters", "50", "--train-iters", "50"], "--lr-warmup-iters"),
    (["--fp16", "--bf16"], "exclusive"),
    (["--position-embedding-type", "learned_absolute", "--seq-length", "128", "--max-position-embeddings", "64"],
     "--max-position-embeddings"),
    (["--tensor-model-parallel-size", "3"], "world size 2"),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"], "micro-batches"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], "--pipeline-model-parallel-size > 1"),
    (["--min-lr", "1", "--lr", "0.1"], "--min-lr"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2 needs --num-experts"),
    (["--moe-permute-fusion"], "--moe-permute-fusion needs --num-experts"),
    (["--moe-grouped-gemm"], "--moe-grouped-gemm needs --num-experts"),
    (["--num-experts", "4", "--moe-grouped-gemm"], "pass --no-bias-dropout-fusion, or --disable-bias-linear"),
    (["--num-experts", "4", "--moe-grouped-gemm", "--no-bias-dropout-fusion", "--no-swiglu"],
     "pass --no-bias-gelu-fusion with --no-swiglu"),
    (["--num-experts", "2", "--moe-router-topk", "4"], "--moe-router-topk 4 exceeds --num-experts 2"),
    (["--num-experts", "3", "--expert-model-parallel-size", "2"], "--num-experts 3 is not divisible"),
    (["--num-experts", "4", "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"],
     "must divide data-parallel x context-parallel size (1)"),
    (["--num-experts", "4", "--moe-pad-expert-input-to-capacity"], "needs --moe-expert-capacity-factor"),
    (["--num-experts", "0"], "--num-experts"),
])
def test_inconsistent_flags_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(flags, world_size=2, device="cpu")
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_every_feature_flag_and_megatron_argument_is_available():
    """Whatever the registry holds: its flags parse, and the Megatron flags features read have values."""
    parser = build_parser()
    args = parser.parse_args([])
    for feature in all_features():
        for dest in feature.megatron_arguments:
            assert hasattr(args, dest), f"{feature.name} reads {dest}, which the entry does not provide"
    defined = {action.dest for action in parser._actions}
    for feature in all_features():
        probe = build_parser().__class__()
        feature.add_arguments(probe)
        assert {a.dest for a in probe._actions} - {"help"} <= defined


def test_position_embedding_choices_start_with_megatrons():
    action = build_parser()._option_string_actions["--position-embedding-type"]
    assert action.choices[:3] == ["learned_absolute", "rope", "none"]


@pytest.mark.parametrize("seq_length", [127, 65, 1])
def test_an_odd_seq_length_runs_without_context_parallelism(seq_length):
    """Issue 21 item 8: the default evaluation lengths (1x, 2x, 4x) inherit an odd --seq-length; the
    context-parallel rule (2 x cp) applied at cp 1 and refused every odd length."""
    args = parse_args(["--seq-length", str(seq_length)], world_size=1, device="cpu")
    assert args.eval_seq_lengths == [seq_length, 2 * seq_length, 4 * seq_length]
    explicit = parse_args(["--seq-length", str(seq_length), "--eval-seq-lengths", "33", "99"], world_size=1,
                          device="cpu")
    assert explicit.eval_seq_lengths == [33, 99]


def test_with_context_parallelism_the_rule_names_the_flag_the_user_gave(capsys):
    args = parse_args(["--context-parallel-size", "2", "--seq-length", "36"], world_size=2, device="cpu")
    assert args.eval_seq_lengths == [36, 72, 144]
    with pytest.raises(SystemExit):  # the default lengths: the message is about --seq-length, not them
        parse_args(["--context-parallel-size", "2", "--seq-length", "38"], world_size=2, device="cpu")
    error = capsys.readouterr().err.splitlines()[-1]
    assert "--seq-length 38 must divide by 2 x --context-parallel-size = 4" in error
    assert "--eval-seq-lengths" not in error
    with pytest.raises(SystemExit):
        parse_args(["--context-parallel-size", "2", "--seq-length", "36", "--eval-seq-lengths", "36", "70"],
                   world_size=2, device="cpu")
    assert "--eval-seq-lengths 36 70 must each divide by 2 x --context-parallel-size = 4" in capsys.readouterr().err


def test_with_sequence_parallelism_explicit_eval_lengths_must_split_over_tensor_parallel_ranks(capsys):
    flags = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "64"]
    assert parse_args(flags + ["--eval-seq-lengths", "64", "130"], world_size=2, device="cpu").eval_seq_lengths == [
        64, 130]
    with pytest.raises(SystemExit):
        parse_args(flags + ["--eval-seq-lengths", "64", "129"], world_size=2, device="cpu")
    assert "--eval-seq-lengths 64 129 must each divide by --tensor-model-parallel-size 2" in capsys.readouterr().err
    assert parse_args(["--tensor-model-parallel-size", "2", "--eval-seq-lengths", "129"], world_size=2,
                      device="cpu").eval_seq_lengths == [129]
