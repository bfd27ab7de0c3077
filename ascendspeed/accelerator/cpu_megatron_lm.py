"""What Megatron-LM's training package (``megatron/training``, ``pretrain_gpt.py``) needs on the CPU.

These wait for their modules to load, so megatron-core-only users never import Megatron-LM:

* ``initialize_megatron`` asserts ``torch.cuda.is_available()`` unless ``allow_no_cuda``: it is passed;
* ``_initialize_distributed`` and ``_set_random_seed`` skip ``initialize_model_parallel`` and the
  model-parallel RNG seeding when ``torch.cuda.device_count()`` is 0: ``cpu_runtime`` counts the CPU as
  the one device;
* ``megatron.legacy.fused_kernels.load`` runs ``nvcc``; there are no CUDA kernels to build for the CPU;
* ``get_device_arch_version`` (validated with tensor parallelism) asks for CUDA device 0's properties: the
  CPU has no CUDA architecture, so it is 0;
* ``build_train_valid_test_data_iterators`` leaves the CPU generator as it found it. Creating a
  ``DataLoader`` iterator draws its workers' base seed from ``torch.default_generator``. On a GPU that is
  not the generator dropout draws from; on the CPU it is (``torch.cuda.get_rng_state`` is the CPU
  generator's, see ``cpu_runtime``). Megatron-LM restores the RNG states of a checkpoint in
  ``load_checkpoint`` and builds the iterators afterwards, so a resumed run's hidden-dropout masks came one
  draw later than the uninterrupted run's: not the same training (4e-4 relative at the first resumed
  iteration). With the generator kept, both runs draw nothing there.

Megatron-LM's argument handling has one owner, ``ascendspeed.integration.megatron_lm``; on the CPU it
asks this module for the CPU-capable flag defaults (``set_cpu_defaults``), the check of explicit flags
(``check_cpu_arguments``) and the environment ``validate_args`` demands (``validation_environment``).
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys

import torch

from ascendspeed.accelerator.cpu_features import slow_bf16_warning
from ascendspeed.patching import EXISTS, replace, wrap

#: Megatron-LM flags whose defaults need a GPU, with the CPU-capable default and the flag that selects it.
CPU_ARGUMENT_DEFAULTS = {
    "transformer_impl": ("local", "--transformer-impl local"),
    "gradient_accumulation_fusion": (False, "--no-gradient-accumulation-fusion"),
    "no_persist_layer_norm": (True, "--no-persist-layer-norm"),
    "apply_rope_fusion": (False, "--no-rope-fusion"),
    "masked_softmax_fusion": (False, "--no-masked-softmax-fusion"),
    "distributed_backend": ("gloo", "--distributed-backend gloo"),
}

#: Megatron-LM defaults that run on a CPU but cost it, with the CPU default and the flag that selects it; any
#: explicit value is taken as given. Data-loader worker processes (``--num-workers 2``) overlap batch reading with
#: a GPU's step using spare cores; on a CPU the ranks' threads are the compute and take every core, so the workers
#: only take cores from them, and each batch comes back through torch's file-descriptor hand-over (4-5 ms per
#: batch against 0.4 ms read in-process; docs/megatron-lm-on-cpu.md).
CPU_PREFERRED_DEFAULTS = {
    "num_workers": (0, "--num-workers 0"),
}

#: Megatron-LM flags that need CUDA-only code: (dest, value that is refused, the flag, why, the fix), refused
#: before Megatron-LM's own validation. ``--moe-grouped-gemm`` runs on the TE fallback's grouped linears
#: (``te_fallback.grouped_linear``); its CUDA compute-capability check is answered in ``validation_environment``.
CPU_REFUSALS = (
    ("moe_token_dispatcher_type", "flex", "--moe-token-dispatcher-type flex",
     "the flex dispatcher's backends, DeepEP and HybridEP, are CUDA-only",
     "use --moe-token-dispatcher-type alltoall (or allgather)"),
    ("nccl_ub", True, "--use-nccl-ub",
     "it registers NCCL user buffers (NCCL's memory pool), and the CPU's collectives are gloo's",
     "leave --use-nccl-ub out (Megatron-FSDP runs with its ordinary buffers)"),
)


class CpuArgumentError(ValueError):
    """A Megatron-LM flag asks for something the CPU cannot do; the message names the flag to use."""


def _wrap_initialize_megatron(original):
    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    return initialize_megatron


def _wrap_keeping_the_cpu_generator(original):
    @functools.wraps(original)
    def keeping_the_cpu_generator(*args, **kwargs):
        state = torch.default_generator.get_state()
        try:
            return original(*args, **kwargs)
        finally:
            torch.default_generator.set_state(state)

    return keeping_the_cpu_generator


def load_no_fused_kernels(args) -> None:
    """Megatron-LM's legacy fused kernels are CUDA sources; the CPU runs the unfused paths."""


def cpu_device_arch_version() -> int:
    """The CPU has no CUDA architecture."""
    return 0


def set_cpu_defaults(parser) -> None:
    """Megatron-LM's parser defaults become the CPU-capable (and CPU-preferred) ones; an explicit flag still wins."""
    defaults = {**CPU_ARGUMENT_DEFAULTS, **CPU_PREFERRED_DEFAULTS}
    parser.set_defaults(**{dest: value for dest, (value, _) in defaults.items()})


