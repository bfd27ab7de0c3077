"""all_reduce among CPU ranks of one host: shared memory against gloo, and against the bytes it must copy.

    python bench/shm_all_reduce.py [--ranks 2 4] [--sizes 1 4096 842496 12900000] [--repeats 31]
                                   [--output bench/results/shm_all_reduce.json]

Per rank count, one gloo job (one thread per rank, the adaptor installed) all-reduces fp32 tensors of each
size (elements; the defaults: a loss, a tensor-parallel activation, the gradient buffers of the 0.84M- and
12.9M-parameter models of bench/peer_step.py), alternating the shared-memory path and gloo
(``ASCENDSPEED_SHM_ALL_REDUCE=0``) call by call, each call started together on every rank (a gloo barrier,
not timed). Reports rank 0's median per path, the ratio gloo / shared memory, and the ratio to a floor: the
median time of one ``copy_`` of the tensor on rank 0 while the other ranks wait (a rank's data must at least
be copied out of the other ranks' memory once; the shared-memory path copies it in, reads every rank's share
of it, and copies the result out).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import finish_results, machine, run_on_gloo_ranks  # noqa: E402


def worker(rank: int, world_size: int, sizes: list[int], repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    from ascendspeed.adaptor import install

    install()
    results = {}
    for numel in sizes:
        tensor = torch.randn(numel)
        times = {"shared_memory": [], "gloo": []}
        for repeat in range(repeats + 2):
            for path in times:
                os.environ["ASCENDSPEED_SHM_ALL_REDUCE"] = "1" if path == "shared_memory" else "0"
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(tensor)
                if repeat >= 2:  # the first two: the region's set-up, first touches
                    times[path].append(time.perf_counter() - start)
                tensor.div_(world_size)
        os.environ.pop("ASCENDSPEED_SHM_ALL_REDUCE")
        scratch = torch.empty_like(tensor)
        copies = []
        dist.barrier()
        for _ in range(repeats if rank == 0 else 0):
            start = time.perf_counter()
            scratch.copy_(tensor)
            copies.append(time.perf_counter() - start)
        dist.barrier()
        if rank != 0:
            continue
        medians = {path: statistics.median(seconds) for path, seconds in times.items()}
        floor = statistics.median(copies)
        results[numel] = {"median_ms": {path: 1e3 * value for path, value in medians.items()},
                          "floor_ms": 1e3 * floor, "gloo_over_shared_memory": medians["gloo"] / medians["shared_memory"],
                          "shared_memory_over_floor": medians["shared_memory"] / floor}
    return results  # rank 0's


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4096, 842496, 12900000])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--output", help="write the results as JSON here")
    options = parser.parse_args(argv)
    import torch

    results = {"machine": machine(torch), "runs": []}
    for ranks in options.ranks:
        per_size = run_on_gloo_ranks(worker, ranks, options.sizes, options.repeats)
        for numel, result in per_size.items():
            results["runs"].append({"ranks": ranks, "elements": numel, "bytes": 4 * numel, **result})
            print(f"{ranks} ranks {4 * numel / 1e6:9.3f} MB  shared memory {result['median_ms']['shared_memory']:8.3f} ms"
                  f"  gloo {result['median_ms']['gloo']:8.3f} ms  gloo/shm {result['gloo_over_shared_memory']:6.2f}"
                  f"  shm/floor {result['shared_memory_over_floor']:6.2f}", flush=True)
    return finish_results(results, options.output)


if __name__ == "__main__":
    main()
