"""Device selection at adaptor import: forced and detected choices, errors, logging, listing, reverting."""
import logging

import pytest
import torch

import ascendspeed.megatron_adaptor  # noqa: F401 - installs the accelerator under test
from ascendspeed import accelerator
from ascendspeed.accelerator import cpu_runtime, cpu_tensors
from ascendspeed.patching import MANAGER


def _npu_importable():
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def reinstalled():
    """Leave the accelerator installed as the adaptor installs it, whatever the test reverted."""
    yield
    accelerator.install(MANAGER)


@pytest.mark.parametrize("value", ["cpu", "CPU", " cpu "])
def test_forced_cpu_is_selected(monkeypatch, value):
    monkeypatch.setenv("ASCENDSPEED_DEVICE", value)
    assert accelerator.select_device() == "cpu"


@pytest.mark.parametrize("value", ["gpu", "cuda:0", "tpu"])
def test_unknown_device_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("ASCENDSPEED_DEVICE", value)
    with pytest.raises(accelerator.DeviceSelectionError, match="use one of npu, cuda, cpu"):
        accelerator.select_device()


def test_forced_cuda_without_a_gpu_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("ASCENDSPEED_DEVICE", "cuda")
    with pytest.raises(accelerator.DeviceSelectionError, match="torch sees no CUDA device"):
        accelerator.select_device()


@pytest.mark.skipif(_npu_importable(), reason="torch_npu is installed here")
def test_forced_npu_without_torch_npu_is_an_error(monkeypatch):
    monkeypatch.setenv("ASCENDSPEED_DEVICE", "npu")
    with pytest.raises(accelerator.DeviceSelectionError, match="no NPU is usable"):
        accelerator.select_device()


@pytest.mark.skipif(_npu_importable(), reason="torch_npu is installed here")
def test_detection_falls_back_to_cpu_without_npu_or_cuda(monkeypatch):
    monkeypatch.delenv("ASCENDSPEED_DEVICE", raising=False)
    monkeypatch.setattr(accelerator, "_cuda_present", lambda: False)
    assert accelerator.select_device() == "cpu"


def test_detection_prefers_cuda_over_cpu(monkeypatch):
    monkeypatch.delenv("ASCENDSPEED_DEVICE", raising=False)
    monkeypatch.setattr(accelerator, "_npu_present", lambda: False)
    monkeypatch.setattr(accelerator, "_cuda_present", lambda: True)
    assert accelerator.select_device() == "cuda"


def test_the_choice_is_logged_once(caplog, reinstalled):
    accelerator.uninstall(MANAGER)
    with caplog.at_level(logging.INFO, logger="ascendspeed.accelerator"):
        accelerator.install(MANAGER)
        accelerator.install(MANAGER)
    messages = [r.getMessage() for r in caplog.records if r.name == "ascendspeed.accelerator"]
    assert len(messages) == 1, messages
    assert messages[0].startswith("ascendspeed: running Megatron on cpu (ASCENDSPEED_DEVICE=cpu)")


def test_current_device_is_a_torch_device():
    assert accelerator.device_type() == "cpu"
    assert accelerator.current_device() == torch.device("cpu")


def test_cpu_shims_are_listed_under_the_accelerator_features():
    features = MANAGER.features()
    assert {accelerator.CPU_FEATURE, accelerator.GLOO_P2P_FEATURE} <= features
    targets = {row["target"] for row in MANAGER.report() if row["feature"] == accelerator.CPU_FEATURE}
    assert {"torch.cuda:current_device", "torch:zeros", "torch:Tensor.type"} <= targets


def test_reverting_restores_torch_and_reinstalling_brings_the_shims_back(reinstalled):
    import torch.cuda.random

    assert torch.cuda.current_device is cpu_runtime.current_device
    accelerator.uninstall(MANAGER)
    assert not ({accelerator.CPU_FEATURE, accelerator.GLOO_P2P_FEATURE} & MANAGER.features())
    assert torch.cuda.current_device is not cpu_runtime.current_device
    assert torch.cuda.get_rng_state is torch.cuda.random.get_rng_state
    assert torch.Tensor.cuda is not cpu_tensors.tensor_cuda
    assert "__wrapped__" not in dir(torch.zeros)
    assert type(torch.ones(1).type()) is str
    accelerator.install(MANAGER)
    assert torch.cuda.current_device is cpu_runtime.current_device
    assert torch.zeros(1, device="cuda").device.type == "cpu"


def test_reverting_one_feature_keeps_the_other(reinstalled):
    from megatron.core.pipeline_parallel import p2p_communication

    from ascendspeed.accelerator import cpu_megatron_core

    assert p2p_communication._batched_p2p_ops is cpu_megatron_core.batched_p2p_ops
    MANAGER.revert(accelerator.GLOO_P2P_FEATURE)
    assert p2p_communication._batched_p2p_ops is not cpu_megatron_core.batched_p2p_ops
    assert torch.cuda.current_device is cpu_runtime.current_device