def _served_otherwise(dest: str, value) -> bool:
    """An explicit value other than the CPU default that still runs: ``--transformer-impl transformer_engine``
    where Transformer Engine is absent builds megatron-core's local modules for TE's classes (``te_fallback``)."""
    if dest == "transformer_impl" and value == "transformer_engine":
        from ascendspeed.accelerator import te_fallback

        return te_fallback.needed()
    return False


def check_cpu_arguments(args) -> None:
    """Reject explicit flags the CPU cannot honour, naming the flag to use instead; say (rank 0) where a flag
    works but runs slowly on this CPU."""
    warning = slow_bf16_warning() if getattr(args, "bf16", False) else None
    if warning is not None and getattr(args, "rank", 0) == 0:
        print(warning, file=sys.stderr, flush=True)
    for dest, refused, flag, why, fix in CPU_REFUSALS:
        if getattr(args, dest, None) == refused:
            raise CpuArgumentError(
                f"ascendspeed runs Megatron-LM on the CPU (no GPU found, or ASCENDSPEED_DEVICE=cpu), which cannot "
                f"run {flag}: {why}. Fix: {fix}."
            )
    wrong = [
        (dest, getattr(args, dest), flag)
        for dest, (value, flag) in CPU_ARGUMENT_DEFAULTS.items()
        if hasattr(args, dest) and getattr(args, dest) != value and not _served_otherwise(dest, getattr(args, dest))
    ]
    if wrong:
        found = ", ".join(f"{dest}={current!r}" for dest, current, _ in wrong)
        fix = " ".join(flag for _, _, flag in wrong)
        raise CpuArgumentError(
            f"ascendspeed runs Megatron-LM on the CPU (no GPU found, or ASCENDSPEED_DEVICE=cpu), which cannot "
            f"use {found}: pass {fix} (or leave those flags out: these are the CPU defaults)"
        )


@contextlib.contextmanager
def validation_environment(args):
    """What ``validate_args`` asks of a CUDA device, answered for the CPU for the duration of the validation:

    * ``CUDA_DEVICE_MAX_CONNECTIONS`` (it orders CUDA kernel launches, meaningless on the CPU) is 1, which
      tensor and context parallelism assert, except with torch FSDP2 or Megatron-FSDP, which assert it is not;
    * ``--moe-grouped-gemm`` makes it assert a CUDA compute capability of 8 or more (TE's and the grouped_gemm
      package's kernels need it; before 0.16 also bf16, the legacy kernels' only dtype): the grouped linears
      that serve the flag here are ascendspeed's operators, which need neither, so the flag is lifted while
      Megatron-LM validates and set again after.
    """
    name = "CUDA_DEVICE_MAX_CONNECTIONS"
    before = os.environ.get(name)
    if getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False):
        os.environ.pop(name, None)
    else:
        os.environ[name] = "1"
    grouped_gemm = getattr(args, "moe_grouped_gemm", False)
    args.moe_grouped_gemm = False
    try:
        yield
    finally:
        args.moe_grouped_gemm = grouped_gemm
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def patches():
    initialize = "megatron-lm on cpu: initialize without CUDA"
    arch = "megatron-lm on cpu: no CUDA architecture"
    return [
        wrap("megatron.training.initialize:initialize_megatron", _wrap_initialize_megatron,
             expect="(extra_args_provider=None, args_defaults={}, ignore_unknown_args=False, allow_no_cuda=False, "
                    "skip_mpu_initialization=False, get_embedding_ranks=None, get_position_embedding_ranks=None, "
                    "parsed_args=None, store=None)",
             megatron="<0.18", name=initialize),
        wrap("megatron.training.initialize:initialize_megatron", _wrap_initialize_megatron,
             expect="(allow_no_cuda=False, skip_mpu_initialization=False, get_embedding_ranks=None, "
                    "get_position_embedding_ranks=None, store=None)",
             megatron=">=0.18,<0.19", name=initialize),
        wrap("megatron.training.initialize:initialize_megatron", _wrap_initialize_megatron,
             expect="(allow_no_cuda=False, skip_mpu_initialization=False, get_embedding_ranks=None, "
                    "get_position_embedding_ranks=None, store=None, skip_model_parallel_init=False, "
                    "seed_pp_group=None, seed_dp_group=None, seed_tp_group=None, seed_ep_group=None, "
                    "seed_etp_group=None, skip_random_seed=False)",
             megatron=">=0.19", name=initialize),
        wrap("megatron.training.training:build_train_valid_test_data_iterators", _wrap_keeping_the_cpu_generator,
             expect="(build_train_valid_test_datasets_provider)",
             name="megatron-lm on cpu: wrap build_train_valid_test_data_iterators, the data loaders' seed draws "
                  "leave the CPU generator (dropout's) as the checkpoint restored it"),
        replace("megatron.legacy.fused_kernels:load", load_no_fused_kernels, expect="(args)", megatron="<0.17",
                name="megatron-lm on cpu: no CUDA fused kernels to build"),
        replace("megatron.training.utils:get_device_arch_version", cpu_device_arch_version, expect="()",
                megatron="<0.18", name=arch),
        replace("megatron.training.utils.common_utils:get_device_arch_version", cpu_device_arch_version,
                expect="()", megatron=">=0.18", name=arch),
    ]
