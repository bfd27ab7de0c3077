"""``--reuse-fp32-param`` benchmark: bytes per parameter and step time, with and without the flag, for
megatron-core's mixed-precision optimizer and its distributed optimizer, 2 data-parallel ranks (gloo).

Memory: each setting trains in fresh processes; the memory account of the pretraining entry
(``ascendspeed.training.memory``, from the tensors' distinct storages) and the peak resident memory of
rank 0 are recorded. Expected: 2 bytes per parameter less with the mixed-precision optimizer, 2/DP
with the distributed optimizer.

Time: the baseline and the reused optimizer are built in the same processes (the baseline before the
patches are applied: megatron-core's own code) and trained step by step in alternation (ABBA), so load
from other work on the machine hits both alike; reported are medians over the steps of the full step
and of ``optimizer.step()`` alone, and their ratios.

    python bench/reuse_fp32_param.py --json bench/results/reuse_fp32_param.json
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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
         "--micro-batch-size", "2", "--global-batch-size", "32", "--bf16", "--log-interval", "1000", "--eval-interval", "0",
         "--eval-iters", "1", "--eval-seq-lengths", "128", "--lr-warmup-iters", "2"]


def _args(flags, world_size):
    from ascendspeed.training.arguments import parse_args

    return parse_args([*MODEL, *flags], world_size=world_size)


def _memory_worker(rank, world_size, flags, steps, queue):
    from ascendspeed.training import memory
    from ascendspeed.training.trainer import train

    result = train(_args([*flags, "--train-iters", str(steps)], world_size))
    queue.put((rank, {"account": result.memory_account.__dict__ | {
        "bytes_per_parameter": result.memory_account.bytes_per_parameter},
        "peak_resident_bytes": memory.peak_resident_bytes()}))


def _timing_worker(rank, world_size, flags, steps, queue):
    from ascendspeed.adaptor import install
    from ascendspeed.features import apply_features
    from ascendspeed.training.initialize import initialize_parallel, teardown
    from ascendspeed.training.trainer import Trainer

    install()
    baseline_args = _args([*flags, "--train-iters", str(steps * 2 + 10)], world_size)
    state = initialize_parallel(baseline_args)
    try:
        baseline = Trainer(baseline_args, state.device)  # megatron-core's optimizer, before any patch
        reused_args = _args([*flags, "--reuse-fp32-param", "--train-iters", str(steps * 2 + 10)], world_size)
        apply_features(reused_args)
        reused = Trainer(reused_args, state.device)
        assert getattr(reused.optimizer, "chained_optimizers", [reused.optimizer])[0].reuse_fp32_param is not None
        times = {"baseline": {"step": [], "optimizer": []}, "reused": {"step": [], "optimizer": []}}
        for trainer in (baseline, reused):  # warm-up
            trainer.train_step()
        for index in range(steps):
            order = (("baseline", baseline), ("reused", reused))
            for name, trainer in (order if index % 2 == 0 else order[::-1]):
                optimizer_time = _time_optimizer(trainer)
                dist.barrier()
                start = time.perf_counter()
                trainer.train_step()
                dist.barrier()
                times[name]["step"].append(time.perf_counter() - start)
                times[name]["optimizer"].append(optimizer_time())
        queue.put((rank, times))
    finally:
        teardown(state)


def _time_optimizer(trainer):
    """Time the next ``optimizer.step()`` of ``trainer``; returns a getter for that time."""
    optimizer = trainer.optimizer
    step = optimizer.step
    measured = []

    def timed_step():
        start = time.perf_counter()
        try:
            return step()
        finally:
            measured.append(time.perf_counter() - start)
            optimizer.step = step

    optimizer.step = timed_step
    return lambda: measured[0]


def _worker(rank, world_size, target, flags, steps, store, queue):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), ASCENDSPEED_DEVICE="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        target(rank, world_size, flags, steps, queue)
    finally:
        dist.destroy_process_group()


def spawn(target, flags, steps, world_size=2):
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as directory:
        processes = [context.Process(target=_worker, args=(rank, world_size, target, flags, steps,
                                                          os.path.join(directory, "store"), queue))
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        results = dict(queue.get(timeout=3600) for _ in processes)
        for process in processes:
            process.join()
            if process.exitcode:
                raise RuntimeError(f"a benchmark rank failed with exit code {process.exitcode}")
    return results[0]


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cores": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name") and "cpu" not in info:
                    info["cpu"] = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    info["simd"] = [f for f in flags if f.startswith(("avx", "sse4", "fma", "amx"))]
                    break
    except OSError:
        pass
    info["note"] = "machine shared with other jobs while measuring"
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per setting")
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--json", default=None)
    options = parser.parse_args()

    report = {"machine": machine(), "model": " ".join(MODEL), "data_parallel_size": 2, "settings": {}}
    for name, flags in (("mixed-precision optimizer", []), ("distributed optimizer", ["--use-distributed-optimizer"])):
        entry = {}
        for label, extra in (("baseline", []), ("reused", ["--reuse-fp32-param"])):
            entry[label] = spawn(_memory_worker, [*flags, *extra], options.memory_steps)
        entry["bytes_per_parameter_saved"] = (entry["baseline"]["account"]["bytes_per_parameter"]
                                              - entry["reused"]["account"]["bytes_per_parameter"])
        times = spawn(_timing_worker, flags, options.steps)
        entry["time"] = {
            label: {kind: statistics.median(values) for kind, values in series.items()}
            for label, series in times.items()
        }
        entry["step_time_ratio"] = entry["time"]["reused"]["step"] / entry["time"]["baseline"]["step"]
        entry["optimizer_step_time_ratio"] = (entry["time"]["reused"]["optimizer"]
                                              / entry["time"]["baseline"]["optimizer"])
        report["settings"][name] = entry
        base, reused = entry["baseline"], entry["reused"]
        print(f"{name}: {base['account']['bytes_per_parameter']:.2f} -> "
              f"{reused['account']['bytes_per_parameter']:.2f} bytes per parameter "
              f"(saved {entry['bytes_per_parameter_saved']:.2f}); peak RSS rank 0 "
              f"{base['peak_resident_bytes'] / 2**20:.0f} -> {reused['peak_resident_bytes'] / 2**20:.0f} MiB; "
              f"step {entry['time']['baseline']['step'] * 1e3:.1f} -> {entry['time']['reused']['step'] * 1e3:.1f} ms "
              f"(x{entry['step_time_ratio']:.3f}), optimizer.step "
              f"{entry['time']['baseline']['optimizer'] * 1e3:.2f} -> {entry['time']['reused']['optimizer'] * 1e3:.2f} ms "
              f"(x{entry['optimizer_step_time_ratio']:.3f})", flush=True)
    if options.json:
        with open(options.json, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
