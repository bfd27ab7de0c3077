"""ascendspeed's features inside Megatron-LM's own ``pretrain_gpt.py`` on the CPU, end to end.

Needs a Megatron-LM tree of the installed megatron-core's release (``tests/helpers/megatron_lm.py`` says where
it comes from) and its training packages in the environment (docs/megatron-lm-on-cpu.md). Runs follow that document's recipe with
the installed megatron-core wheel: the launcher imports ``ascendspeed.megatron_adaptor`` and appends the
checkout to ``sys.path`` (after site-packages), so ``megatron.training`` comes from the checkout and
``megatron.core`` from the wheel, whose dataset helpers Megatron-LM would otherwise try to ``make``.

A run passes when it trains (the loss falls), its log has the adaptor's ``> ascendspeed features: ...`` line,
and the feature's own code ran: the launcher counts calls of functions only the feature's patches reach.
"""
import argparse
import os
import re
import sys

import pytest

from ascendspeed.patching.patch import installed_version
from ascendspeed.patching.versions import release
from tests.helpers.megatron_lm import MEGATRON_LM_PATH, add_megatron_lm_to_path
from tests.helpers.megatron_lm_jobs import run_job

pytestmark = pytest.mark.megatron_lm

#: Functions only an enabled feature reaches, counted by the launcher (``COUNT_CALLS``).
SWIGLU_OP = "ascendspeed.ops.swiglu:swiglu"
#: The experts' SwiGLU, scaled by the routing probabilities in the same operator.
WEIGHTED_SWIGLU_OP = "ascendspeed.ops.swiglu:weighted_swiglu"
ALIBI_OP = "ascendspeed.ops.alibi:alibi_bias_"
ASYNC_DDP_HOOK = "ascendspeed.features.async_ddp.bucket_groups:register_grad_ready"
REUSE_SPLIT = "ascendspeed.ops.bf16_split:bf16_split_"
RMS_NORM_OP = "ascendspeed.ops.rms_norm:rms_norm"
ROTARY_OP = "ascendspeed.ops.rotary:rotary_embedding"
MLA_HEAD_SIZES = "ascendspeed.features.local_mla.attention:set_head_sizes"
MAMBA_SCAN = "ascendspeed.accelerator.mamba_fallback.ssd:chunk_scan"
GDN_RULE = "ascendspeed.accelerator.gdn_fallback.kernels:_megatron_torch_rule"
#: Called by every chunked linear of --use-ascend-coc, forward and backward.
COC_CHUNKS = "ascendspeed.features.tp_comm_overlap.chunked:chunk_bounds"
#: The context-parallel attention of each algorithm, as the attention layers call it (once per layer and
#: micro-batch forward; backward runs inside its autograd function).
CP_ATTENTION = "ascendspeed.features.context_parallel.megatron_attention:{}_attention"

