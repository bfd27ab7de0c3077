"""Megatron-LM's ``pretrain_gpt.py`` on 2 CPU ranks resumes from its own checkpoints on the exact loss curve,
data-parallel and in each model-parallel layout 2 ranks allow (TP with SP, PP, CP).

Each test saves at iteration 3 (``--exit-interval 3``), resumes to iteration 6 and compares every resumed
iteration's ``lm loss`` with one uninterrupted 6-iteration run of its family (the run is shared by the
tests whose training is the same: the checkpoint format does not change the training, nor does the
distributed optimizer on 2 ranks in fp32 (measured: the same losses to the printed digit), nor
``--reuse-fp32-param``, whose bf16 training is bit-identical to megatron-core's). The model is the issue's:
ALiBi and the fused SwiGLU, Megatron-LM's default dropout (0.1 on the attention probabilities and the hidden
states), Adam. Before the fixes of ``ascendspeed/accelerator/torch_adam_checkpoints.py`` every
distributed-optimizer resume failed (``torch`` format: in-place copy into a leaf view in fp32,
``KeyError: 'step'`` in bf16; ``torch_dist``: ``assert len(steps) == 1``), and without the distributed
optimizer the resumed dropout masks were one random draw off (``cpu_megatron_lm``: the data loaders' seed).

From megatron-core 0.16 Megatron-LM logs a process's first iteration without resetting its running sums
(``training_log(is_first_iteration=True)``), so with ``--log-interval 1`` the second iteration of a process
prints the mean of its first two: the resumed run's iteration 4 + 1 is compared with that mean of the
uninterrupted run's iterations 4 and 5 (to 1e-6: three printed values of 7 significant digits).
"""
import functools
import os
import re

import pytest

from ascendspeed.patching import release
from tests.helpers.megatron_lm import MEGATRON_LM_PATH, installed_megatron_core
from tests.helpers.megatron_lm_jobs import run_job

pytestmark = pytest.mark.megatron_lm

LAUNCHER = '''\
import ascendspeed.megatron_adaptor  # first: device selection, CPU shims, Megatron-LM hooks
import os
import runpy
import sys

sys.path.append(os.environ["MEGATRON_LM_PATH"])
sys.argv[0] = os.path.join(os.environ["MEGATRON_LM_PATH"], "pretrain_gpt.py")
runpy.run_path(sys.argv[0], run_name="__main__")
'''
SAVE_AT, ITERATIONS = 3, 6
TINY_GPT = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERATIONS),
    "--lr", "2e-3", "--lr-decay-style", "constant",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234",
    "--position-embedding-type", "alibi", "--swiglu", "--use-fused-swiglu",
    "--attention-dropout", "0.1", "--hidden-dropout", "0.1",
]
#: Across layouts: no dropout (each layout draws other masks), and one padded vocabulary: Megatron pads it to a
#: multiple of --make-vocab-size-divisible-by x TP (by default 128 rows at TP 1 but 256 at TP 2). The null
#: tokenizer has --vocab-size tokens from 0.16 on and one more (its end of document) before: 127 pads to 128
#: on both releases at both layouts (the later flag wins).
NO_DROPOUT = ["--use-distributed-optimizer", "--attention-dropout", "0", "--hidden-dropout", "0",
              "--make-vocab-size-divisible-by", "64", "--vocab-size", "127"]
