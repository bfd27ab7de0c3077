"""Imported once by the forkserver that ``tests.helpers.distributed`` forks ranks from: what every rank
would otherwise import itself, in the order a training script does (the adaptor before Megatron)."""
import os

os.environ.setdefault("ASCENDSPEED_DEVICE", "cpu")

from ascendspeed.adaptor import install  # noqa: E402

install()

import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import megatron.core.pipeline_parallel  # noqa: E402,F401

import tests.helpers.megatron  # noqa: E402,F401