LAUNCHER = '''\
import ascendspeed.megatron_adaptor  # first: device selection, CPU shims, Megatron-LM hooks
import collections
import functools
import importlib
import os
import runpy
import sys

CALLS = collections.Counter()


def count(target):
    module_name, name = target.split(":")
    module = importlib.import_module(module_name)
    original = getattr(module, name)

    @functools.wraps(original)
    def counted(*args, **kwargs):
        CALLS[target] += 1
        return original(*args, **kwargs)

    setattr(module, name, counted)  # before Megatron-LM parses its flags, so features bind the counter


for target in filter(None, os.environ.get("COUNT_CALLS", "").split(",")):
    count(target)
sys.path.append(os.environ["MEGATRON_LM_PATH"])
sys.argv[0] = os.path.join(os.environ["MEGATRON_LM_PATH"], os.environ.get("MEGATRON_LM_SCRIPT", "pretrain_gpt.py"))
runpy.run_path(sys.argv[0], run_name="__main__")
# A leading newline: another rank may have left a line unfinished on the shared stdout.
for target in filter(None, os.environ.get("COUNT_CALLS", "").split(",")):
    print(f"\\ncalls rank={os.environ.get('RANK', '0')} {target} {CALLS[target]}", flush=True)
if "--log-cp-ring-overlap" in sys.argv:
    from ascendspeed.features import applied_features

    (context_parallel,) = [applied for applied in applied_features() if applied.name == "context_parallel"]
    summary = context_parallel.state.ring.summary()
    print(f"\\ncp ring rank={os.environ.get('RANK', '0')} hops={summary['hops']} "
          f"hidden={summary['hidden_fraction']:.4f}", flush=True)
'''
ITERATIONS = 12
TINY_GPT = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--train-iters", str(ITERATIONS), "--lr", "2e-3", "--lr-decay-style", "constant",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234",
    # data loading in the training process: the loader's worker processes are torch's, not what these jobs
    # check, and cost ~1 s per job (Megatron's default of 2 workers runs in the resume and entry tests)
    "--num-workers", "0",
]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.Ee+-]+)")
CALLS = re.compile(r"^calls rank=(\d+) (\S+) (\d+)$", re.MULTILINE)
FEATURES = re.compile(r"^> ascendspeed features: (.*)$", re.MULTILINE)
RING_TELEMETRY = re.compile(r"^cp ring rank=(\d+) hops=(\d+) hidden=([0-9.]+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    path = tmp_path_factory.mktemp("megatron_lm_features") / "pretrain_gpt_cpu.py"
    path.write_text(LAUNCHER)
    return str(path)


def _launch(launcher, processes, flags, count=(), timeout=300, script="pretrain_gpt.py"):
    environment = {
        **os.environ,
        "ASCENDSPEED_DEVICE": "cpu",
        "MEGATRON_LM_PATH": MEGATRON_LM_PATH,
        "MEGATRON_LM_SCRIPT": script,
        "OMP_NUM_THREADS": "1",
        "COUNT_CALLS": ",".join(count),
    }
    environment.pop("MAKEFLAGS", None)  # nothing to make: the wheel ships the helpers
    return run_job(launcher, processes, [*TINY_GPT, *flags], env=environment, cwd=os.path.dirname(launcher),
                   timeout=timeout)


def _checked_run(launcher, processes, flags, feature, count, script="pretrain_gpt.py"):
    """Run, then check the loss falls, the adaptor reports ``feature``, and every counted function ran on
    every rank; returns the losses, the call counts ({(rank, target): calls}) and the output."""
    returncode, output = _launch(launcher, processes, flags, count, script=script)
    assert returncode == 0, f"Megatron-LM failed (exit {returncode}):\n{output[-6000:]}"
    assert _reported(output) == [feature], f"adaptor report: {FEATURES.findall(output)}\n{output[-3000:]}"
    losses = {int(step): float(loss) for step, loss in LOSS.findall(output)}
    assert sorted(losses) == list(range(1, ITERATIONS + 1)), f"a loss per iteration expected: {losses}"
    losses = [losses[step] for step in sorted(losses)]
    assert all(loss == loss for loss in losses), f"NaN loss: {losses}"
    assert sum(losses[-3:]) / 3 < 0.95 * sum(losses[:3]) / 3, f"loss did not fall: {losses}"
    calls = {(int(rank), target): int(n) for rank, target, n in CALLS.findall(output)}
    assert set(calls) == {(rank, target) for rank in range(processes) for target in count}, calls
    return losses, calls, output


def _reported(output):
    """The adaptor's report lines, without fused attention (on by Megatron's default --attention-backend auto)."""
    return [", ".join(name for name in line.split(", ") if name != "fused_attention")
            for line in FEATURES.findall(output)]


def _train(launcher, processes, flags, feature, count, script="pretrain_gpt.py"):
    """``_checked_run`` without the output: the losses and the call counts."""
    return _checked_run(launcher, processes, flags, feature, count, script)[:2]


def test_fused_swiglu_one_process(launcher):
    _, calls, output = _checked_run(launcher, 1, ["--global-batch-size", "4", "--swiglu", "--use-fused-swiglu"],
                                    "fused_swiglu", [SWIGLU_OP])
    assert FEATURES.findall(output) == ["fused_attention, fused_swiglu"]  # Megatron's --attention-backend auto
    # one forward per layer and micro-batch (2 per step); backward is the operator's own kernel
    assert calls[0, SWIGLU_OP] == 2 * 2 * ITERATIONS, calls


def test_fused_swiglu_two_processes_tensor_parallel(launcher):
    """Unfused gated path (no bias-SwiGLU fusion), each rank's half of the gate and up projections."""
    flags = ["--global-batch-size", "4", "--swiglu", "--use-fused-swiglu", "--no-bias-swiglu-fusion",
             "--tensor-model-parallel-size", "2"]
    _, calls = _train(launcher, 2, flags, "fused_swiglu", [SWIGLU_OP])
    assert all(n == 2 * 2 * ITERATIONS for n in calls.values()), calls


def test_alibi_one_process(launcher):
    _, calls = _train(launcher, 1, ["--global-batch-size", "4", "--position-embedding-type", "alibi"],
                      "alibi", [ALIBI_OP])
    assert calls[0, ALIBI_OP] >= 2 * 2 * ITERATIONS, calls


def test_alibi_two_processes_tensor_parallel(launcher):
    """Each tensor-parallel rank biases its own two heads."""
    flags = ["--global-batch-size", "4", "--position-embedding-type", "alibi", "--tensor-model-parallel-size", "2"]
    _, calls = _train(launcher, 2, flags, "alibi", [ALIBI_OP])
    assert all(n >= 2 * 2 * ITERATIONS for n in calls.values()), calls


def test_async_ddp_two_processes_distributed_optimizer(launcher):
    """Small buckets, so several collectives are launched from the gradient hooks during backward."""
    flags = ["--global-batch-size", "8", "--overlap-grad-reduce", "--use-distributed-optimizer",
             "--ddp-bucket-size", "20000"]
    _, calls = _train(launcher, 2, flags, "async_ddp", [ASYNC_DDP_HOOK])
    assert all(n > 0 for n in calls.values()), calls


def test_torch_fsdp2_gives_the_ddp_losses_with_fused_swiglu(launcher):
    """--use-torch-fsdp2 (megatron-core builds its mesh with ``DeviceMesh.from_group(group, "cuda")``, which
    failed on the CPU): 2 ranks shard the parameters, gradients and optimizer states, run the fused SwiGLU, and
    train with the losses of Megatron's DDP on the same flags (dropout included: each rank draws as DDP's)."""
    flags = ["--global-batch-size", "8", "--untie-embeddings-and-output-weights", "--swiglu", "--use-fused-swiglu"]
    reference = _losses(launcher, 2, flags)
    losses, calls = _train(launcher, 2, [*flags, "--use-torch-fsdp2"], "fused_swiglu", [SWIGLU_OP])
    assert losses == pytest.approx(reference, rel=1e-5)
    assert all(n == 2 * 2 * ITERATIONS for n in calls.values()), calls  # layers x micro-batches x iterations


def test_megatron_fsdp_gives_the_distributed_optimizer_losses_with_fused_swiglu(launcher):
    """--use-megatron-fsdp, fully sharded (optim_grads_params), which names its device
    ``torch.device(f"cuda:{torch.cuda.current_device()}")`` and scales gradients with NCCL's PREMUL_SUM: 2 ranks
    shard parameters, gradients and optimizer states, run the fused SwiGLU, and train with the losses of
    Megatron's distributed optimizer on the same flags."""
    flags = ["--global-batch-size", "8", "--untie-embeddings-and-output-weights", "--swiglu", "--use-fused-swiglu",
             "--use-distributed-optimizer"]
    reference = _losses(launcher, 2, flags)
    fsdp = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
            "--ckpt-format", "fsdp_dtensor"]
    losses, calls = _train(launcher, 2, [*flags, *fsdp], "fused_swiglu", [SWIGLU_OP])
    assert losses == pytest.approx(reference, rel=1e-5)
    assert all(n == 2 * 2 * ITERATIONS for n in calls.values()), calls