#: The configurations whose training is the same (their losses are shared), by name. Each model-parallel
#: layout trains differently (its reductions, and the dropout streams of the model-parallel RNG tracker).
FAMILIES = {
    "fp32": [],
    "bf16-distopt": ["--use-distributed-optimizer", "--bf16"],
    "tp2-sp": ["--use-distributed-optimizer", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--use-distributed-optimizer", "--pipeline-model-parallel-size", "2"],
    # attention dropout by position: the seed of each layer's masks is drawn again from the restored RNG
    "cp2": ["--use-distributed-optimizer", "--context-parallel-size", "2"],
    # mixture of experts: 4 experts over 2 expert-parallel ranks (each rank saves its own), alltoall with the
    # fused permutation, top-2 routing with the load-balancing loss
    "ep2-moe": ["--use-distributed-optimizer", "--num-experts", "4", "--moe-router-topk", "2",
                "--moe-aux-loss-coeff", "1e-2", "--expert-model-parallel-size", "2",
                "--moe-token-dispatcher-type", "alltoall", "--moe-permute-fusion"],
    # on 4 ranks: MoE layers on the second pipeline stage only (as DeepSeek's first dense layers under PP), over 2
    # expert-parallel ranks: megatron-core gives the first stage an expert optimizer without parameters
    "pp2-ep2-moe-dense-first": ["--use-distributed-optimizer", "--pipeline-model-parallel-size", "2",
                                "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
                                "--moe-layer-freq", "[0,1]"],
    # Megatron-FSDP, fully sharded, in its own format (its sharded optimizer state checkpointed per parameter)
    "bf16-megatron-fsdp": ["--use-distributed-optimizer", "--bf16", "--use-megatron-fsdp",
                           "--data-parallel-sharding-strategy", "optim_grads_params", "--ckpt-format", "fsdp_dtensor"],
    "dp2-no-dropout": NO_DROPOUT,
    "tp2-no-dropout": [*NO_DROPOUT, "--tensor-model-parallel-size", "2"],
    "pp2-no-dropout": [*NO_DROPOUT, "--pipeline-model-parallel-size", "2"],
    # fp16 with the loss scaler's state (from 1024: Megatron's 2**32 skips every step of a model this small),
    # two virtual stages per rank, gradients reduced bucket by bucket in backward
    "fp16-vpp-overlap": ["--use-distributed-optimizer", "--fp16", "--initial-loss-scale", "1024",
                         "--pipeline-model-parallel-size", "2", "--num-layers", "4",
                         "--num-layers-per-virtual-pipeline-stage", "1", "--overlap-grad-reduce"],
}
#: The processes of a family's runs where not 2.
PROCESSES = {"pp2-ep2-moe-dense-first": 4}
#: Across layouts the reductions differ (a tensor-parallel all-reduce against one GEMM): the entry's layout
#: tests allow the same.
ACROSS_LAYOUTS_TOLERANCE = 2e-5
#: Megatron-LM saves the distributed optimizer's state reshardable across TP / PP only when told so (on 0.19
#: the default is "dp_reshardable": "(TP, PP) mismatch after resume ... not supported for DistributedOptimizer").
RESHARDABLE = ["--dist-ckpt-optim-fully-reshardable"]
#: Whether Megatron-LM's log of a process's second iteration is the mean of its first two (see above).
SECOND_ITERATION_IS_A_MEAN = release(installed_megatron_core() or "0") >= release("0.16")
#: The printed losses have 7 significant digits: a mean of two printed values is compared to this.
PRINTED_MEAN_TOLERANCE = 1e-6
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.Ee+-]+)")


def _launcher(tmp_root) -> str:
    path = os.path.join(tmp_root, "pretrain_gpt_cpu.py")
    if not os.path.exists(path):
        with open(path, "w") as handle:
            handle.write(LAUNCHER)
    return path


def _train(launcher, flags, processes=2):
    environment = {**os.environ, "ASCENDSPEED_DEVICE": "cpu", "MEGATRON_LM_PATH": MEGATRON_LM_PATH,
                   "OMP_NUM_THREADS": "1"}
    environment.pop("MAKEFLAGS", None)
    returncode, output = run_job(launcher, processes, [*TINY_GPT, *flags], env=environment,
                                 cwd=os.path.dirname(launcher), timeout=600)
    assert returncode == 0, f"Megatron-LM failed (exit {returncode}):\n{output[-6000:]}"
    return {int(step): float(loss) for step, loss in LOSS.findall(output)}, output


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    return _launcher(str(tmp_path_factory.mktemp("megatron_lm_resume")))


@functools.cache
def _uninterrupted(launcher, family):
    losses, _ = _train(launcher, FAMILIES[family], PROCESSES.get(family, 2))
    assert sorted(losses) == list(range(1, ITERATIONS + 1)), losses
    return losses


