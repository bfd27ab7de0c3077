"""Process groups, device and seeds for a run, and their teardown.

Works under ``torchrun`` (which sets RANK, WORLD_SIZE, MASTER_ADDR, ...) and inside an already
initialised ``torch.distributed`` (tests, notebooks); only what this module set up is torn down.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import random

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from ascendspeed import accelerator


def select_device(name: str) -> torch.device:
    """The torch device of this rank: the CPU, or the accelerator at LOCAL_RANK (made current first)."""
    if name != "cpu":
        getattr(torch, name).set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return accelerator.current_device()


@dataclasses.dataclass
class ParallelState:
    """What a run set up, so that ``teardown`` undoes exactly that."""

    device: torch.device
    owns_process_group: bool
    owns_model_parallel: bool


def initialize_parallel(args: argparse.Namespace) -> ParallelState:
    """Join the process group (unless already joined), initialise model parallelism and seed every RNG."""
    device = select_device(args.device)
    owns_process_group = not dist.is_initialized()
    if owns_process_group:
        dist.init_process_group(
            backend=args.distributed_backend,
            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes),
        )
    owns_model_parallel = not parallel_state.model_parallel_is_initialized()
    if owns_model_parallel:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
        )
    set_seed(args.seed)
    return ParallelState(device, owns_process_group, owns_model_parallel)


def set_seed(seed: int) -> None:
    """Megatron-LM's seeding: one seed per pipeline stage; tensor-parallel ranks get their own dropout
    stream through megatron's RNG tracker, data-parallel replicas share everything (identical weights)."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def teardown(state: ParallelState) -> None:
    if state.owns_model_parallel:
        parallel_state.destroy_model_parallel()
    if state.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