@pytest.mark.parametrize("optimizer", [[], ["--use-distributed-optimizer"]], ids=["float16-optimizer", "distopt"])
def test_reuse_fp32_param_two_processes_bit_identical(launcher, optimizer):
    """bf16 with and without --reuse-fp32-param: the same losses, to the last bit Megatron-LM prints."""
    flags = ["--global-batch-size", "8", "--bf16", *optimizer]
    returncode, output = _launch(launcher, 2, flags)
    assert returncode == 0, output[-6000:]
    reference = [float(loss) for _, loss in LOSS.findall(output)]
    losses, calls = _train(launcher, 2, [*flags, "--reuse-fp32-param"], "reuse_fp32_param", [REUSE_SPLIT])
    assert losses == reference
    assert all(n >= ITERATIONS for n in calls.values()), calls


#: Tensor-parallel runs with and without sequence parallelism: no dropout (sequence parallelism draws the
#: hidden-dropout masks of each rank's part of the sequence from another generator) and RoPE (Megatron-LM's
#: JIT warm-up draws seq-length / tp random numbers with sequence parallelism, before the learned position
#: embedding is initialised); a learning rate at which 12 iterations lower the loss on every release.
TP_COMPARABLE = ["--global-batch-size", "4", "--tensor-model-parallel-size", "2", "--transformer-impl", "local",
                 "--attention-dropout", "0", "--hidden-dropout", "0", "--position-embedding-type", "rope", "--lr", "5e-3"]


def _losses(launcher, processes, flags, script="pretrain_gpt.py"):
    returncode, output = _launch(launcher, processes, flags, script=script)
    assert returncode == 0, f"Megatron-LM failed (exit {returncode}):\n{output[-6000:]}"
    return [float(loss) for _, loss in LOSS.findall(output)]


@pytest.fixture(scope="module")
def tensor_parallel_losses(launcher):
    """The losses of plain TP 2 (``TP_COMPARABLE``), which the other tensor-parallel layouts must give."""
    return _losses(launcher, 2, TP_COMPARABLE)


def test_sequence_parallel_local_spec_matches_tensor_parallel(launcher, tensor_parallel_losses):
    """The command that failed before ascendspeed (megatron-core's torch norms assert "sequence parallel not
    supported"): TP 2 with --sequence-parallel on the local spec trains, on ascendspeed's norm, with the losses
    of TP 2 without it (Megatron's own LayerNorm)."""
    losses, _ = _train(launcher, 2, [*TP_COMPARABLE, "--sequence-parallel"], "local_norm", [])
    assert losses == pytest.approx(tensor_parallel_losses, rel=1e-5)


FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
#: Called where a recomputed forward leaves out its last reduction (--optimize-recomp-communication-level).
SKIPPED_REDUCTION = "ascendspeed.features.tp_comm_overlap.recompute:partial_product_without_reduction"


@pytest.mark.parametrize("flags, feature, count", [
    (["--sequence-parallel", "--use-ascend-coc", "--coc-parallel-num", "4"], "local_norm, tp_comm_overlap",
     COC_CHUNKS),
    (["--use-ascend-coc", "--coc-parallel-num", "2"], "tp_comm_overlap", COC_CHUNKS),
    (["--sequence-parallel", *FULL_RECOMPUTE, "--optimize-recomp-communication-level", "2"],
     "local_norm, tp_comm_overlap", SKIPPED_REDUCTION),
], ids=["coc-sequence-parallel-4-chunks", "coc-tensor-parallel-2-chunks", "recompute-communication-level-2"])
def test_tensor_parallel_communication_features_match_tensor_parallel(launcher, tensor_parallel_losses, flags,
                                                                     feature, count):
    """--use-ascend-coc with TP 2, with and without sequence parallelism, and full recompute without its
    redundant collectives: their code ran on every rank and the losses are plain TP 2's."""
    losses, calls = _train(launcher, 2, [*TP_COMPARABLE, *flags], feature, [count])
    assert losses == pytest.approx(tensor_parallel_losses, rel=1e-5)
    assert all(n > 0 for n in calls.values()), calls


#: Called on every profiling step of adaptive recompute (each runs another recompute option).
RECOMPUTE_OPTIONS = "ascendspeed.features.adaptive_recompute.controller:apply_options"


def test_adaptive_recompute_profiles_and_plans_in_megatron_lm(launcher, tensor_parallel_losses):
    """--adaptive-recompute-device-size with TP 2: the profiling steps run every profiled recompute option (none,
    core attention, core attention and MLP, full, core attention and MLP and the norms) through Megatron-LM's
    training loop, the plan is printed with its predicted and measured peak, and the losses are plain TP 2's
    throughout."""
    flags = [*TP_COMPARABLE, "--adaptive-recompute-device-size", "100000", "--adaptive-recompute-profiling-step", "6"]
    losses, calls, output = _checked_run(launcher, 2, flags, "adaptive_recompute", [RECOMPUTE_OPTIONS])
    assert losses == pytest.approx(tensor_parallel_losses, rel=1e-5)
    assert set(calls.values()) == {7}, calls  # 6 profiling steps and the plan
    assert output.count("plan after 6 profiling steps") == 2 and output.count("measured peak with the plan") == 2


def test_sequence_parallel_with_fused_rmsnorm_and_rope_matches_megatron(launcher):
    """RMSNorm and RoPE on ascendspeed's operators, with sequence parallelism, against Megatron-LM's own RMSNorm
    and rotary embedding without it: the same losses, and the operators ran on every rank."""
    model = ["--normalization", "RMSNorm"]
    reference = _losses(launcher, 2, [*TP_COMPARABLE, *model])
    flags = [*TP_COMPARABLE, *model, "--sequence-parallel", "--use-fused-rmsnorm", "--use-fused-rotary-pos-emb"]
    losses, calls = _train(launcher, 2, flags, "local_norm, fused_rope", [RMS_NORM_OP, ROTARY_OP])
    assert losses == pytest.approx(reference, rel=1e-5)
    # 2 norms per layer + the final norm; rotary on q and k per layer: per micro-batch forward
    assert {n for (_, target), n in calls.items() if target == RMS_NORM_OP} == {(2 * 2 + 1) * 2 * ITERATIONS}
    assert {n for (_, target), n in calls.items() if target == ROTARY_OP} == {2 * 2 * 2 * ITERATIONS}


