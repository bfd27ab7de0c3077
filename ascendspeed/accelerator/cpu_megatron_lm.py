"""What Megatron-LM's training package (``megatron/training``, ``pretrain_gpt.py``) needs on the CPU.

These wait for their modules to load, so megatron-core-only users never import Megatron-LM:

* ``initialize_megatron`` asserts ``torch.cuda.is_available()`` unless ``allow_no_cuda``: it is passed;
* ``_initialize_distributed`` and ``_set_random_seed`` skip ``initialize_model_parallel`` and the
  model-parallel RNG seeding when ``torch.cuda.device_count()`` is 0, leaving Megatron half initialised
  without an error. During those two calls (only) the count is 1: the CPU is the one device;
* ``megatron.legacy.fused_kernels.load`` runs ``nvcc``; there are no CUDA kernels to build for the CPU;
* ``get_device_arch_version`` (validated with tensor parallelism) asks for CUDA device 0's properties: the
  CPU has no CUDA architecture, so it is 0, and validation's demand for ``CUDA_DEVICE_MAX_CONNECTIONS=1``
  (it orders CUDA kernel launches, meaningless here) is met for the duration of ``validate_args``;
* the parser's defaults become the CPU-capable ones (``CPU_ARGUMENT_DEFAULTS``): an explicit flag still
  wins, and ``validate_args`` then rejects the CPU-incapable values with the flag to use instead.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch

from ascendspeed.patching import wrap, replace

INITIALIZE = "megatron.training.initialize"
ARGUMENTS = "megatron.training.arguments"

logger = logging.getLogger(__name__)

#: Megatron-LM flags whose defaults need a GPU, with the CPU-capable default and the flag that selects it.
CPU_ARGUMENT_DEFAULTS = {
    "transformer_impl": ("local", "--transformer-impl local"),
    "gradient_accumulation_fusion": (False, "--no-gradient-accumulation-fusion"),
    "no_persist_layer_norm": (True, "--no-persist-layer-norm"),
    "apply_rope_fusion": (False, "--no-rope-fusion"),
    "masked_softmax_fusion": (False, "--no-masked-softmax-fusion"),
    "distributed_backend": ("gloo", "--distributed-backend gloo"),
}


class CpuArgumentError(ValueError):
    """A Megatron-LM flag asks for something the CPU cannot do; the message names the flag to use."""


def _wrap_initialize_megatron(original):
    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    return initialize_megatron


@contextlib.contextmanager
def _the_cpu_counts_as_one_device():
    counted = torch.cuda.device_count
    torch.cuda.device_count = lambda: 1
    try:
        yield
    finally:
        torch.cuda.device_count = counted


def _wrap_counting_the_cpu(original):
    @functools.wraps(original)
    def counting_the_cpu(*args, **kwargs):
        with _the_cpu_counts_as_one_device():
            return original(*args, **kwargs)

    return counting_the_cpu


def load_no_fused_kernels(args) -> None:
    """Megatron-LM's legacy fused kernels are CUDA sources; the CPU runs the unfused paths."""


def cpu_device_arch_version() -> int:
    """The CPU has no CUDA architecture."""
    return 0


def _wrap_add_megatron_arguments(original):
    @functools.wraps(original)
    def add_megatron_arguments(parser):
        parser = original(parser)
        parser.set_defaults(**{dest: value for dest, (value, _) in CPU_ARGUMENT_DEFAULTS.items()})
        return parser

    return add_megatron_arguments


def check_cpu_arguments(args) -> None:
    """Reject explicit flags the CPU cannot honour, naming the flag to use instead."""
    wrong = [
        (dest, getattr(args, dest), flag)
        for dest, (value, flag) in CPU_ARGUMENT_DEFAULTS.items()
        if hasattr(args, dest) and getattr(args, dest) != value
    ]
    if wrong:
        found = ", ".join(f"{dest}={current!r}" for dest, current, _ in wrong)
        fix = " ".join(flag for _, _, flag in wrong)
        raise CpuArgumentError(
            f"ascendspeed runs Megatron-LM on the CPU (no GPU found, or ASCENDSPEED_DEVICE=cpu), which cannot "
            f"use {found}: pass {fix} (or leave those flags out: these are the CPU defaults)"
        )


@contextlib.contextmanager
def _cuda_device_max_connections_is_one():
    name = "CUDA_DEVICE_MAX_CONNECTIONS"
    before = os.environ.get(name)
    os.environ[name] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def _wrap_validate_args(original):
    @functools.wraps(original)
    def validate_args(args, defaults={}):  # noqa: B006 - mirrors Megatron-LM's signature
        check_cpu_arguments(args)
        with _cuda_device_max_connections_is_one():
            return original(args, defaults)

    return validate_args


def patches():
    return [
        wrap(f"{INITIALIZE}:initialize_megatron", _wrap_initialize_megatron,
             expect="(extra_args_provider=None, args_defaults={}, ignore_unknown_args=False, allow_no_cuda=False, "
                    "skip_mpu_initialization=False, get_embedding_ranks=None, get_position_embedding_ranks=None, "
                    "parsed_args=None, store=None)",
             name="megatron-lm on cpu: initialize without CUDA"),
        wrap(f"{INITIALIZE}:_initialize_distributed", _wrap_counting_the_cpu,
             expect="(get_embedding_ranks, get_position_embedding_ranks, store)",
             name="megatron-lm on cpu: count the CPU so model parallelism is initialised"),
        wrap(f"{INITIALIZE}:_set_random_seed", _wrap_counting_the_cpu,
             expect="(seed_: int, data_parallel_random_init: bool = False, te_rng_tracker: bool = False, "
                    "inference_rng_tracker: bool = False, use_cudagraphable_rng: bool = False)",
             name="megatron-lm on cpu: count the CPU so the model-parallel RNG is seeded"),
        replace("megatron.legacy.fused_kernels:load", load_no_fused_kernels, expect="(args)",
                name="megatron-lm on cpu: no CUDA fused kernels to build"),
        replace("megatron.training.utils:get_device_arch_version", cpu_device_arch_version, expect="()",
                name="megatron-lm on cpu: no CUDA architecture"),
        wrap(f"{ARGUMENTS}:add_megatron_arguments", _wrap_add_megatron_arguments,
             expect="(parser: argparse.ArgumentParser)", name="megatron-lm on cpu: CPU-capable flag defaults"),
        wrap(f"{ARGUMENTS}:validate_args", _wrap_validate_args, expect="(args, defaults={})",
             name="megatron-lm on cpu: reject GPU-only flags, naming the CPU flag"),
    ]