def _resumed(launcher, checkpoints, flags, resume_flags=None, processes=2):
    """Train to ``SAVE_AT``, save and exit; then load (with ``resume_flags``, default the same flags) and train
    to ``ITERATIONS``: the saving run's losses, the resumed losses and the saving run's output."""
    saved, saving_output = _train(launcher, [*flags, "--save", checkpoints, "--save-interval", str(SAVE_AT),
                                             "--exit-interval", str(SAVE_AT)], processes)
    assert sorted(saved) == list(range(1, SAVE_AT + 1)), saved
    resumed, output = _train(launcher, [*(flags if resume_flags is None else resume_flags), "--load", checkpoints],
                             processes)
    assert sorted(resumed) == list(range(SAVE_AT + 1, ITERATIONS + 1)), f"{resumed}\n{output[-3000:]}"
    return saved, resumed, saving_output


def _check(launcher, tmp_path, family, extra, tolerance, resume_in=None):
    """Save at ``SAVE_AT``, resume (in family ``resume_in``'s layout, default the same): every resumed
    iteration's loss is the uninterrupted run's, to ``tolerance`` relative (0: equal as printed). Returns the
    saving run's output."""
    reference = _uninterrupted(launcher, family)
    resume_flags = None if resume_in is None else [*FAMILIES[resume_in], *extra]
    saved, resumed, saving_output = _resumed(launcher, str(tmp_path / "checkpoints"), [*FAMILIES[family], *extra],
                                             resume_flags, PROCESSES.get(family, 2))
    assert saved == {step: reference[step] for step in saved}, (saved, reference)
    expected = {step: (reference[step], tolerance) for step in resumed}
    if SECOND_ITERATION_IS_A_MEAN:
        first = SAVE_AT + 1
        expected[first + 1] = ((reference[first] + reference[first + 1]) / 2, max(tolerance, PRINTED_MEAN_TOLERANCE))
    for step, loss in resumed.items():
        value, rel = expected[step]
        assert loss == pytest.approx(value, rel=rel, abs=0), (step, resumed, reference)
    return saving_output


def test_distributed_optimizer_torch_format_fp32(launcher, tmp_path):
    _check(launcher, tmp_path, "fp32", ["--use-distributed-optimizer", "--ckpt-format", "torch"], 1e-6)


#: Megatron-LM's asynchronous save: its persistent checkpoint worker, a spawned process (started through
#: ascendspeed on the CPU, ``accelerator/cpu_checkpoint_worker.py``), writes the checkpoint while training goes
#: on. From 0.17 Megatron-LM's default strategy is nvidia-resiliency-ext's (not installed here);
#: ``--async-strategy mcore`` selects megatron-core's own.
ASYNC_SAVE = ["--use-distributed-optimizer", "--ckpt-format", "torch_dist", "--async-save",
              "--use-persistent-ckpt-worker",
              *(["--async-strategy", "mcore"] if release(installed_megatron_core() or "0") >= release("0.17") else [])]


def test_an_asynchronous_save_through_the_persistent_worker_resumes(launcher, tmp_path):
    output = _check(launcher, tmp_path, "fp32", ASYNC_SAVE, 1e-6)
    assert f"scheduled an async checkpoint save at iteration {SAVE_AT:7d}" in output, output[-3000:]


@pytest.mark.slow  # the torch_dist paths of the bf16 test below and the fp32 state of the one above
def test_distributed_optimizer_torch_dist_fp32(launcher, tmp_path):
    _check(launcher, tmp_path, "fp32", ["--use-distributed-optimizer", "--ckpt-format", "torch_dist"], 1e-6)


@pytest.mark.slow  # the torch-format path of the fp32 test; bf16 as in the test below
def test_distributed_optimizer_torch_format_bf16(launcher, tmp_path):
    _check(launcher, tmp_path, "bf16-distopt", ["--ckpt-format", "torch"], 0)


def test_distributed_optimizer_torch_dist_bf16_reuse_fp32_param(launcher, tmp_path):
    _check(launcher, tmp_path, "bf16-distopt", ["--ckpt-format", "torch_dist", "--reuse-fp32-param"], 0)