def test_transformer_engine_spec_without_transformer_engine(launcher):
    """Megatron-LM's default --transformer-impl transformer_engine, given explicitly, where TE is not installed:
    its TE layer spec builds on megatron-core's local modules (accelerator.te_fallback) with TP 2 and sequence
    parallelism, and ascendspeed's fused RMSNorm (inside the layer-norm linears), SwiGLU and RoPE run in it;
    --te-rng-tracker takes megatron-core's own tracker, as megatron-core does without TE."""
    flags = [*TP_COMPARABLE[:TP_COMPARABLE.index("--transformer-impl")], "--transformer-impl", "transformer_engine",
             *TP_COMPARABLE[TP_COMPARABLE.index("--transformer-impl") + 2:], "--sequence-parallel", "--te-rng-tracker",
             "--normalization", "RMSNorm", "--use-fused-rmsnorm", "--swiglu", "--use-fused-swiglu",
             "--use-fused-rotary-pos-emb"]
    _, calls = _train(launcher, 2, flags, "fused_swiglu, local_norm, fused_rope", [RMS_NORM_OP, SWIGLU_OP, ROTARY_OP])
    # per micro-batch forward: the norms of the two layer-norm linears per layer + the final norm; one SwiGLU
    # per layer; rotary on q and k per layer
    assert {n for (_, target), n in calls.items() if target == RMS_NORM_OP} == {(2 * 2 + 1) * 2 * ITERATIONS}
    assert {n for (_, target), n in calls.items() if target == SWIGLU_OP} == {2 * 2 * ITERATIONS}
    assert {n for (_, target), n in calls.items() if target == ROTARY_OP} == {2 * 2 * 2 * ITERATIONS}


def _hybrid_job():
    """Megatron-LM's hybrid (attention/MLP/Mamba) training script of this release, its layer spec and pattern
    flag: pretrain_hybrid.py with HybridModel from 0.18 (--hybrid-layer-pattern from 0.17); before, the same
    layers as pretrain_mamba.py's MambaModel with --hybrid-override-pattern."""
    if os.path.exists(os.path.join(MEGATRON_LM_PATH, "pretrain_hybrid.py")):
        return "pretrain_hybrid.py", ["--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec",
                                      "--hybrid-layer-pattern"]
    return "pretrain_mamba.py", ["--spec", "megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec",
                                 "--hybrid-override-pattern"]


def test_hybrid_attention_and_mlp_layers(launcher):
    """Megatron-LM's hybrid model with attention (*) and MLP (-) layers: its stack spec names Transformer Engine's
    classes and its final norm is always a TENorm, so without TE it could not build (accelerator.te_fallback);
    with TP 2 and sequence parallelism, on ascendspeed's fused RMSNorm and SwiGLU."""
    script, spec = _hybrid_job()
    flags = [*TP_COMPARABLE, *spec, "*-*-", "--num-layers", "4", "--sequence-parallel", "--normalization", "RMSNorm",
             "--use-fused-rmsnorm", "--swiglu", "--use-fused-swiglu"]
    _, calls = _train(launcher, 2, flags, "fused_swiglu, local_norm", [RMS_NORM_OP, SWIGLU_OP], script)
    # per micro-batch forward: the norm of each layer's layer-norm linear (4 layers) + the final norm; one SwiGLU
    # per MLP layer
    assert {n for (_, target), n in calls.items() if target == RMS_NORM_OP} == {(4 + 1) * 2 * ITERATIONS}
    assert {n for (_, target), n in calls.items() if target == SWIGLU_OP} == {2 * 2 * ITERATIONS}


#: Mamba-2 mixers sized for the tiny model: d_inner 128 = 8 heads of 16, 2 groups (one per TP-2 rank); gated delta
#: net layers with 2 key heads and 4 value heads of 16 (one and two per TP-2 rank)
MAMBA = ["--mamba-state-dim", "16", "--mamba-head-dim", "16", "--mamba-num-groups", "2"]
GATED_DELTA_NET = ["--linear-num-key-heads", "2", "--linear-num-value-heads", "4", "--linear-key-head-dim", "16",
                   "--linear-value-head-dim", "16"]


def _serves_gated_delta_net() -> bool:
    """accelerator.gdn_fallback serves fla's kernels from megatron-core 0.18 (before, G layers are refused)."""
    return release(installed_version()) >= release("0.18.0")


def test_hybrid_mamba_layers_with_tensor_and_sequence_parallelism(launcher):
    """Megatron-LM's hybrid model with Mamba (M) layers where mamba_ssm and causal_conv1d are absent
    (accelerator.mamba_fallback: Mamba-2's scan and convolution in torch) trains at TP 2 (losses falling, the scan
    run by every rank, next to ascendspeed's fused SwiGLU MLP layer), and with sequence parallelism added it gives
    the same losses."""
    script, spec = _hybrid_job()
    flags = [*TP_COMPARABLE, *spec, "M*M-", "--num-layers", "4", "--normalization", "RMSNorm", *MAMBA,
             "--swiglu", "--use-fused-swiglu"]
    losses, calls = _train(launcher, 2, flags, "fused_swiglu", [MAMBA_SCAN, SWIGLU_OP], script)
    # per micro-batch forward: one scan per Mamba layer (2 layers, 2 micro-batches)
    assert {n for (_, target), n in calls.items() if target == MAMBA_SCAN} == {2 * 2 * ITERATIONS}
    sequence_parallel = _losses(launcher, 2, [*flags, "--sequence-parallel"], script)
    assert sequence_parallel == pytest.approx(losses, rel=1e-5)


