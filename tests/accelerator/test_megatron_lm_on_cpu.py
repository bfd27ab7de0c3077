"""Megatron-LM's own ``pretrain_gpt.py`` trains on the CPU over gloo with ascendspeed imported first.

Needs a Megatron-LM tree of the installed megatron-core's release (``tests/helpers/megatron_lm.py``) and its
extra packages in the environment (see docs/megatron-lm-on-cpu.md). The runs follow that document's recipe:
a launcher that imports ``ascendspeed.megatron_adaptor`` and then runs the checkout's ``pretrain_gpt.py``,
started by torchrun, with none of the CPU flags given (the CPU defaults supply them).
"""
import argparse
import os
import re
import subprocess
import sys
import sysconfig

import pytest

import ascendspeed
from tests.helpers.compiled import with_torch_compile
from tests.helpers.megatron_lm import MEGATRON_LM_PATH, add_megatron_lm_to_path
from tests.helpers.megatron_lm_jobs import run_job

pytestmark = pytest.mark.megatron_lm

REPOSITORY = os.path.dirname(os.path.abspath(list(ascendspeed.__path__)[0]))
LAUNCHER = '''\
import ascendspeed.megatron_adaptor  # first: device selection, CPU shims, Megatron-LM argument hooks
import os
import runpy
import sys

sys.argv[0] = os.path.join(os.environ["MEGATRON_LM_PATH"], "pretrain_gpt.py")
runpy.run_path(sys.argv[0], run_name="__main__")
'''
TINY_GPT = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--train-iters", "12", "--lr", "2e-3", "--lr-decay-style", "constant",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234",
]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([0-9.Ee+-]+)")


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    path = tmp_path_factory.mktemp("megatron_lm") / "pretrain_gpt_cpu.py"
    path.write_text(LAUNCHER)
    return str(path)


def _environment():
    return {
        **os.environ,
        "ASCENDSPEED_DEVICE": "cpu",
        "MEGATRON_LM_PATH": MEGATRON_LM_PATH,
        "PYTHONPATH": os.pathsep.join(p for p in (REPOSITORY, MEGATRON_LM_PATH, os.environ.get("PYTHONPATH")) if p),
        # Megatron-LM builds its dataset helpers with `make`, naming the library after `python3-config`,
        # which need not be this interpreter: name it after this one.
        "MAKEFLAGS": f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}",
        "OMP_NUM_THREADS": "1",
    }


def _train(launcher, processes, *flags, timeout=420, torchrun=False):
    """Train through the test session's job server, or with ``torchrun`` through real torchrun."""
    if torchrun:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
            launcher, *TINY_GPT, *flags,
        ]
        done = subprocess.run(command, env=with_torch_compile(_environment()), capture_output=True, text=True,
                              timeout=timeout)
        returncode, output = done.returncode, done.stdout + done.stderr
    else:
        returncode, output = run_job(launcher, processes, [*TINY_GPT, *flags], env=_environment(),
                                     cwd=os.getcwd(), timeout=timeout)
    assert returncode == 0, f"Megatron-LM failed (exit {returncode}):\n{output[-6000:]}"
    losses = {int(step): float(loss) for step, loss in LOSS.findall(output)}
    assert len(losses) == 12, f"expected a loss per iteration, got {losses}\n{output[-3000:]}"
    return [losses[step] for step in sorted(losses)]


def _assert_falls(losses):
    assert all(loss == loss for loss in losses), f"NaN loss: {losses}"
    assert sum(losses[-3:]) / 3 < 0.95 * sum(losses[:3]) / 3, f"loss did not fall: {losses}"


def test_pretrain_gpt_one_process(launcher):
    _assert_falls(_train(launcher, 1, "--global-batch-size", "4"))


def test_pretrain_gpt_two_processes_data_parallel(launcher):
    """Through real torchrun: the launcher users start Megatron-LM with."""
    _assert_falls(_train(launcher, 2, "--global-batch-size", "8", "--use-distributed-optimizer", torchrun=True))


def test_pretrain_gpt_two_processes_interleaved_pipeline(launcher):
    """PP 2 + virtual pipeline 2 with tied embeddings: Megatron-LM overlaps p2p and pseudo-frees sent
    activations, the gloo case ``accelerator.cpu.gloo_p2p`` exists for."""
    flags = ["--global-batch-size", "8", "--pipeline-model-parallel-size", "2",
             "--num-layers-per-virtual-pipeline-stage", "1", "--num-layers", "4"]
    _assert_falls(_train(launcher, 2, *flags))


@pytest.fixture(scope="module")
def megatron_lm_arguments():
    add_megatron_lm_to_path()
    import ascendspeed.megatron_adaptor  # noqa: F401
    from megatron.training import arguments

    return arguments


def test_parser_defaults_are_the_cpu_flags(megatron_lm_arguments):
    from ascendspeed.accelerator.cpu_megatron_lm import CPU_ARGUMENT_DEFAULTS, CPU_PREFERRED_DEFAULTS

    parser = megatron_lm_arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args([])
    for dest, (value, _) in {**CPU_ARGUMENT_DEFAULTS, **CPU_PREFERRED_DEFAULTS}.items():
        assert getattr(args, dest) == value, dest
    assert args.num_workers == 0
    explicit = parser.parse_args(["--transformer-impl", "transformer_engine", "--num-workers", "2"])
    assert explicit.transformer_impl == "transformer_engine" and explicit.num_workers == 2


def test_gpu_only_flag_is_rejected_naming_the_cpu_flag(megatron_lm_arguments):
    from ascendspeed.accelerator.cpu_megatron_lm import CpuArgumentError

    parser = megatron_lm_arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    # (--transformer-impl transformer_engine runs where TE is absent: accelerator.te_fallback)
    args = parser.parse_args(["--distributed-backend", "nccl"])
    args.gradient_accumulation_fusion = True   # Megatron-LM's GPU default; it has no flag to switch it on
    with pytest.raises(CpuArgumentError, match="--no-gradient-accumulation-fusion --distributed-backend gloo"):
        megatron_lm_arguments.validate_args(args)
