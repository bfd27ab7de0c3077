"""The tests run Megatron on the CPU with ascendspeed installed, as ``import ascendspeed.megatron_adaptor``
would do at the top of a training script."""
import os

import pytest

os.environ.setdefault("ASCENDSPEED_DEVICE", "cpu")
# Megatron compiles its bias-GELU, bias-SwiGLU and bias-dropout-add fusions with torch.compile in every new
# process: 4-16 s per process on 2 cores, more than most test bodies. The suite runs them eagerly; the
# real-torchrun training runs of Megatron-LM (tests/accelerator/test_megatron_lm_on_cpu.py) and of the entry
# (tests/training/test_pretrain_gpt.py) keep torch.compile (``tests.helpers.compiled.with_torch_compile``),
# so the compiled path still runs on every release CI tests.
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")


def pytest_configure(config):
    from ascendspeed.adaptor import install

    install()


def pytest_runtest_setup(item):
    """``megatron_lm`` tests need a Megatron-LM tree (tests/helpers/megatron_lm.py): skip without one, or
    fail where ``ASCENDSPEED_REQUIRE_MEGATRON_LM=1`` says the run must include them."""
    if item.get_closest_marker("megatron_lm") is None:
        return
    from tests.helpers import megatron_lm

    reason = megatron_lm.unusable_reason()
    if reason is None:
        return
    if os.environ.get(megatron_lm.REQUIRE_VARIABLE) == "1":
        pytest.fail(f"{reason} ({megatron_lm.REQUIRE_VARIABLE}=1: Megatron-LM tests must run)", pytrace=False)
    pytest.skip(reason)