def test_hybrid_gated_delta_net_layers_train_as_megatrons_own_torch_path(launcher):
    """Megatron-LM's hybrid model with gated delta net (G) layers where fla is absent (accelerator.gdn_fallback)
    trains at TP 2 (losses falling, the rule run by every rank), with the losses of megatron-core's own torch
    path (--deterministic-mode: torch's conv1d and its torch chunked rule, without fla's kernels)."""
    if not _serves_gated_delta_net():
        pytest.skip("served from megatron-core 0.18 (before, G layers are refused)")
    script, spec = _hybrid_job()
    flags = [*TP_COMPARABLE, *spec, "G*G-", "--num-layers", "4", "--normalization", "RMSNorm", *GATED_DELTA_NET,
             "--swiglu", "--use-fused-swiglu"]
    losses, calls = _train(launcher, 2, flags, "fused_swiglu", [GDN_RULE, SWIGLU_OP], script)
    # per micro-batch forward: one rule per gated delta net layer (2 layers, 2 micro-batches)
    assert {n for (_, target), n in calls.items() if target == GDN_RULE} == {2 * 2 * ITERATIONS}
    megatron_torch_path = _losses(launcher, 2, [*flags, "--deterministic-mode"], script)
    assert megatron_torch_path == pytest.approx(losses, rel=1e-5)


def test_gated_delta_net_layers_are_refused_before_megatron_core_0_18(megatron_lm_arguments, monkeypatch):
    if _serves_gated_delta_net():
        pytest.skip("served from megatron-core 0.18 (accelerator.gdn_fallback)")
    from ascendspeed.features import FeatureArgumentError

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *TINY_GPT, "--global-batch-size", "4",
                                      "--hybrid-override-pattern", "G*-"])
    args = megatron_lm_arguments.parse_args()
    with pytest.raises(FeatureArgumentError, match=re.escape("has gated delta net layers (G), whose megatron-core "
                                                             "module needs fla")):
        megatron_lm_arguments.validate_args(args, {})


MLA = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16"]


def test_multi_latent_attention_local_spec(launcher):
    """--multi-latent-attention on the local spec with TP 2 (q/kv low-rank projections, decoupled RoPE with
    YaRN, Megatron's MLA default): megatron-core's DotProductAttention takes MLA's key and value head sizes
    (feature local_mla), the decoupled RoPE runs on ascendspeed's fused rotary operator, the MLP on its fused
    SwiGLU."""
    flags = [*TP_COMPARABLE, *MLA, "--swiglu", "--use-fused-swiglu", "--use-fused-rotary-pos-emb"]
    _, calls = _train(launcher, 2, flags, "fused_swiglu, fused_rope, local_mla",
                      [MLA_HEAD_SIZES, SWIGLU_OP, ROTARY_OP])
    # each layer's attention of each model built (a multiple of the 2 layers)
    assert all(n % 2 == 0 and n > 0 for (_, target), n in calls.items() if target == MLA_HEAD_SIZES), calls
    assert {n for (_, target), n in calls.items() if target == SWIGLU_OP} == {2 * 2 * ITERATIONS}
    # the query's and the key's rotary part in each layer and micro-batch forward
    assert {n for (_, target), n in calls.items() if target == ROTARY_OP} == {2 * 2 * 2 * ITERATIONS}


#: Context-parallel runs against one process: no dropout (Megatron's masks on one process are not drawn by
#: position) and RoPE
#: (Megatron-LM's JIT warm-up draws seq-length / cp random numbers before the learned position embedding
#: is initialised, so that embedding would start differently).
CP_COMPARABLE = ["--global-batch-size", "4", "--attention-dropout", "0", "--hidden-dropout", "0",
                 "--position-embedding-type", "rope"]


@pytest.fixture(scope="module")
def one_process_losses(launcher):
    returncode, output = _launch(launcher, 1, CP_COMPARABLE)
    assert returncode == 0, output[-6000:]
    return [float(loss) for _, loss in LOSS.findall(output)]


@pytest.mark.parametrize("processes, flags, algorithm", [
    (2, ["--context-parallel-size", "2", "--log-cp-ring-overlap"], "ring"),
    (2, ["--context-parallel-size", "2", "--context-parallel-algo", "ulysses_cp_algo"], "ulysses"),
    pytest.param(4, ["--context-parallel-size", "4", "--context-parallel-algo", "hybrid_cp_algo",
                     "--ulysses-degree-in-cp", "2"], "hybrid", marks=pytest.mark.slow),
], ids=["ring-cp2", "ulysses-cp2", "hybrid-cp4"])
def test_context_parallel_matches_one_process(launcher, one_process_losses, processes, flags, algorithm):
    """Megatron-LM's own get_batch splits the batch, its schedule and DDP average the loss and gradients over
    the context-parallel ranks; ascendspeed's attention runs on every rank. Same losses as one process."""
    attention = CP_ATTENTION.format(algorithm)
    losses, calls, output = _checked_run(launcher, processes, [*CP_COMPARABLE, *flags], "context_parallel",
                                         [attention])
    assert losses == pytest.approx(one_process_losses, rel=1e-4)
    assert all(n == 2 * 2 * ITERATIONS for n in calls.values()), calls  # layers x micro-batches x iterations
    if "--log-cp-ring-overlap" not in flags:
        return
    telemetry = {int(rank): (int(hops), float(hidden)) for rank, hops, hidden in RING_TELEMETRY.findall(output)}
    assert sorted(telemetry) == list(range(processes)), output[-3000:]
    for hops, hidden in telemetry.values():
        # per attention call at cp 2: one K/V hop forward, one K/V and two dK/dV hops backward
        assert hops == 4 * 2 * 2 * ITERATIONS
        assert 0.0 <= hidden <= 1.0


def test_multi_latent_attention_context_parallel_matches_one_process(launcher):
    """MLA (query/key heads of nope + rope features, narrower value heads, YaRN RoPE on the fused operator) at
    context parallel 2 with Ulysses: the same losses as one process."""
    flags = [*CP_COMPARABLE, *MLA, "--use-fused-rotary-pos-emb"]
    reference, _ = _train(launcher, 1, flags, "fused_rope, local_mla", [ROTARY_OP])
    losses, calls = _train(launcher, 2, [*flags, "--context-parallel-size", "2", "--context-parallel-algo",
                                         "ulysses_cp_algo"],
                           "fused_rope, context_parallel, local_mla", [CP_ATTENTION.format("ulysses"), ROTARY_OP])
    assert losses == pytest.approx(reference, rel=1e-4)
    assert {n for (_, target), n in calls.items() if target == CP_ATTENTION.format("ulysses")} == {2 * 2 * ITERATIONS}


