"""Async DDP benchmark: 2 data-parallel ranks train the pretraining entry's GPT, overlap off and on.

Both settings run in the same processes, step by step in alternation (ABBA), so that load from other
work on the machine hits them alike. To make gradient communication cost something on a 2-core
machine, the ranks run in two network namespaces joined by a veth pair whose both ends are rate
limited with Linux traffic control (tbf); without root or namespaces the ranks fall back to loopback.

    sudo python bench/async_ddp.py --json /tmp/async_ddp.json \\
        --plot sources/images/async_ddp.png

Reported for rank 0, as medians over the measured steps and again as lower quartiles (on a shared
machine, load from other work only ever adds time: the quartile is the quieter machine); the paired
difference is taken over the ABBA pairs of off minus on, which cancels slow drifts of that load:
  T_sequential  step time, overlap off          T_overlap  step time, overlap on
  T_comm        gradient collective time with overlap off (all of it exposed)
  T_compute     T_sequential - T_comm           T_backward backward of the last micro-batch (off)
  hidden        (T_sequential - T_overlap) / T_comm
  exposed       communication after backward ended, overlap on (telemetry), vs one bucket's worth
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMESPACES = ("asdbench0", "asdbench1")
VETHS = ("asdveth0", "asdveth1")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
PORT = 29731


# -- the link --------------------------------------------------------------------------------------------
def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def teardown_link() -> None:
    for namespace in NAMESPACES:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def setup_link(rate_mbit: float, latency_ms: float) -> str:
    """Two namespaces, a veth pair between them, each end shaped to ``rate_mbit``. Returns a description."""
    teardown_link()
    for namespace in NAMESPACES:
        _run("ip", "netns", "add", namespace)
    _run("ip", "link", "add", VETHS[0], "type", "veth", "peer", "name", VETHS[1])
    burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 / 250))  # about 4 ms of traffic
    for namespace, veth, address in zip(NAMESPACES, VETHS, ADDRESSES):
        _run("ip", "link", "set", veth, "netns", namespace)
        _run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", veth)
        _run("ip", "-n", namespace, "link", "set", veth, "up")
        _run("ip", "-n", namespace, "link", "set", "lo", "up")
        _run("tc", "-n", namespace, "qdisc", "add", "dev", veth, "root", "tbf", "rate", f"{rate_mbit}mbit",
             "burst", str(burst), "latency", f"{latency_ms}ms")
    return f"veth pair {ADDRESSES[0]} <-> {ADDRESSES[1]} in namespaces {NAMESPACES}, tbf {rate_mbit} Mbit/s each way"


# -- the workers -----------------------------------------------------------------------------------------
def model_flags(options) -> list:
    return [
        "--num-layers", str(options.num_layers), "--hidden-size", str(options.hidden_size),
        "--num-attention-heads", str(options.heads), "--seq-length", str(options.seq_length),
        "--micro-batch-size", str(options.micro_batch_size),
        "--global-batch-size", str(options.micro_batch_size * 2 * options.microbatches),
        "--train-iters", "100000", "--lr-warmup-iters", "1", "--eval-iters", "1",
        "--eval-seq-lengths", str(options.seq_length), "--ddp-bucket-size", str(options.bucket_size),
        "--log-grad-reduce-overlap",
    ]


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

    flags = model_flags(options)
    settings = {
        "off": parse_args(flags, world_size=2),
        "on": parse_args(flags + ["--overlap-grad-reduce"], world_size=2),
    }
    applied = apply_features(settings["on"])  # one set of patches serves both models; DDP configs differ
    (telemetry,) = [feature.state for feature in applied if feature.name == "async_ddp"]
    telemetry.log = None
    state = initialize_parallel(settings["on"])
    trainers = {name: Trainer(args, state.device) for name, args in settings.items()}
    steps = {name: [] for name in trainers}
    order = ["off", "on"]
    for step in range(options.warmup + options.steps):
        for name in order if step % 2 == 0 else order[::-1]:
            dist.barrier()
            start = time.perf_counter()
            trainers[name].train_step()
            end = time.perf_counter()
            record = telemetry.records()[-1]
            if step >= options.warmup:
                steps[name].append({
                    "step_time": end - start,
                    "forward_start": start,
                    "backward_start": record.backward_start,
                    "compute_end": record.compute_end,
                    "reduced": record.end,
                    "end": end,
                    "comm": record.comm_time,
                    "exposed": record.exposed_time,
                    "buckets": [
                        {"label": b.label, "numel": b.numel, "ready": b.ready, "start": b.start, "end": b.end}
                        for b in record.buckets
                    ],
                })
    buckets = {name: [len(chunk.bucket_groups) for chunk in trainer.model] for name, trainer in trainers.items()}
    teardown(state)
    if int(os.environ["RANK"]) == 0:
        with open(options.output, "w") as handle:
            json.dump({"steps": steps, "bucket_groups": buckets}, handle)


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
            command = [sys.executable, os.path.abspath(__file__), "--worker", "--output", output] + _forward(options)
            if link:
                command = ["ip", "netns", "exec", NAMESPACES[rank]] + command
            processes.append(subprocess.Popen(command, env=env, cwd=REPO))
        codes = [process.wait() for process in processes]
        if any(codes):
            raise SystemExit(f"a benchmark rank failed (exit codes {codes})")
        with open(output) as handle:
            return json.load(handle)


def _forward(options) -> list:
    names = ("num_layers", "hidden_size", "heads", "seq_length", "micro_batch_size", "microbatches",
             "bucket_size", "warmup", "steps")
    return [item for name in names for item in (f"--{name.replace('_', '-')}", str(getattr(options, name)))]


# -- analysis --------------------------------------------------------------------------------------------
def quantile(values, q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def analyse(measured: dict, q: float = 0.5) -> dict:
    """The numbers at quantile ``q`` of the measured steps (0.5: medians; lower: quieter machine)."""
    off, on = measured["steps"]["off"], measured["steps"]["on"]

    def at(values):
        return quantile(values, q)

    t_sequential = at([s["step_time"] for s in off])
    t_overlap = at([s["step_time"] for s in on])
    paired = statistics.median([a["step_time"] - b["step_time"] for a, b in zip(off, on)])
    t_comm = at([s["comm"] for s in off])
    t_backward = at([s["compute_end"] - s["backward_start"] for s in off])
    numels = [b["numel"] for b in on[0]["buckets"]]
    return {
        "quantile": q,
        "T_sequential_s": t_sequential,
        "T_overlap_s": t_overlap,
        "T_comm_s": t_comm,
        "T_compute_s": t_sequential - t_comm,
        "T_backward_s": t_backward,
        "comm_over_backward": t_comm / t_backward,
        "hidden_fraction": (t_sequential - t_overlap) / t_comm,
        "step_time_reduction": 1.0 - t_overlap / t_sequential,
        "paired_saving_s": paired,
        "paired_hidden_fraction": paired / t_comm,
        "exposed_on_s": at([s["exposed"] for s in on]),
        "comm_on_s": at([s["comm"] for s in on]),
        "telemetry_hidden_on": at([1.0 - s["exposed"] / s["comm"] for s in on if s["comm"] > 0]),
        "one_bucket_s": t_comm * max(numels) / sum(numels),
        "buckets_on": len(numels),
        "bucket_groups": measured["bucket_groups"],
        "steps": len(on),
    }


def format_report(numbers: dict) -> str:
    ms = 1e3
    name = "medians" if numbers["quantile"] == 0.5 else f"{numbers['quantile']:.2f} quantiles"
    return "\n".join([
        f"-- {name} over {numbers['steps']} steps per setting; {numbers['buckets_on']} buckets with overlap",
        f"T_compute   {numbers['T_compute_s'] * ms:8.1f} ms   (T_backward {numbers['T_backward_s'] * ms:.1f} ms)",
        f"T_comm      {numbers['T_comm_s'] * ms:8.1f} ms   ({numbers['comm_over_backward']:.2f} x T_backward)",
        f"step, overlap off (T_sequential) {numbers['T_sequential_s'] * ms:8.1f} ms",
        f"step, overlap on  (T_overlap)    {numbers['T_overlap_s'] * ms:8.1f} ms   "
        f"({numbers['step_time_reduction'] * 100:.1f} % lower)",
        f"hidden fraction (T_sequential - T_overlap) / T_comm = {numbers['hidden_fraction']:.2f} "
        f"(paired step differences: {numbers['paired_saving_s'] * ms:.1f} ms, "
        f"{numbers['paired_hidden_fraction']:.2f})",
        f"exposed communication with overlap {numbers['exposed_on_s'] * ms:.1f} ms "
        f"(one bucket's worth {numbers['one_bucket_s'] * ms:.1f} ms); telemetry hidden fraction "
        f"{numbers['telemetry_hidden_on']:.2f}",
    ])


def representative(steps: list) -> dict:
    """The measured step whose step time is the median one."""
    ordered = sorted(steps, key=lambda s: s["step_time"])
    return ordered[len(ordered) // 2]


def plot(measured: dict, numbers: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = {name: representative(measured["steps"][name]) for name in ("off", "on")}
    span = max(s["end"] - s["forward_start"] for s in chosen.values()) * 1e3
    figure, axes = plt.subplots(2, 1, figsize=(11, 4.8), sharex=True)
    titles = {"off": "overlap off: buckets reduced after backward",
              "on": "overlap on: each bucket reduced as soon as it fills"}
    for axis, name in zip(axes, ("off", "on")):
        step = chosen[name]
        origin = step["forward_start"]

        def ms(value):
            return (value - origin) * 1e3

        axis.barh(2, ms(step["backward_start"]), left=0, height=0.6, color="#c9d6ea", label="forward")
        axis.barh(2, ms(step["compute_end"]) - ms(step["backward_start"]), left=ms(step["backward_start"]),
                  height=0.6, color="#4c72b0", label="backward")
        axis.barh(2, ms(step["end"]) - ms(step["reduced"]), left=ms(step["reduced"]), height=0.6,
                  color="#8c8c8c", label="optimizer step")
        for index, bucket in enumerate(step["buckets"]):
            lane = 1 - 0.35 * (index % 2)
            axis.barh(lane, ms(bucket["end"]) - ms(bucket["start"]), left=ms(bucket["start"]), height=0.3,
                      color="#dd8452", edgecolor="black", linewidth=0.4,
                      label="bucket collective" if index == 0 else None)
            axis.plot([ms(bucket["ready"])], [lane + 0.2], marker="v", color="black", markersize=3)
        exposed = max(0.0, ms(max(b["end"] for b in step["buckets"])) - ms(step["compute_end"]))
        axis.axvline(ms(step["compute_end"]), color="#c44e52", linestyle="--", linewidth=1)
        axis.set_yticks([0.82, 2], ["DP comm", "compute"])
        axis.set_xlim(0, span * 1.02)
        axis.set_title(f"{titles[name]}  |  step {step['step_time'] * 1e3:.0f} ms, "
                       f"exposed comm {exposed:.0f} ms", fontsize=10, loc="left")
    axes[1].legend(loc="lower left", fontsize=8, ncol=2)
    axes[1].set_xlabel("ms since step start (rank 0; triangles: bucket ready; dashed: backward ends)")
    figure.suptitle(f"Async DDP, 2 ranks, measured: T_comm {numbers['T_comm_s'] * 1e3:.0f} ms, "
                    f"hidden fraction {numbers['hidden_fraction']:.2f}, step time "
                    f"-{numbers['step_time_reduction'] * 100:.0f} %", fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


# -- entry -----------------------------------------------------------------------------------------------
def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-mbit", type=float, default=300.0, help="veth rate each way")
    parser.add_argument("--latency-ms", type=float, default=200.0, help="tbf queue limit, as latency")
    parser.add_argument("--loopback", action="store_true", help="skip the namespaces, use 127.0.0.1")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--bucket-size", type=int, default=250_000, help="--ddp-bucket-size (elements)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", default=None, help="write the numbers and the raw trace here")
    parser.add_argument("--plot", default=None, help="write the timeline figure here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    options = parse(argv)
    if options.worker:
        worker(options)
        return 0
    link = "loopback (127.0.0.1, unshaped)"
    use_link = False
    if not options.loopback:
        try:
            link = setup_link(options.rate_mbit, options.latency_ms)
            use_link = True
        except (subprocess.CalledProcessError, FileNotFoundError) as error:
            detail = error.stderr.strip() if isinstance(error, subprocess.CalledProcessError) else str(error)
            link = f"loopback (127.0.0.1, unshaped): namespaces unavailable ({detail})"
            teardown_link()
    try:
        measured = launch(options, use_link)
    finally:
        if use_link:
            teardown_link()
    numbers = analyse(measured)
    quiet = analyse(measured, q=0.25)
    print(f"link: {link}")
    print(format_report(numbers))
    print(format_report(quiet))
    if options.json:
        with open(options.json, "w") as handle:
            json.dump({"link": link, "options": vars(options), "numbers": numbers, "quiet": quiet,
                       "measured": measured}, handle)
    if options.plot:
        plot(measured, numbers, options.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
