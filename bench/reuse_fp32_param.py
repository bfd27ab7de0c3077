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

Layout switch alone (``--switch-elements``, one process): ms per direction for one unit of that many
elements -- a ``ParameterUnit`` buffer and a distributed-optimizer bucket shard of ranks 0, 1 and 2 --
for the fused operators (``bf16_join_`` to the main layout, ``bf16_split_`` back), the torch
composition the feature used before them (kept below as ``torch_codec_*``), and the bandwidth floor: a
plain copy of the same fp32 bytes (4 read + 4 written per element). The methods alternate within each
repetition; reported are medians.

    python bench/reuse_fp32_param.py --json bench/results/reuse_fp32_param.json
    python bench/reuse_fp32_param.py --switch-only --switch-threads 1 2
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from harness import PhaseTimes, cpu, run_on_gloo_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
         "--micro-batch-size", "2", "--global-batch-size", "32", "--bf16", "--log-interval", "1000", "--eval-interval", "0",
         "--eval-iters", "1", "--eval-seq-lengths", "128", "--lr-warmup-iters", "2"]


def _args(flags, world_size):
    from ascendspeed.training.arguments import parse_args

    return parse_args([*MODEL, *flags], world_size=world_size)


def _memory_worker(rank, world_size, flags, steps):
    from ascendspeed.training import memory
    from ascendspeed.training.trainer import train

    result = train(_args([*flags, "--train-iters", str(steps)], world_size))
    return {"account": result.memory_account.__dict__ | {
        "bytes_per_parameter": result.memory_account.bytes_per_parameter},
        "peak_resident_bytes": memory.peak_resident_bytes()}


def _timing_worker(rank, world_size, flags, steps):
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
        return times
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


def spawn(target, flags, steps, world_size=2):
    return run_on_gloo_ranks(target, world_size, flags, steps)


# -- the layout switch alone -------------------------------------------------------------------------------
#: Elements per chunk of the torch composition the feature used before the fused operators.
TORCH_CODEC_CHUNK = 1 << 20


def torch_codec_to_main(halves, ties, high_offset, low):
    """The pre-operator ``to_main_layout``: torch ops, the remainders copied first (interleaved
    layout: decoded chunk by chunk from the end), or one decode of the whole shard."""
    from ascendspeed.ops.bf16_split import join_reference

    if low is not None:
        n = low.numel()
        join_reference(halves[high_offset: high_offset + n], low, ties, halves[: 2 * n].view(n, 2))
        return
    n = halves.numel() // 2
    low = halves[n:].clone()
    for start in reversed(range(0, n, TORCH_CODEC_CHUNK)):
        end = min(start + TORCH_CODEC_CHUNK, n)
        chunk_ties = ties[(ties >= start) & (ties < end)] - start
        join_reference(halves[start:end], low[start:end], chunk_ties, halves[2 * start: 2 * end].view(-1, 2))


def torch_codec_to_model(halves, high_offset, low):
    """The pre-operator ``to_model_layout``: torch ops chunk by chunk (interleaved layout, remainders
    held back until all values are read) or one encode of the whole shard; returns the ties."""
    from ascendspeed.ops.bf16_split import split_reference

    if low is not None:
        n = low.numel()
        high, low_values, ties = split_reference(halves[: 2 * n].view(torch.float32))
        halves[high_offset: high_offset + n].copy_(high)
        low.copy_(low_values)
        return ties
    n = halves.numel() // 2
    lows, ties = torch.empty(n, dtype=torch.int16), []
    for start in range(0, n, TORCH_CODEC_CHUNK):
        end = min(start + TORCH_CODEC_CHUNK, n)
        high, low_values, chunk_ties = split_reference(halves[2 * start: 2 * end].view(torch.float32))
        lows[start:end].copy_(low_values)
        halves[start:end].copy_(high)
        ties.append(chunk_ties + start)
    halves[n:].copy_(lows)
    return torch.cat(ties)