#: CP_COMPARABLE with Megatron's default attention dropout (0.1).
CP_WITH_ATTENTION_DROPOUT = [*CP_COMPARABLE, "--attention-dropout", "0.1", "--context-parallel-size", "2"]


def test_context_parallel_attention_dropout_does_not_depend_on_the_algorithm(launcher, one_process_losses):
    """Megatron-LM's default attention dropout under context parallelism: the masks follow the seed and the
    tokens' positions (docs/features/context-parallel.md), so ring attention and Ulysses (which computes each
    head whole on one rank) drop the same probabilities and train alike; the dropout is on (the losses are
    not those without it)."""
    ring_losses, _ = _train(launcher, 2, CP_WITH_ATTENTION_DROPOUT, "context_parallel", [CP_ATTENTION.format("ring")])
    ulysses_losses, calls = _train(launcher, 2, [*CP_WITH_ATTENTION_DROPOUT, "--context-parallel-algo", "ulysses_cp_algo"],
                                   "context_parallel", [CP_ATTENTION.format("ulysses")])
    assert ulysses_losses == pytest.approx(ring_losses, rel=1e-4)
    assert ulysses_losses != pytest.approx(one_process_losses, rel=1e-4)  # the tolerance CP runs match by
    assert all(n == 2 * 2 * ITERATIONS for n in calls.values()), calls


def test_invalid_combination_fails_before_training(launcher):
    returncode, output = _launch(launcher, 1, ["--global-batch-size", "4", "--use-fused-swiglu"])
    assert returncode != 0
    assert "FeatureArgumentError: --use-fused-swiglu needs --swiglu" in output, output[-3000:]
    assert "> compiling dataset index builder" not in output and "lm loss" not in output


@pytest.fixture(scope="module")
def megatron_lm_arguments():
    import ascendspeed.megatron_adaptor  # noqa: F401

    add_megatron_lm_to_path()
    from megatron.training import arguments

    return arguments


@pytest.mark.parametrize("flags, message", [
    (["--use-fused-swiglu"], "--use-fused-swiglu needs --swiglu"),
    (["--swiglu", "--use-fused-swiglu", "--glu-linear-offset", "0.5"],
     "--use-fused-swiglu cannot run with --glu-linear-offset 0.5"),
    (["--alibi-fused-attention"], "--alibi-fused-attention needs --position-embedding-type alibi"),
    (["--position-embedding-type", "alibi", "--alibi-fused-attention", "--reset-attention-mask"],
     "--position-embedding-type alibi --alibi-fused-attention cannot run with --reset-attention-mask"),
    (["--overlap-grad-reduce", "--ddp-bucket-size", "0"], "--ddp-bucket-size must be positive"),
    (["--reuse-fp32-param"], "--reuse-fp32-param needs --bf16"),
    (["--bf16", "--reuse-fp32-param", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
     "--reuse-fp32-param cannot run with --overlap-param-gather"),
    # where Transformer Engine is absent (accelerator.te_fallback)
    (["--transformer-impl", "transformer_engine", "--fp8-format", "hybrid"],
     "Megatron without Transformer Engine cannot run with --fp8-format hybrid"),
    (["--transformer-impl", "transformer_engine", "--tp-comm-overlap"],
     "Megatron without Transformer Engine cannot run with --tp-comm-overlap True"),
    (["--hybrid-override-pattern", "*E"],
     "has MoE layers (E), which megatron-core's hybrid specs build as grouped experts: grouped experts"),
    (["--multi-latent-attention", "--position-embedding-type", "alibi"],
     "--position-embedding-type alibi cannot run with --multi-latent-attention True"),
])
def test_invalid_combinations_fail_in_validate_args(megatron_lm_arguments, monkeypatch, flags, message):
    """Megatron-LM's own parse_args + validate_args, in process: the error names the flags."""
    from ascendspeed.features import FeatureArgumentError

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *TINY_GPT, "--global-batch-size", "4", *flags])
    args = megatron_lm_arguments.parse_args()
    with pytest.raises(FeatureArgumentError, match=re.escape(message)):
        megatron_lm_arguments.validate_args(args, {})


@pytest.mark.parametrize("flags, message", [
    (["--cp-comm-type", "a2a"], "--cp-comm-type a2a selects Transformer Engine's context-parallel communication"),
    (["--context-parallel-algo", "hybrid_cp_algo"], "--context-parallel-algo hybrid_cp_algo needs --ulysses-degree-in-cp K"),
    (["--context-parallel-algo", "ulysses_cp_algo", "--log-cp-ring-overlap"],
     "--log-cp-ring-overlap times the hops of ascendspeed's ring attention"),
])
def test_invalid_context_parallel_flags_fail_in_validate_args(megatron_lm_arguments, monkeypatch, flags, message):
    from ascendspeed.features import FeatureArgumentError

    monkeypatch.setenv("WORLD_SIZE", "2")  # read by parse_args; validate_args starts no process group
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *TINY_GPT, "--global-batch-size", "4",
                                      "--context-parallel-size", "2", *flags])
    args = megatron_lm_arguments.parse_args()
    with pytest.raises(FeatureArgumentError, match=re.escape(message)):
        megatron_lm_arguments.validate_args(args, {})


def test_alibi_is_a_choice_of_megatron_lm_flag(megatron_lm_arguments):
    parser = megatron_lm_arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    assert parser.parse_args(["--position-embedding-type", "alibi"]).position_embedding_type == "alibi"


#: Mixture of experts: top-2 of 4 experts with the load-balancing loss, Megatron's default experts (a bias on
#: every linear, gelu with the bias-gelu fusion).
MOE = ["--global-batch-size", "8", "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2"]
#: The wrap of the experts' MLP.forward asks this for every expert call with routing probabilities.
MOE_SCALED_AFTER = "ascendspeed.features.moe.mlp:scaled_after"
#: The gloo shim of the alltoall dispatcher's exchange converts the split sizes here.
GLOO_SPLIT_SIZES = "ascendspeed.accelerator.cpu_megatron_core:_split_sizes"
LOAD_BALANCING = re.compile(r"load_balancing_loss: ([0-9.Ee+-]+)")


