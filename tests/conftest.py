"""The tests run Megatron on the CPU with ascendspeed installed, as ``import ascendspeed.megatron_adaptor``
would do at the top of a training script."""
import os

os.environ.setdefault("ASCENDSPEED_DEVICE", "cpu")


def pytest_configure(config):
    from ascendspeed.adaptor import install

    install()