def test_dropout_without_distributed_optimizer(launcher, tmp_path):
    """Megatron-LM's default format and data-parallel DDP: the hidden-dropout masks draw from the CPU generator."""
    _check(launcher, tmp_path, "fp32", ["--ckpt-format", "torch_dist"], 1e-6)


@pytest.mark.parametrize("layout", ["tp2-sp", "pp2", "cp2", "ep2-moe", "fp16-vpp-overlap"])
def test_model_parallel_layouts_resume_in_megatron_lm_s_default_format(launcher, tmp_path, layout):
    """TP 2 with sequence parallelism (hidden dropout from the model-parallel RNG tracker), PP 2 (each stage
    saves its own layers), CP 2, EP 2 (MoE), and fp16 with virtual pipeline stages and ``--overlap-grad-reduce``,
    with the distributed optimizer, in ``torch_dist``."""
    _check(launcher, tmp_path, layout, ["--ckpt-format", "torch_dist"], 1e-6)


@pytest.mark.skipif(release(installed_megatron_core() or "0") < release("0.19"),
                    reason="megatron-core 0.15's fsdp_dtensor save asserts that the optimizer's main parameters are "
                           "model parameters (DistributedOptimizer._param_name), on any device")
def test_megatron_fsdp_resumes_in_fsdp_dtensor(launcher, tmp_path):
    """Megatron-FSDP leaves a parameter's gradient None on a rank whose shard of it is empty, so torch's Adam made
    no state there; the save, which runs collectives per state, waited for good on the other rank (feature
    ``accelerator.torch_adam`` gives each parameter its state for the save). bf16: Megatron-LM's fp32 save of
    SwiGLU's fc1 looks its parameter up one ``module.`` too deep (on any device)."""
    _check(launcher, tmp_path, "bf16-megatron-fsdp", [], 0)


def test_an_expert_optimizer_without_parameters_resumes_at_its_chain_s_step(launcher, tmp_path):
    """The first stage's expert optimizer holds no parameter (``--moe-layer-freq [0,1]``, PP 2 x EP 2): saving
    stopped on megatron-core's torch-Adam ``assert len(steps) == 1`` while the other stage waited. In the
    reshardable format the optimizers' parameter groups are common state that rank 0 writes, so the second
    stage's experts resume at the step rank 0's empty optimizer reports: the chain's (feature
    ``accelerator.torch_adam``), else Adam's bias correction restarts and the resumed losses leave the curve."""
    _check(launcher, tmp_path, "pp2-ep2-moe-dense-first", ["--ckpt-format", "torch_dist", *RESHARDABLE], 1e-6)


@pytest.mark.parametrize("saved_in, resumed_in", [("tp2-no-dropout", "dp2-no-dropout"),
                                                  ("dp2-no-dropout", "tp2-no-dropout"),
                                                  ("pp2-no-dropout", "dp2-no-dropout")])
def test_a_checkpoint_resumes_in_another_layout(launcher, tmp_path, saved_in, resumed_in):
    """``torch_dist`` reshards (the distributed optimizer's state included): saved at TP 2 and resumed at DP 2,
    or the reverse, or saved at PP 2 and resumed at DP 2, the run goes on as the saving layout would have. PP 2
    gives the tied embedding a grad-buffer bucket of its own: without feature
    ``accelerator.model_space_checkpoints`` megatron-core stores the wrong main weights and moments for it (the
    first resumed loss 3e-4 to 9e-4 off)."""
    _check(launcher, tmp_path, saved_in, ["--ckpt-format", "torch_dist", *RESHARDABLE], ACROSS_LAYOUTS_TOLERANCE,
           resume_in=resumed_in)


# -- the pretraining entry's checkpoints and Megatron-LM's: one format ------------------------------------
#: The entry's run (its own data); Megatron-LM trains nothing in between, so its data does not matter.
ENTRY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "2e-3", "--min-lr", "0",
         "--lr-decay-style", "constant", "--lr-warmup-iters", "0", "--use-distributed-optimizer",
         "--eval-iters", "1", "--eval-interval", "0", "--log-interval", "100", "--eval-seq-lengths", "32",
         "--split", "998,2"]
