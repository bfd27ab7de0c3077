"""accelerator.cpu_checkpoint_worker: megatron-core's persistent checkpoint worker (a spawned process) on the CPU.

Before, the worker died on ``torch.cuda.set_device(rank % torch.cuda.device_count())`` and the training rank
waited for it forever; the save is checked against a synchronous save of the same state, read back.
"""
import inspect

import torch

from tests.helpers import megatron as mu  # installs ascendspeed (CPU shims) before megatron is used
from megatron.core.dist_checkpointing import ShardedTensor, load, save
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, PersistentAsyncCaller

from ascendspeed.accelerator import cpu_checkpoint_worker


def test_the_spawned_worker_is_started_through_ascendspeed():
    assert PersistentAsyncCaller.async_loop is cpu_checkpoint_worker.async_loop_with_ascendspeed


def test_persistent_worker_saves_what_a_synchronous_save_saves(tmp_path):
    state = {"weight": torch.randn(4, 8, dtype=torch.float64), "bias": torch.randn(3, 5).to(torch.bfloat16)}

    def sharded():
        return {name: ShardedTensor.from_rank_offsets(name, tensor.clone(), replica_id=0)
                for name, tensor in state.items()}

    with mu.one_process_world():
        for folder in ("async", "sync"):
            (tmp_path / folder).mkdir()
        # megatron-core's own strategy; from 0.19 ``save`` defaults to nvidia-resiliency-ext's
        strategy = {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(save).parameters else {}
        calls = AsyncCallsQueue(persistent=True)
        try:
            calls.schedule_async_request(save(sharded(), str(tmp_path / "async"), async_sharded_save=True, **strategy))
            save(sharded(), str(tmp_path / "sync"))
            calls.maybe_finalize_async_calls(blocking=True)
        finally:
            calls.close()
        saved_async = load(sharded(), str(tmp_path / "async"))
        saved_sync = load(sharded(), str(tmp_path / "sync"))
    for name, tensor in state.items():
        assert torch.equal(saved_async[name], tensor) and torch.equal(saved_sync[name], tensor), name