def test_moe_megatron_defaults_two_processes_data_parallel(launcher):
    """What failed before ascendspeed ("Only support fusion of swiglu and quick_gelu with per_token_scale"):
    Megatron's defaults (allgather dispatcher, expert parallel 1), 2 data-parallel ranks."""
    _, calls, output = _checked_run(launcher, 2, MOE, "moe", [MOE_SCALED_AFTER])
    # 4 experts x 2 layers x 4 micro-batches per rank per step, when every expert received tokens
    assert all(n > 0 for n in calls.values()), calls
    assert float(LOAD_BALANCING.findall(output)[-1]) > 0, "no load-balancing loss logged"


#: Expert parallel 2 with the alltoall dispatcher: 2 local experts per rank, so the received chunks are regrouped.
ALLTOALL_EP2 = [*MOE, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
#: ascendspeed's permutation operators, reached only through --moe-permute-fusion.
PERMUTE_OPS = ["ascendspeed.ops.moe_permute:permute_tokens", "ascendspeed.ops.moe_permute:unpermute_tokens",
               "ascendspeed.ops.moe_permute:sort_chunks"]


@pytest.fixture(scope="module")
def alltoall_ep2_run(launcher):
    return _checked_run(launcher, 2, ALLTOALL_EP2, "moe", [MOE_SCALED_AFTER, GLOO_SPLIT_SIZES])


def test_moe_alltoall_expert_parallel_two_processes(alltoall_ep2_run):
    """Expert parallel 2 over gloo with the alltoall dispatcher (before: gloo's all_to_all_single refused the
    split sizes)."""
    _, calls, output = alltoall_ep2_run
    assert all(n > 0 for n in calls.values()), calls
    assert float(LOAD_BALANCING.findall(output)[-1]) > 0, "no load-balancing loss logged"


def test_moe_permute_fusion_gives_the_unfused_losses(launcher, alltoall_ep2_run):
    """--moe-permute-fusion without Transformer Engine (before: "fused permutation is not available. Please
    install TE"): ascendspeed's operators permute, regroup and unpermute on every rank, and the losses are
    those of megatron-core's unfused permutation."""
    reference, _, _ = alltoall_ep2_run
    losses, calls, _ = _checked_run(launcher, 2, [*ALLTOALL_EP2, "--moe-permute-fusion"], "moe, moe_permute_fusion",
                                    [GLOO_SPLIT_SIZES, *PERMUTE_OPS])
    assert losses == reference
    for rank in range(2):
        permutes = calls[rank, PERMUTE_OPS[0]]
        # per MoE layer forward: one permute and one unpermute, a regrouping on dispatch and one on combine
        assert permutes > 0 and calls[rank, PERMUTE_OPS[1]] == permutes, calls
        assert calls[rank, PERMUTE_OPS[2]] == 2 * permutes, calls


#: What DeepSeek-V3- and Qwen-style MoE models add to the router and the layer.
MOE_VARIANTS = {
    "sigmoid-expert-bias-group-limited-seq-aux-z-loss-shared-expert": [
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5",
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-z-loss-coeff", "1e-3",
        "--moe-shared-expert-intermediate-size", "64", "--disable-bias-linear",  # Megatron: no bias in shared experts
    ],
    "capacity-factor-drop-and-pad": ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"],
}


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_moe_routing_variants_expert_parallel_two_processes(launcher, variant):
    """Sigmoid scores with an expert bias (aux-loss-free balancing), group-limited routing, the sequence
    auxiliary and z losses and a shared expert; a capacity factor that drops and pads: expert parallel 2,
    alltoall."""
    flags = [*MOE, "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
             *MOE_VARIANTS[variant]]
    _, calls, _ = _checked_run(launcher, 2, flags, "moe", [MOE_SCALED_AFTER, GLOO_SPLIT_SIZES])
    assert all(n > 0 for n in calls.values()), calls


#: MoE with the other parallelisms, the fused permutation on: (flags, the adaptor's report).
MOE_LAYOUTS = {
    "pp2-distopt": (["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"],
                    "moe, moe_permute_fusion"),
    "cp2-alltoall": (["--context-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
                     "context_parallel, moe, moe_permute_fusion"),
    # Megatron: a bias on experts needs expert-TP 1 (TP 2 gives them 2); the experts' SwiGLU on the operator
    "tp2-sp-swiglu": (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--disable-bias-linear",
                       "--moe-token-dispatcher-type", "alltoall", "--swiglu", "--use-fused-swiglu"],
                      "fused_swiglu, local_norm, moe, moe_permute_fusion"),
}


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_with_pipeline_context_and_tensor_parallelism(launcher, layout):
    """MoE layers on PP 2 (distributed optimizer), CP 2 and TP 2 with sequence parallelism: training runs,
    the loss falls, and the permutation operators ran on every rank."""
    flags, report = MOE_LAYOUTS[layout]
    _, calls, _ = _checked_run(launcher, 2, [*MOE, "--moe-permute-fusion", *flags], report, PERMUTE_OPS[:2])
    assert all(n > 0 for n in calls.values()), calls


#: ascendspeed's grouped GEMM, reached only through --moe-grouped-gemm (TE's grouped linears' stand-ins).
GROUPED_LINEAR_OP = "ascendspeed.ops.grouped_linear:grouped_linear"


def test_moe_grouped_gemm_expert_parallel_two_processes(launcher):
    """--moe-grouped-gemm without Transformer Engine (before: "Found no NVIDIA driver" in validate_args's
    compute-capability check): megatron-core's TEGroupedMLP on ascendspeed's grouped linears, expert parallel 2
    with the alltoall dispatcher, fused permutation, and the fused SwiGLU inside the grouped experts (biased:
    Megatron's default, so the bias-dropout fusion is off as TEGroupedMLP requires)."""
    flags = [*ALLTOALL_EP2, "--moe-grouped-gemm", "--transformer-impl", "transformer_engine",
             "--no-bias-dropout-fusion", "--swiglu", "--use-fused-swiglu", "--moe-permute-fusion"]
    _, calls, _ = _checked_run(launcher, 2, flags, "fused_swiglu, moe, moe_permute_fusion",
                               [GROUPED_LINEAR_OP, WEIGHTED_SWIGLU_OP])
    for rank in range(2):
        # per MoE layer forward: one grouped linear per expert linear (2), one weighted SwiGLU for all local
        # experts
        swiglus = calls[rank, WEIGHTED_SWIGLU_OP]
        assert swiglus > 0 and calls[rank, GROUPED_LINEAR_OP] == 2 * swiglus, calls


def test_hybrid_moe_layers(launcher):
    """Megatron-LM's hybrid model with MoE layers (E): its specs build them as grouped experts (TEGroupedMLP),
    here on ascendspeed's grouped linears; expert parallel 2 over gloo with the alltoall dispatcher."""
    script, spec = _hybrid_job()
    if script != "pretrain_hybrid.py":
        pytest.skip("MoE layers (E) in hybrid patterns come with megatron-core 0.18's HybridModel")
    flags = [*MOE, *spec, "*E*E", "--num-layers", "4", "--expert-model-parallel-size", "2",
             "--moe-token-dispatcher-type", "alltoall", "--no-bias-dropout-fusion", "--swiglu", "--use-fused-swiglu"]
    _, calls, _ = _checked_run(launcher, 2, flags, "fused_swiglu, moe", [GROUPED_LINEAR_OP], script)
    assert all(n > 0 for n in calls.values()), calls


@pytest.mark.parametrize("flags, message", [
    (["--moe-grouped-gemm", "--transformer-impl", "local"],
     "--moe-grouped-gemm with --transformer-impl local would not run grouped experts"),
    (["--moe-grouped-gemm", "--transformer-impl", "transformer_engine"],
     "--moe-grouped-gemm: grouped experts (megatron-core's TEGroupedMLP) with biased linear layers cannot use the "
     "bias-dropout fusion: pass --no-bias-dropout-fusion, or --disable-bias-linear"),
    (["--moe-grouped-gemm", "--transformer-impl", "transformer_engine", "--no-bias-dropout-fusion"],
     "fuse the bias into SwiGLU or quick-GeGLU only: pass --no-bias-gelu-fusion (or --swiglu)"),
])
def test_moe_grouped_gemm_combinations_fail_in_validate_args(megatron_lm_arguments, monkeypatch, flags, message):
    from ascendspeed.features import FeatureArgumentError

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *TINY_GPT, *MOE, *flags])
    args = megatron_lm_arguments.parse_args()
    with pytest.raises(FeatureArgumentError, match=re.escape(message)):
        megatron_lm_arguments.validate_args(args, {})