#: The entry's byte vocabulary pads to 256 rows; Megatron-LM's null tokenizer has --vocab-size tokens from
#: megatron-core 0.16 on and one more before (its end of document): 255 pads to 256 on both.
NULL_TOKENIZER_VOCABULARY = "255"


def _entry_worker(rank, world_size, flags):
    from ascendspeed.training.arguments import parse_args
    from ascendspeed.training.trainer import train

    return train(parse_args([*ENTRY, *flags], world_size=world_size)).losses


def _megatron_lm_model_flags(record: dict) -> list[str]:
    """Megatron-LM's flags for the model a checkpoint record of the entry describes (the same names)."""
    flags = []
    for flag, value in record["architecture"].items():
        if not flag.startswith("--") or value is None or value is False:
            continue
        if flag == "--num-query-groups":
            if value != record["architecture"]["--num-attention-heads"]:
                flags += ["--group-query-attention", flag, str(value)]
        elif value is True:
            flags.append(flag)
        else:
            flags += [flag, str(value)]
    return flags


def _bit_identical(first, second) -> bool:
    import torch

    return first.dtype == second.dtype and torch.equal(first, second)


def test_the_entry_s_checkpoint_loads_in_megatron_lm_and_back(launcher, tmp_path):
    """The entry saves at iteration 3; Megatron-LM's ``pretrain_gpt.py`` loads it and saves it again without
    training (every stored tensor comes back bit for bit: the model, the distributed optimizer's main
    weights and moments); the entry resumes from Megatron-LM's checkpoint and its iteration 4 is its
    uninterrupted run's."""
    import json

    from tests.helpers.checkpoints import stored_tensors
    from tests.helpers.distributed import run_distributed

    entry_checkpoint, megatron_checkpoint = tmp_path / "entry", tmp_path / "megatron_lm"
    straight = run_distributed(_entry_worker, 2, ["--train-iters", "4"], timeout=300)[0]
    run_distributed(_entry_worker, 2, ["--train-iters", "3", "--save", str(entry_checkpoint)], timeout=300)
    saved = entry_checkpoint / "iter_0000003"
    record = json.loads((saved / "ascendspeed_record.json").read_text())
    environment = {**os.environ, "ASCENDSPEED_DEVICE": "cpu", "MEGATRON_LM_PATH": MEGATRON_LM_PATH,
                   "OMP_NUM_THREADS": "1"}
    environment.pop("MAKEFLAGS", None)
    megatron_lm = [
        *_megatron_lm_model_flags(record), "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3", "--lr", "2e-3",
        "--lr-decay-style", "constant", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", NULL_TOKENIZER_VOCABULARY, "--eval-iters", "0", "--eval-interval", "1000",
        "--use-distributed-optimizer", "--ckpt-format", "torch_dist", *RESHARDABLE,
        "--load", str(entry_checkpoint), "--save", str(megatron_checkpoint), "--save-interval", "1000",
        "--override-opt_param-scheduler",
    ]
    returncode, output = run_job(launcher, 2, megatron_lm, env=environment, cwd=os.path.dirname(launcher),
                                 timeout=600)
    assert returncode == 0, f"Megatron-LM failed (exit {returncode}):\n{output[-6000:]}"
    assert (megatron_checkpoint / "latest_checkpointed_iteration.txt").read_text().strip() == "3", output[-3000:]
    ours, theirs = stored_tensors(saved), stored_tensors(megatron_checkpoint / "iter_0000003")
    assert set(ours) == set(theirs)
    assert any(key.startswith("optimizer.state.param.") for key in ours)
    assert [key for key in ours if not _bit_identical(ours[key], theirs[key])] == []
    resumed = run_distributed(_entry_worker, 2, ["--train-iters", "4", "--load", str(megatron_checkpoint),
                                                 "--override-opt_param-scheduler"], timeout=300)[0]
    assert resumed == pytest.approx(straight[3:], rel=1e-6, abs=0)
