"""Tensor-parallel communication over computation (CoC): plain TP 2 against ``--use-ascend-coc`` at several
``--coc-parallel-num``, with sequence parallelism, in the pretraining entry's GPT.

Every setting runs in the same two processes, one step each in turn with the order rotated every step, so
load from other work hits them alike; the settings differ only in whether the chunked linears' patches are
applied (they are re-applied with another chunk count, or reverted for plain TP, between steps). To make
tensor-parallel communication cost something on a 2-core machine the ranks run in two network namespaces
joined by a rate-limited veth pair (``async_ddp.py``'s link); without root they fall back to loopback.

    sudo python bench/tp_comm_overlap.py --json bench/results/tp_comm_overlap.json \\
        --plot sources/images/tp_comm_overlap.png
    sudo python bench/tp_comm_overlap.py --rate-mbit 750 --steps 20 \\
        --json bench/results/tp_comm_overlap_750mbit.json --timeline sources/images/tp_comm_overlap_timeline.png

Reported for rank 0, medians over the measured steps (and lower quartiles, the quieter machine):
  step time of plain TP 2 and of CoC at each chunk count, and their ratio;
  the CoC steps' TP communication time, its exposed part (time blocked waiting) and the hidden fraction
  (telemetry: ``1 - exposed / communication``).
With ``--timeline``, one more step per setting runs under torch.profiler and is drawn: rank 0's aten
operators on its main thread over the gloo collectives in flight.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from async_ddp import ADDRESSES, NAMESPACES, VETHS, quantile, setup_link, teardown_link  # noqa: E402
from harness import machine  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT = 29733
PLAIN = "plain"


def model_flags(options) -> list:
    return [
        "--num-layers", str(options.num_layers), "--hidden-size", str(options.hidden_size),
        "--num-attention-heads", str(options.heads), "--seq-length", str(options.seq_length),
        "--micro-batch-size", str(options.micro_batch_size), "--global-batch-size", str(options.micro_batch_size),
        "--train-iters", "100000", "--lr-warmup-iters", "1", "--eval-iters", "1",
        "--eval-seq-lengths", str(options.seq_length), "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--use-ascend-coc", "--log-tp-comm-overlap",
    ] + (["--bf16"] if options.bf16 else [])


def worker(options) -> None:
    import torch

    torch.set_num_threads(1)
    from ascendspeed.adaptor import install

    install()
    import torch.distributed as dist

    from ascendspeed.features import apply_features
    from ascendspeed.training.arguments import parse_args
    from ascendspeed.training.initialize import initialize_parallel, teardown
    from ascendspeed.training.trainer import Trainer

    args = parse_args(model_flags(options), world_size=2)
    (applied,) = [feature for feature in apply_features(args) if feature.name == "tp_comm_overlap"]
    recorder = applied.state.recorder
    state = initialize_parallel(args)
    trainer = Trainer(args, state.device)
    modes = [PLAIN] + [str(chunks) for chunks in options.chunks]
    steps = {mode: [] for mode in modes}
    for step in range(options.warmup + options.steps):
        shift = step % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            select_mode(applied, mode)
            dist.barrier()
            recorder.take()
            start = time.perf_counter()
            trainer.train_step()
            elapsed = time.perf_counter() - start
            totals = recorder.take()
            if step >= options.warmup:
                steps[mode].append({"step_time": elapsed, "comm": totals.communication_s,
                                    "exposed": totals.exposed_s, "collectives": totals.collectives,
                                    "bytes": totals.communicated_bytes})
    timelines = {mode: profiled_step(trainer, applied, mode) for mode in modes} if options.timeline else {}
    teardown(state)
    if int(os.environ["RANK"]) == 0:
        with open(options.output, "w") as handle:
            json.dump({"steps": steps, "timelines": timelines}, handle)


def select_mode(applied, mode: str) -> None:
    """Plain TP (the chunked linears' patches reverted) or CoC at ``mode`` chunks."""
    from ascendspeed.patching import MANAGER

    MANAGER.revert(applied.name)
    if mode != PLAIN:
        settings = dataclasses.replace(applied.settings, chunks=int(mode))
        MANAGER.apply(applied.name, applied.feature.patches(settings, applied.state))


def is_outermost_aten(event) -> bool:
    if not event.name.startswith("aten::"):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


def profiled_step(trainer, applied, mode: str) -> dict:
    """One more step of ``mode`` under torch.profiler: when this rank's main thread ran aten operators (the
    outermost ones; a wait for a collective is none) and when a gloo collective was in flight (gloo's threads
    record theirs), in ms from the step's start."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    select_mode(applied, mode)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        with record_function("timed step"):
            trainer.train_step()
    events = profiler.events()
    (step,) = [event for event in events if event.name == "timed step"]
    origin = step.time_range.start

    def ms(event):
        return [(event.time_range.start - origin) / 1e3, (event.time_range.end - origin) / 1e3]

    return {
        "step_ms": (step.time_range.end - origin) / 1e3,
        "compute": [ms(event) for event in events if event.thread == step.thread and is_outermost_aten(event)],
        "collectives": [ms(event) + [event.name.removeprefix("gloo:")] for event in events
                        if event.name.startswith("gloo:") and step.time_range.start <= event.time_range.start
                        <= step.time_range.end],
    }


def launch(options, link: bool) -> dict:
    """Start both ranks (in their namespaces when ``link``), wait, return rank 0's measurements."""
    with tempfile.TemporaryDirectory() as directory:
        output = os.path.join(directory, "rank0.json")
        processes = []
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                       MASTER_ADDR=ADDRESSES[0] if link else "127.0.0.1", MASTER_PORT=str(PORT),
                       GLOO_SOCKET_IFNAME=VETHS[rank] if link else "lo", ASCENDSPEED_DEVICE="cpu",
                       OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
            command = [sys.executable, os.path.abspath(__file__), "--worker", "--output", output,
                       *forwarded(options)]
            if link:
                command = ["ip", "netns", "exec", NAMESPACES[rank]] + command
            processes.append(subprocess.Popen(command, env=env, cwd=REPO))
        codes = [process.wait() for process in processes]
        if any(codes):
            raise SystemExit(f"a benchmark rank failed (exit codes {codes})")
        with open(output) as handle:
            return json.load(handle)


def forwarded(options) -> list:
    names = ("num_layers", "hidden_size", "heads", "seq_length", "micro_batch_size", "warmup", "steps")
    flags = [item for name in names for item in (f"--{name.replace('_', '-')}", str(getattr(options, name)))]
    flags += ["--chunks", *map(str, options.chunks)] + (["--bf16"] if options.bf16 else [])
    return flags + (["--timeline", options.timeline] if options.timeline else [])


def analyse(measured: dict, q: float = 0.5) -> dict:
    """Per setting, the step time at quantile ``q``; per CoC setting also its telemetry and the paired
    (same step, plain minus CoC) median saving."""
    steps = measured["steps"]
    plain = steps[PLAIN]
    t_plain = quantile([s["step_time"] for s in plain], q)
    numbers = {"quantile": q, "steps": len(plain), "plain_step_s": t_plain, "coc": {}}
    for mode, runs in steps.items():
        if mode == PLAIN:
            continue
        t_coc = quantile([s["step_time"] for s in runs], q)
        comm = quantile([s["comm"] for s in runs], q)
        numbers["coc"][mode] = {
            "step_s": t_coc,
            "plain_over_coc": t_plain / t_coc,
            "step_time_reduction": 1.0 - t_coc / t_plain,
            "paired_saving_s": statistics.median(p["step_time"] - c["step_time"] for p, c in zip(plain, runs)),
            "comm_s": comm,
            "exposed_s": quantile([s["exposed"] for s in runs], q),
            "hidden_fraction": quantile([1.0 - s["exposed"] / s["comm"] for s in runs if s["comm"] > 0], q),
            "collectives_per_step": runs[0]["collectives"],
            "communicated_MiB_per_step": runs[0]["bytes"] / 2**20,
        }
    return numbers


def format_report(numbers: dict) -> str:
    ms = 1e3
    name = "medians" if numbers["quantile"] == 0.5 else f"{numbers['quantile']:.2f} quantiles"
    lines = [f"-- {name} over {numbers['steps']} steps per setting",
             f"plain TP 2          step {numbers['plain_step_s'] * ms:8.1f} ms"]
    for mode, coc in numbers["coc"].items():
        lines.append(
            f"CoC {int(mode):>2} chunks       step {coc['step_s'] * ms:8.1f} ms  ({coc['step_time_reduction'] * 100:5.1f} % "
            f"lower, paired {coc['paired_saving_s'] * ms:6.1f} ms) | tp comm {coc['comm_s'] * ms:7.1f} ms, exposed "
            f"{coc['exposed_s'] * ms:7.1f} ms, hidden {coc['hidden_fraction'] * 100:5.1f} % | "
            f"{coc['collectives_per_step']} collectives, {coc['communicated_MiB_per_step']:.1f} MiB")
    return "\n".join(lines)


def plot(numbers: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(numbers["coc"])
    labels = ["plain TP 2"] + [f"CoC {mode}" for mode in modes]
    step = [numbers["plain_step_s"] * 1e3] + [numbers["coc"][mode]["step_s"] * 1e3 for mode in modes]
    exposed = [None] + [numbers["coc"][mode]["exposed_s"] * 1e3 for mode in modes]
    comm = [None] + [numbers["coc"][mode]["comm_s"] * 1e3 for mode in modes]
    figure, axis = plt.subplots(figsize=(8, 3.6))
    positions = range(len(labels))
    axis.bar(positions, step, color=["#8c8c8c"] + ["#4c72b0"] * len(modes), label="step time")
    for position, (c, e) in enumerate(zip(comm, exposed)):
        if c is not None:
            axis.bar(position + 0.3, c, width=0.2, color="#dd8452", label="TP comm in flight" if position == 1 else None)
            axis.bar(position + 0.3, e, width=0.2, color="#c44e52", label="of it exposed" if position == 1 else None)
    axis.set_xticks(list(positions), labels)
    axis.set_ylabel("ms per step (rank 0, median)")
    axis.legend(fontsize=8)
    best = max(numbers["coc"].values(), key=lambda coc: coc["plain_over_coc"])
    axis.set_title(f"TP 2 + SP over a shaped link: best CoC {best['step_time_reduction'] * 100:.0f} % faster, "
                   f"{best['hidden_fraction'] * 100:.0f} % of TP comm hidden", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot_timeline(timelines: dict, numbers: dict, path: str) -> None:
    """One profiled step per setting: the main thread's operators over the TP collectives in flight."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ascendspeed.features.timing import covered_seconds

    colours = {"all_gather": "#dd8452", "all_reduce": "#c44e52", "reduce_scatter": "#8172b3"}
    span = max(timeline["step_ms"] for timeline in timelines.values())
    figure, axes = plt.subplots(len(timelines), 1, figsize=(11, 1.35 * len(timelines) + 0.8), sharex=True)
    for axis, (mode, timeline) in zip(axes, timelines.items()):
        compute = timeline["compute"]
        axis.broken_barh([(start, end - start) for start, end in compute], (1.1, 0.7), color="#4c72b0")
        for start, end, name in timeline["collectives"]:
            axis.broken_barh([(start, end - start)], (0.2, 0.7), color=colours.get(name, "#8c8c8c"))
        busy = covered_seconds(compute)  # any unit
        name = "plain TP 2" if mode == PLAIN else f"CoC {mode} chunks"
        detail = f"step {timeline['step_ms']:.0f} ms, operators {busy:.0f} ms"
        if mode != PLAIN:
            detail += f" | median step {numbers['coc'][mode]['step_s'] * 1e3:.0f} ms, " \
                      f"{numbers['coc'][mode]['hidden_fraction'] * 100:.0f} % of TP comm hidden"
        else:
            detail += f" | median step {numbers['plain_step_s'] * 1e3:.0f} ms"
        axis.set_title(f"{name}: {detail}", fontsize=9, loc="left")
        axis.set_yticks([0.55, 1.45], ["TP comm", "operators"])
        axis.set_ylim(0, 2)
        axis.set_xlim(0, span * 1.01)
    present = {name for timeline in timelines.values() for *_, name in timeline["collectives"]}
    shown = {"main thread in an operator": "#4c72b0"}
    shown.update({name.replace("_", "-"): colour for name, colour in colours.items() if name in present})
    axes[0].legend([plt.Rectangle((0, 0), 1, 1, color=colour) for colour in shown.values()], list(shown),
                   fontsize=7, ncol=len(shown), loc="upper right")
    axes[-1].set_xlabel("ms since the step's start (rank 0, one profiled step per setting; gaps in the operator "
                        "lane: Python or waiting)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help="veth rate each way")
    parser.add_argument("--latency-ms", type=float, default=200.0, help="tbf queue limit, as latency")
    parser.add_argument("--loopback", action="store_true", help="skip the namespaces, use 127.0.0.1")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--bf16", action="store_true",
                        help="train in bf16 (on a CPU without a fast bf16 GEMM both sides multiply in fp32, see "
                        "docs/training.md)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", default=None, help="write the numbers and the raw steps here")
    parser.add_argument("--plot", default=None, help="write the figure here")
    parser.add_argument("--timeline", default=None,
                        help="profile one more step per setting and draw its timeline here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    options = parse(argv)
    if options.worker:
        worker(options)
        return 0
    link, use_link = "loopback (127.0.0.1, unshaped)", False
    if not options.loopback:
        try:
            link, use_link = setup_link(options.rate_mbit, options.latency_ms), True
        except (subprocess.CalledProcessError, FileNotFoundError) as error:
            detail = error.stderr.strip() if isinstance(error, subprocess.CalledProcessError) else str(error)
            link = f"loopback (127.0.0.1, unshaped): namespaces unavailable ({detail})"
            teardown_link()
    try:
        measured = launch(options, use_link)
    finally:
        if use_link:
            teardown_link()
    numbers, quiet = analyse(measured), analyse(measured, q=0.25)
    print(f"link: {link}")
    print(format_report(numbers))
    print(format_report(quiet))
    if options.json:
        import torch

        with open(options.json, "w") as handle:
            json.dump({"machine": machine(torch), "link": link, "options": vars(options), "numbers": numbers,
                       "quiet": quiet, "measured": measured}, handle, indent=1)
    if options.plot:
        plot(numbers, options.plot)
    if options.timeline:
        plot_timeline(measured["timelines"], numbers, options.timeline)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