def _switch_layouts(elements: int):
    """``(name, halves, high_offset, low)`` in the main layout, fp32 values from one training-like draw."""
    values = (torch.randn(elements, generator=torch.Generator().manual_seed(0)) * 0.02).view(torch.int16)
    layouts = [("parameter unit (interleaved)", values.clone(), 0, None)]
    for rank, dp in ((0, 2), (1, 2), (2, 4)):
        bucket = torch.zeros(dp * elements, dtype=torch.int16)
        bucket[: 2 * elements] = values
        layouts.append((f"bucket shard, rank {rank} of {dp}", bucket, rank * elements,
                        torch.zeros(elements, dtype=torch.int16)))
    return layouts


def switch_benchmark(elements: int, repeats: int, threads: int) -> dict:
    from ascendspeed.ops.bf16_split import bf16_join_, bf16_split_

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        source, target = torch.randn(elements), torch.empty(elements)
        results = {}
        for name, halves, high_offset, low in _switch_layouts(elements):
            expected = halves[: 2 * elements].clone()
            ties = bf16_split_(halves, high_offset, low)
            phase = PhaseTimes()
            for _ in range(repeats):
                with phase("copy"):
                    target.copy_(source)
                with phase("fused_to_main"):
                    bf16_join_(halves, ties, high_offset, low)
                assert torch.equal(halves[: 2 * elements], expected)
                with phase("fused_to_model"):
                    ties = bf16_split_(halves, high_offset, low)
                with phase("torch_to_main"):
                    torch_codec_to_main(halves, ties, high_offset, low)
                assert torch.equal(halves[: 2 * elements], expected)
                with phase("torch_to_model"):
                    ties = torch_codec_to_model(halves, high_offset, low)
            ms = {key: seconds * 1e3 for key, seconds in phase.medians().items()}
            ms |= {f"{key}_over_copy": ms[key] / ms["copy"] for key in list(ms) if key != "copy"}
            ms["speedup_to_main"] = ms["torch_to_main"] / ms["fused_to_main"]
            ms["speedup_to_model"] = ms["torch_to_model"] / ms["fused_to_model"]
            results[name] = ms
            print(f"switch, {threads} thread(s), {name}: copy {ms['copy']:.2f} ms; to main {ms['fused_to_main']:.2f} ms "
                  f"(x{ms['fused_to_main_over_copy']:.2f} copy; torch codec {ms['torch_to_main']:.2f} ms), to model "
                  f"{ms['fused_to_model']:.2f} ms (x{ms['fused_to_model_over_copy']:.2f} copy; torch codec "
                  f"{ms['torch_to_model']:.2f} ms)", flush=True)
        return results
    finally:
        torch.set_num_threads(before)


def machine() -> dict:
    host = cpu()
    return {"python": platform.python_version(), "torch": torch.__version__, "cores": host.logical_cpus,
            "cpu": host.model, "simd": host.vector_flags, "note": "machine shared with other jobs while measuring"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per setting")
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--switch-elements", type=int, default=1 << 24, help="elements of the unit switched alone")
    parser.add_argument("--switch-repeats", type=int, default=15)
    parser.add_argument("--switch-threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--switch-only", action="store_true", help="only the layout switch alone")
    options = parser.parse_args()

    report = {"machine": machine(), "model": " ".join(MODEL), "data_parallel_size": 2, "settings": {}}
    settings = (("mixed-precision optimizer", []), ("distributed optimizer", ["--use-distributed-optimizer"]))
    for name, flags in () if options.switch_only else settings:
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
    # After the training runs: spawned ranks inherit the parent's peak resident memory, which these
    # buffers (hundreds of MiB) would raise.
    report["layout_switch"] = {
        "elements": options.switch_elements,
        "threads": {str(threads): switch_benchmark(options.switch_elements, options.switch_repeats, threads)
                    for threads in options.switch_threads},
    }
    if options.json:
        with open(options.json, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
