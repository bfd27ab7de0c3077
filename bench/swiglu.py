"""Benchmark of the fused SwiGLU operator on the CPU (not a test).

    python bench/swiglu.py [--json results.json] [--reps 7]

One run measures, for 1 and 2 threads, float32 and bfloat16, x of shape [4096, 22016] and
[8, 2048, 8192], forward and backward separately (medians of several repetitions):

* ``ours``: ``ascendspeed.ops.swiglu`` under autograd;
* ``eager``: ``F.silu(a) * b`` under autograd;
* ``megatron``: megatron-core's ``bias_swiglu_impl`` (its ``torch.compile``d autograd function);
* the memory-bandwidth floor of the same run: a large copy into a preallocated buffer gives the
  bandwidth B, the floor is bytes moved / B (forward moves 3N elements, backward 5N, N = output
  elements). Every implementation returns freshly allocated memory, which the kernel zeroes when it
  first faults in: the "fresh" floor counts that write too (forward 4N, backward 7N).

Each (THP, threads) setting runs in its own process, once with and once without
``THP_MEM_ALLOC_ENABLE=1`` (read by torch's CPU allocator at start-up). Memory is accounted once, on a
small shape: bytes saved for backward (saved_tensors_hooks, distinct storages) and bytes allocated
during forward and during backward (profiler), relative to the input, output and gradient sizes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings

from harness import cpu, load_average, timed
from saved_memory import saved_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(4096, 22016), (8, 2048, 8192)]
QUICK_SHAPES = [(256, 2048), (2, 128, 1024)]  # --quick: a smoke run of the script itself
DTYPES = ["float32", "bfloat16"]
IMPLS = ["ours", "eager", "megatron"]


def _import_torch():
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
    sys.path.insert(0, ROOT)
    import torch
    import torch.nn.functional as F
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    from ascendspeed.ops.swiglu import swiglu

    def eager(x):
        a, b = torch.chunk(x, 2, -1)
        return F.silu(a) * b

    impls = {"ours": swiglu, "eager": eager, "megatron": lambda x: bias_swiglu_impl(x, None)}
    return torch, impls


def _step(fn, x, grad):
    """One forward and one backward of ``fn`` under autograd: their times in seconds."""
    x.grad = None
    y, fwd = timed(fn, x)
    _, bwd = timed(y.backward, grad)
    x.grad = None
    return fwd, bwd


def measure(torch, impls, shape, dtype, reps):
    """Medians of ``reps`` rounds; each round times the copy and every implementation once, in turn,
    so that a change of machine load hits all of them alike."""
    x = torch.randn(shape, dtype=dtype).requires_grad_()
    grad = torch.randn(*shape[:-1], shape[-1] // 2, dtype=dtype)
    src = torch.randn(x.numel(), dtype=dtype)
    dst = torch.empty_like(src)
    samples = {name: ([], []) for name in impls}
    copies = []
    for name, fn in impls.items():
        _step(fn, x, grad)  # warm up (megatron's function compiles here)
    for _ in range(reps):
        copies.append(timed(dst.copy_, src)[1])
        for name, fn in impls.items():
            fwd, bwd = _step(fn, x, grad)
            samples[name][0].append(fwd)
            samples[name][1].append(bwd)

    n, element = grad.numel(), grad.element_size()
    bandwidth = 2 * src.numel() * element / statistics.median(copies)
    row = {
        "dtype": str(dtype).replace("torch.", ""),
        "shape": list(shape),
        "bandwidth_gbs": bandwidth / 1e9,
        "floor_fwd_ms": 1e3 * 3 * n * element / bandwidth,
        "floor_bwd_ms": 1e3 * 5 * n * element / bandwidth,
        "fresh_floor_fwd_ms": 1e3 * 4 * n * element / bandwidth,
        "fresh_floor_bwd_ms": 1e3 * 7 * n * element / bandwidth,
    }
    for name, (fwd, bwd) in samples.items():
        row[name] = {
            "fwd_ms": 1e3 * statistics.median(fwd),
            "bwd_ms": 1e3 * statistics.median(bwd),
            "total_ms": 1e3 * statistics.median(f + b for f, b in zip(fwd, bwd)),
        }
    return row


def _warm_memory(torch, gigabytes: int = 5) -> None:
    """Touch more memory than the largest working set once, in 2 MiB pages where the kernel allows.

    A virtual machine may back guest memory lazily: the first touch of a guest page costs a host fault,
    later reuse does not. Without this, whichever implementation first gets never-touched memory (in
    particular huge pages, which the fused operator asks for) pays for it alone. A guest with free page
    reporting also hands freed 2 MiB blocks back to the host, so some fresh allocations fault at the
    host again whatever we do: that is what the medians and the interleaved rounds are for.
    """
    warm = torch.empty(gigabytes << 30, dtype=torch.uint8)
    if sys.platform.startswith("linux"):
        import ctypes

        huge = 2 << 20
        start = (warm.data_ptr() + huge - 1) // huge * huge
        length = (warm.data_ptr() + warm.numel() - start) // huge * huge
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), 14)  # MADV_HUGEPAGE
    warm.fill_(1)


def worker(threads: int, reps: int, shapes) -> None:
    torch, impls = _import_torch()
    import torch._dynamo

    torch._dynamo.config.automatic_dynamic_shapes = False  # one specialised kernel per shape for megatron
    torch.set_num_threads(threads)
    _warm_memory(torch)
    for dtype_name in DTYPES:
        for shape in shapes:
            big = math.prod(shape) > 10**8  # fewer rounds for the largest shape keep the run to minutes
            row = measure(torch, impls, shape, getattr(torch, dtype_name), max(3, reps - 2) if big else reps)
            row.update(threads=threads, thp=os.environ.get("THP_MEM_ALLOC_ENABLE", "0") == "1",
                       load=load_average())
            print(json.dumps(row), flush=True)


def memory_accounting() -> dict:
    """Saved-for-backward and allocated bytes of each implementation, relative to the tensors involved."""
    torch, impls = _import_torch()
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(512, 2048, requires_grad=True)
    grad = torch.randn(512, 1024)
    in_bytes, out_bytes = x.numel() * 4, grad.numel() * 4
    result = {}
    for name, fn in impls.items():
        fn(x).backward(grad)  # compile first
        x.grad = None
        saved = saved_bytes(lambda: fn(x))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as forward:
            y = fn(x)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as backward:
            y.backward(grad)
        x.grad = None

        def allocated(prof):
            return sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)

        result[name] = {
            "saved_over_input": saved / in_bytes,
            "fwd_alloc_over_output": allocated(forward) / out_bytes,
            "bwd_alloc_over_grad_x": allocated(backward) / in_bytes,
        }
    return result


def _ratio(a, b):
    return a / b if b else float("nan")


def report(rows, memory, kernel) -> str:
    lines = [
        f"CPU: {cpu().model} ({cpu().logical_cpus} cores); torch {_torch_version()}; ascendspeed kernels: {kernel}; "
        f"1-minute load average during the run: {min(r['load'] for r in rows):.1f} to "
        f"{max(r['load'] for r in rows):.1f} (anything above the core count means other work competed)",
        "",
        "Times in ms (median). Speedups are forward+backward. `floor` = bytes moved (3N forward, 5N backward) "
        "/ copy bandwidth; `fresh floor` adds the zeroing of the fresh output (N) or gradient (2N) by the "
        "kernel (4N, 7N).",
        "",
        "| THP | thr | dtype | shape | copy GB/s | ours fwd | ours bwd | ours f+b | eager f+b | megatron f+b "
        "| vs eager | vs megatron | fwd / floor | bwd / floor | fwd / fresh floor | bwd / fresh floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ours = row["ours"]
        lines.append(
            "| {thp} | {thr} | {dtype} | {shape} | {bw:.1f} | {f:.1f} | {b:.1f} | {t:.1f} | {e:.1f} | {m:.1f} | {se:.2f}x "
            "| {sm:.2f}x | {ff:.2f} | {bf:.2f} | {fff:.2f} | {bff:.2f} |".format(
                thp="on" if row["thp"] else "off",
                thr=row["threads"],
                dtype=row["dtype"],
                shape="x".join(map(str, row["shape"])),
                bw=row["bandwidth_gbs"],
                f=ours["fwd_ms"],
                b=ours["bwd_ms"],
                t=ours["total_ms"],
                e=row["eager"]["total_ms"],
                m=row["megatron"]["total_ms"],
                se=_ratio(row["eager"]["total_ms"], ours["total_ms"]),
                sm=_ratio(row["megatron"]["total_ms"], ours["total_ms"]),
                ff=_ratio(ours["fwd_ms"], row["floor_fwd_ms"]),
                bf=_ratio(ours["bwd_ms"], row["floor_bwd_ms"]),
                fff=_ratio(ours["fwd_ms"], row["fresh_floor_fwd_ms"]),
                bff=_ratio(ours["bwd_ms"], row["fresh_floor_bwd_ms"]),
            )
        )
    lines += [
        "",
        "Memory (fp32, x = [512, 2048]): bytes saved for backward / input bytes; bytes allocated during "
        "forward / output bytes; during backward / input-gradient bytes.",
        "",
        "| impl | saved / input | forward allocations / output | backward allocations / grad x |",
        "|---|---|---|---|",
    ]
    for name, values in memory.items():
        lines.append(
            f"| {name} | {values['saved_over_input']:.2f} | {values['fwd_alloc_over_output']:.2f} "
            f"| {values['bwd_alloc_over_grad_x']:.2f} |"
        )
    return "\n".join(lines)


def _torch_version() -> str:
    import torch

    return torch.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7, help="timed rounds per setting (the largest shape: 2 fewer)")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    parser.add_argument("--quick", action="store_true", help="small shapes: check the script, not the kernel")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.reps, QUICK_SHAPES if args.quick else SHAPES)
        return

    started = time.perf_counter()
    rows = []
    for thp in ("0", "1"):
        for threads in (1, 2):
            env = dict(os.environ, THP_MEM_ALLOC_ENABLE=thp, OMP_NUM_THREADS=str(threads))
            done = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--worker", str(threads), "--reps", str(args.reps)]
                + ["--quick"] * args.quick,
                env=env, capture_output=True, text=True, check=False,
            )
            if done.returncode:
                sys.exit(f"worker (THP={thp}, threads={threads}) failed:\n{done.stderr[-4000:]}")
            for line in done.stdout.splitlines():
                if line.startswith("{"):
                    rows.append(json.loads(line))
                    print(f"  measured {rows[-1]['dtype']} {rows[-1]['shape']} THP={thp} threads={threads}",
                          file=sys.stderr, flush=True)
    memory = memory_accounting()
    import torch

    text = report(rows, memory, torch.ops.ascendspeed._swiglu_cpu_kernel())
    print(text)
    print(f"\n(benchmark took {time.perf_counter() - started:.0f} s)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": rows, "memory": memory}, out, indent=1)


if __name__ == "__main__":
    main()
