"""Checkpoint save and load: time, size per parameter, and the write floor, for the pretraining entry's format
(Megatron's distributed checkpoint, ``torch_dist``) on 2 gloo ranks.

Each setting builds the entry's trainer in fresh processes, takes one training step (so the optimizer has its
state), then saves ``--repeats`` times into fresh directories and loads the first of them as many times
(``checkpointing.save_checkpoint`` / ``load_checkpoint``: staging, record, rename and tracker included).
Reported per setting: medians of the save and load wall times (rank 0, between barriers), the checkpoint's
bytes on disk per model parameter, and the write floor: the time for each rank to write the same number of
bytes as one plain file (``numpy.ndarray.tofile``), so ``save / floor`` is what the format costs over the
disk and page cache of this machine. Files are not fsync'ed, in both.

Expected bytes per parameter (fp32 Adam): 4 for the weights and 8 for the moments; the distributed optimizer
also stores its main weights in model space (4 more, ``fully_reshardable``); with ``--bf16`` the weights are 2.

    python bench/checkpoint_io.py --json bench/results/checkpoint_io.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy
import torch
import torch.distributed as dist

import harness
from harness import run_on_gloo_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

MODEL = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "128",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1000", "--eval-interval", "0",
         "--eval-iters", "1", "--eval-seq-lengths", "128", "--lr-warmup-iters", "1", "--train-iters", "10"]

SETTINGS = {
    "fp32, DP 2": [],
    "fp32, DP 2, distributed optimizer": ["--use-distributed-optimizer"],
    "bf16, DP 2, distributed optimizer": ["--use-distributed-optimizer", "--bf16"],
    "fp32, TP 2, distributed optimizer": ["--use-distributed-optimizer", "--tensor-model-parallel-size", "2"],
    "fp32, PP 2, distributed optimizer": ["--use-distributed-optimizer", "--pipeline-model-parallel-size", "2"],
}


def _directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def _timed(action) -> float:
    dist.barrier()
    start = time.perf_counter()
    action()
    dist.barrier()
    return time.perf_counter() - start


def _measure(rank, world_size, flags, repeats, scratch):
    from ascendspeed.adaptor import install
    from ascendspeed.features import apply_features
    from ascendspeed.training import checkpointing
    from ascendspeed.training.arguments import parse_args
    from ascendspeed.training.initialize import initialize_parallel, teardown
    from ascendspeed.training.trainer import Trainer

    install()
    args = parse_args([*MODEL, *flags], world_size=world_size)
    apply_features(args)
    state = initialize_parallel(args)
    try:
        trainer = Trainer(args, state.device)
        trainer.train_step()
        parameters = _unique_parameters(args, trainer)
        saves, loads, sizes = [], [], []
        for repeat in range(repeats):
            args.save = os.path.join(scratch, f"save{repeat}")
            saves.append(_timed(lambda: checkpointing.save_checkpoint(args, 1, trainer.model, trainer.optimizer,
                                                                      trainer.scheduler)))
            if rank == 0:
                sizes.append(_directory_bytes(os.path.join(args.save, "iter_0000001")))
        args.save, args.load = None, os.path.join(scratch, "save0")
        for _ in range(repeats):
            loads.append(_timed(lambda: checkpointing.load_checkpoint(args, trainer.model, trainer.optimizer,
                                                                      trainer.scheduler)))
        size = torch.tensor([sizes[0] if rank == 0 else 0], dtype=torch.float64)
        dist.broadcast(size, 0)
        share = numpy.ones(int(size.item()) // 4 // world_size, dtype=numpy.float32)
        floors = []
        for repeat in range(repeats):
            target = os.path.join(scratch, f"floor{repeat}.rank{rank}")
            floors.append(_timed(lambda: share.tofile(target)))
            os.remove(target)
        trainer.close()
        return {"parameters": parameters, "bytes": int(size.item()), "save_s": statistics.median(saves),
                "load_s": statistics.median(loads), "floor_s": statistics.median(floors),
                "saves_s": saves, "loads_s": loads, "floors_s": floors}
    finally:
        teardown(state)


def _unique_parameters(args, trainer) -> int:
    """The model's parameter count (each tensor-parallel shard counted once, a tied output layer not)."""
    from megatron.core import parallel_state

    from ascendspeed.training.model import unwrap

    local = 0
    for chunk in trainer.model:
        for name, parameter in unwrap(chunk).named_parameters():
            if name.startswith("output_layer") and args.pipeline_model_parallel_size > 1:
                continue  # the last stage's copy of the tied embedding
            shared = not getattr(parameter, "tensor_model_parallel", False)
            local += parameter.numel() // (parallel_state.get_tensor_model_parallel_world_size() if shared else 1)
    count = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(count, group=parallel_state.get_model_parallel_group())
    return int(count.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    options = parser.parse_args()
    machine = harness.machine(torch) | {"python": platform.python_version()}
    results = {}
    print(f"{'setting':<38} {'params':>10} {'B/param':>8} {'save s':>7} {'load s':>7} {'floor s':>8} "
          f"{'save/floor':>10}")
    for name, flags in SETTINGS.items():
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_SCRATCH")) as scratch:
            result = run_on_gloo_ranks(_measure, 2, flags, options.repeats, scratch, scratch=scratch)
        result["bytes_per_parameter"] = result["bytes"] / result["parameters"]
        result["save_over_floor"] = result["save_s"] / result["floor_s"]
        results[name] = result
        print(f"{name:<38} {result['parameters']:>10,} {result['bytes_per_parameter']:>8.2f} "
              f"{result['save_s']:>7.3f} {result['load_s']:>7.3f} {result['floor_s']:>8.3f} "
              f"{result['save_over_floor']:>10.1f}", flush=True)
    machine["load_average_1min_after"] = harness.load_average()
    if options.json:
        with open(options.json, "w") as output:
            json.dump({"machine": machine, "model": MODEL, "repeats": options.repeats, "results": results}, output,
                      indent=1)


if __name__ == "__main__":
    main()