def test_moe_grouped_gemm_without_biases_has_no_bias_activation_fusion_to_refuse(megatron_lm_arguments, monkeypatch):
    """Without biases Megatron-LM's validate_args turns the bias-GeLU fusion off itself, so GeLU or squared-ReLU
    grouped experts (Megatron's hybrid MoE tests) validate; the refusal is for biased experts only."""
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *TINY_GPT, *MOE, "--moe-grouped-gemm", "--transformer-impl",
                                      "transformer_engine", "--disable-bias-linear"])
    args = megatron_lm_arguments.parse_args()
    megatron_lm_arguments.validate_args(args, {})
    assert args.moe_grouped_gemm and not args.bias_gelu_fusion


@pytest.mark.parametrize("flags, message", [
    ([*MOE, "--moe-token-dispatcher-type", "flex"],
     "cannot run --moe-token-dispatcher-type flex: the flex dispatcher's backends, DeepEP and HybridEP, are CUDA-only"),
    (["--use-megatron-fsdp", "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor", "--use-nccl-ub"],
     "cannot run --use-nccl-ub: it registers NCCL user buffers (NCCL's memory pool), and the CPU's collectives are "
     "gloo's. Fix: leave --use-nccl-ub out"),
])
def test_flags_the_cpu_cannot_run_fail_in_validate_args(megatron_lm_arguments, monkeypatch, flags, message):
    """Refused before Megatron-LM's own validation, naming the flag and the alternative."""
    from ascendspeed.accelerator.cpu_megatron_lm import CpuArgumentError

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *TINY_GPT, *flags])
    args = megatron_lm_arguments.parse_args()
    with pytest.raises(CpuArgumentError, match=re.escape(message)):
        megatron_lm_arguments.validate_args(args, {})


def test_bf16_on_a_cpu_without_a_bf16_gemm_is_told_in_validate_args(megatron_lm_arguments, monkeypatch, capsys):
    """Megatron-LM with --bf16 on a CPU whose torch has no bf16 GEMM (no AVX-512), told to keep torch's GEMM
    (ASCENDSPEED_CPU_HALF_GEMM=native), hears so before training."""
    from ascendspeed.accelerator.cpu_features import has_fast_bf16_gemm

    monkeypatch.setenv("ASCENDSPEED_CPU_HALF_GEMM", "native")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *TINY_GPT, "--bf16"])
    args = megatron_lm_arguments.parse_args()
    megatron_lm_arguments.validate_args(args, {})
    told = "--bf16 on a CPU without AVX-512" in capsys.readouterr().err
    assert told == (not has_fast_bf16_gemm())


def test_fused_swiglu_reaches_the_experts(launcher):
    """--swiglu --use-fused-swiglu with MoE (before: refused, as the experts kept Megatron's SwiGLU): every
    expert's activation, scaled by its tokens' routing probabilities, runs the fused operator on both ranks;
    expert parallel 2, alltoall."""
    flags = [*ALLTOALL_EP2, "--swiglu", "--use-fused-swiglu"]  # Megatron's default bias on the experts
    # biased experts scale after fc2 (the moe feature), so they run the plain operator
    _, calls, _ = _checked_run(launcher, 2, flags, "fused_swiglu, moe", [SWIGLU_OP])
    assert all(n > 0 for n in calls.values()), calls
