"""Speed and memory of attention with ALiBi, against the same path without a bias and with a materialised bias.

    python bench/alibi_attention.py [--seqs 2048 8192 --dtypes float32 bfloat16 --heads 16 --head-dim 64]
                                    [--repeats 7] [--memory] [--output bench/results/alibi_attention.json]

Two paths, each in three variants, forward + backward, causal, no dropout, for every (seq, dtype):

* ``local``: megatron-core's ``DotProductAttention`` (baddbmm into a score buffer, masked softmax, bmm), with
  ``attention_backend=local`` so that ascendspeed's fused_attention feature leaves it on that path.
  ``none`` without position bias; ``alibi`` with ascendspeed's in-place bias operator; ``materialised``
  adds a precomputed [1, heads, seq, seq] fp32 bias to the scores, as implementations without a kernel do.
  Its score buffers are [heads, seq, seq]: above ``--local-full-heads-max-seq`` tokens the local path runs
  ``--local-long-heads`` heads (recorded in the JSON) so that it fits in memory; the ratios are per step.
* ``fused``: ``none`` is torch's CPU flash attention, causal, without bias; ``alibi`` is
  ``ascendspeed.ops.alibi_attention`` (ascendspeed's own flash kernel, bias generated inside);
  ``materialised`` passes the full [1, heads, seq, seq] fp32 bias (causal positions at -inf) as the
  attention mask (skipped above ``--materialised-max-seq`` tokens: it alone would take heads * seq^2 * 4 bytes).

Time: the median of ``--repeats`` steps per variant after a warm-up, the variants of one (seq, dtype)
interleaved so machine noise hits all alike; ratios are against ``none`` of the same path, seq and dtype.
Two clocks: wall time, and the CPU time of this process (``time.process_time``, with OpenMP's idle threads
sleeping instead of spinning: ``OMP_WAIT_POLICY=passive`` unless set). On a machine shared with other jobs
the wall time mostly measures the neighbours; the CPU time is the work a variant does.
The time spent inside the in-place operator is also measured on its own, and for the local variants with
a bias the share of visible probabilities the softmax writes as subnormal numbers (the values many x86
cores process with a microcode assist; the ALiBi path flushes them to zero, the materialised one cannot).
Memory (``--memory``, first seq and dtype only): each variant runs in a fresh process (glibc's mmap
threshold fixed at 64 KiB, so freed buffers leave the resident set at once): the peak resident memory of
a step (after a warm-up step, the kernel's high-water mark reset through /proc/self/clear_refs) minus the
resident memory before the variant built its state, so a materialised bias counts.
The JSON records the CPU model and its vector flags from /proc/cpuinfo, torch's CPU capability, the
fused kernel's instruction set and bf16 matmul route (also printed), the thread count and the load average (a shared machine makes every absolute number noisy).
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

from harness import PhaseTimes, load_average, machine, timed

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before torch loads OpenMP: idle threads use no CPU time

VARIANTS = ("local/none", "local/alibi", "local/materialised", "fused/none", "fused/alibi", "fused/materialised")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--local-full-heads-max-seq", type=int, default=4096)
    parser.add_argument("--local-long-heads", type=int, default=2)
    parser.add_argument("--materialised-max-seq", type=int, default=4096)
    parser.add_argument("--memory", action="store_true", help="also measure extra resident memory (slow)")
    parser.add_argument("--output", help="write the results as JSON here")
    parser.add_argument("--memory-of", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)  # one run of --memory-of
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


_MEGATRON_READY = []


def _init_megatron():
    """One single-rank gloo group and megatron-core's parallel state, once per process."""
    if _MEGATRON_READY:
        return
    import ascendspeed.megatron_adaptor  # noqa: F401 - megatron-core on the CPU

    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ascendspeed.features import enable_features

    store = tempfile.mkdtemp()
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    enable_features(position_embedding_type="alibi")
    _MEGATRON_READY.append(True)


class Bench:
    """Inputs, modules and one forward + backward step per variant, for one sequence length and dtype."""

    def __init__(self, args, seq, dtype_name):
        _init_megatron()
        import torch

        self.torch = torch
        self.dtype = getattr(torch, dtype_name)
        b, h, d = args.batch, args.heads, args.head_dim
        self.local_heads = h if seq <= args.local_full_heads_max_seq else min(h, args.local_long_heads)
        self.materialised = seq <= args.materialised_max_seq

        def leaf(*shape):
            return torch.randn(*shape, dtype=self.dtype).requires_grad_()

        self.megatron_inputs = [leaf(seq, b, self.local_heads, d) for _ in range(3)]
        self.sdpa_inputs = [leaf(b, h, seq, d) for _ in range(3)]
        self.shape = (b, h, seq, d)
        self.operator_ms = []
        self.steps = {}
        self.modules = {}

    def variants(self):
        return [v for v in VARIANTS if self.materialised or not v.endswith("/materialised")]

    def full_bias(self, heads: int, causal_minus_inf: bool):
        from ascendspeed.ops import alibi_slopes

        torch = self.torch
        s = self.shape[2]
        distance = (torch.arange(s)[:, None] - torch.arange(s)).float()
        bias = -alibi_slopes(heads)[:, None, None] * distance
        if causal_minus_inf:
            bias = bias.masked_fill(distance < 0, float("-inf"))
        return bias[None]

    def attention(self, alibi):
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.enums import AttnBackend, AttnMaskType
        from megatron.core.transformer.transformer_config import TransformerConfig

        from ascendspeed.features.alibi import AlibiSettings

        h, d = self.local_heads, self.shape[3]
        config = TransformerConfig(
            num_layers=1, hidden_size=h * d, num_attention_heads=h, attention_dropout=0.0, hidden_dropout=0.0,
            masked_softmax_fusion=False, bias_activation_fusion=False, gradient_accumulation_fusion=False,
            persist_layer_norm=False, apply_rope_fusion=False, bf16=self.dtype == self.torch.bfloat16,
            params_dtype=self.dtype,
            # Megatron's materialised path for every variant: the fused_attention feature would send the
            # unbiased ones to torch's flash kernel (the fused path's baseline).
            attention_backend=AttnBackend.local,
        )
        if alibi:
            config.alibi = AlibiSettings()
        return DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")

    def time_operator(self, alibi):
        """Accumulate the time spent in the in-place operator itself (robust to machine noise)."""
        add_bias = alibi.add_bias_

        def timed_add_bias(scores):
            self.operator_ms.append(timed(add_bias, scores)[1] * 1e3)

        alibi.add_bias_ = timed_add_bias

    def step(self, variant):
        """A closure running one forward + backward of ``variant``."""
        if variant in self.steps:
            return self.steps[variant]
        torch = self.torch
        path, bias = variant.split("/")
        if path == "local":
            module = self.attention(alibi=bias == "alibi")
            if bias == "materialised":
                full = self.full_bias(self.local_heads, causal_minus_inf=False)
                module.scale_mask_softmax.register_forward_pre_hook(lambda _, inputs: (inputs[0] + full, *inputs[1:]))
            if bias == "alibi":
                self.time_operator(module.alibi)
            inputs = self.megatron_inputs
            self.modules[variant] = module

            def forward():
                return module(*inputs, None)
        else:
            import torch.nn.functional as F

            from ascendspeed.ops import alibi_attention, alibi_slopes

            inputs = self.sdpa_inputs
            slopes = alibi_slopes(self.shape[1])
            full = self.full_bias(self.shape[1], causal_minus_inf=True) if bias == "materialised" else None

            def forward():
                if bias == "none":
                    return F.scaled_dot_product_attention(*inputs, is_causal=True)
                if bias == "alibi":
                    return alibi_attention(*inputs, slopes)
                return F.scaled_dot_product_attention(*inputs, attn_mask=full)

        def run():
            for tensor in inputs:
                tensor.grad = None
            out = forward()
            out.backward(torch.ones_like(out))

        self.steps[variant] = run
        return run


    def subnormal_share(self, variant) -> float:
        """The share of the visible attention probabilities that the local path's softmax writes as subnormal
        numbers (below 1.2e-38: what many x86 cores multiply with a microcode assist), in one step."""
        torch = self.torch
        captured = []
        softmax = self.modules[variant].scale_mask_softmax
        handle = softmax.register_forward_hook(lambda module, inputs, probs: captured.append(probs.detach()))
        try:
            self.step(variant)()
        finally:
            handle.remove()
        probs = captured[0]
        subnormal = int(((probs != 0) & (probs.float().abs() < torch.finfo(torch.float32).tiny)).sum())
        b, s = self.shape[0], self.shape[2]
        return subnormal / (b * self.local_heads * s * (s + 1) / 2)


def time_variants(args, seq, dtype_name):
    """Median step time per variant of one (seq, dtype), and the median time of one in-place operator call."""
    bench = Bench(args, seq, dtype_name)
    variants = bench.variants()
    for variant in variants:
        bench.step(variant)()
    bench.operator_ms.clear()
    wall, cpu = PhaseTimes(), PhaseTimes(clock=time.process_time)
    for _ in range(args.repeats):
        for variant in variants:
            with wall(variant), cpu(variant):
                bench.step(variant)()
    wall_s, cpu_s = wall.medians(), cpu.medians()
    medians = {variant: (wall_s[variant] * 1e3, cpu_s[variant] * 1e3) for variant in variants}
    return bench, medians, statistics.median(bench.operator_ms)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def measure_memory_here(args) -> float:
    """Extra resident memory (MiB) of ``args.memory_of`` in this process: what the variant keeps (a
    materialised bias, Megatron's score buffer) plus the peak of one step after a warm-up step."""
    bench = Bench(args, args.seq, args.dtype)
    before = _status_kib("VmRSS")
    run = bench.step(args.memory_of)
    run()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset VmHWM to the current resident size
    run()
    return (_status_kib("VmHWM") - before) / 1024


def measure_memory(args, variant, seq, dtype_name) -> float:
    command = [sys.executable, os.path.abspath(__file__), "--memory-of", variant, "--seq", str(seq),
               "--dtype", dtype_name, "--batch", str(args.batch), "--heads", str(args.heads),
               "--head-dim", str(args.head_dim)]
    # A fixed mmap threshold makes glibc return every freed buffer >= 64 KiB to the kernel at once, so the
    # resident high-water mark follows the live tensors instead of the allocator's caching.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
    return float(out.strip().splitlines()[-1])


def main(argv=None):
    args = parse_args(argv)
    if args.memory_of:
        print(f"{measure_memory_here(args):.1f}")
        return
    import torch

    import ascendspeed.ops.alibi_flash_attention  # noqa: F401 - the fused kernel and its description

    b, h, d = args.batch, args.heads, args.head_dim
    host = machine(torch)
    host["alibi_flash_attention_kernel"] = torch.ops.ascendspeed._alibi_flash_attention_cpu_kernel()
    print(f"{host['cpu_model']}, {host['threads']} threads, torch {host['torch_cpu_capability']}; "
          f"attention forward+backward, b{b} h{h} d{d}, causal, {args.repeats} steps per variant")
    print(f"fused ALiBi kernel: {host['alibi_flash_attention_kernel']}")
    configs = []
    for seq in args.seqs:
        for dtype_name in args.dtypes:
            bench, medians, operator_ms = time_variants(args, seq, dtype_name)
            print(f"s={seq} {dtype_name} (local path: {bench.local_heads} heads)")
            print(f"  {'variant':<22}{'wall ms':>10}{'vs none':>9}{'CPU ms':>10}{'vs none':>9}")
            results = {}
            for variant, (wall, cpu) in medians.items():
                wall_none, cpu_none = medians[variant.split("/")[0] + "/none"]
                results[variant] = {"median_ms": round(wall, 1), "time_vs_none": round(wall / wall_none, 3),
                                    "median_cpu_ms": round(cpu, 1), "cpu_time_vs_none": round(cpu / cpu_none, 3)}
                row = results[variant]
                print(f"  {variant:<22}{wall:>10.1f}{row['time_vs_none']:>9.3f}{cpu:>10.1f}{row['cpu_time_vs_none']:>9.3f}")
            results["local/alibi"]["operator_ms"] = round(operator_ms, 1)
            print(f"  in-place operator alone: {operator_ms:.1f} ms per call")
            for variant in ("local/alibi", "local/materialised"):
                if variant in results:
                    results[variant]["subnormal_share"] = bench.subnormal_share(variant)
                    print(f"  {variant}: {100 * results[variant]['subnormal_share']:.3f}% of visible probabilities subnormal")
            if args.memory and not configs:
                for variant in medians:
                    results[variant]["mib"] = round(measure_memory(args, variant, seq, dtype_name), 1)
                for variant in medians:
                    baseline = variant.split("/")[0] + "/none"
                    results[variant]["extra_mib_vs_none"] = round(results[variant]["mib"] - results[baseline]["mib"], 1)
                    print(f"  {variant:<22}extra MiB vs none {results[variant]['extra_mib_vs_none']:>9.1f}")
            configs.append({"seq": seq, "dtype": dtype_name, "local_heads": bench.local_heads, "results": results})
            del bench
    host["load_average_1min_end"] = load_average()
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"machine": host, "shape": {"batch": b, "heads": h, "head_dim": d}, "repeats": args.repeats,
                       "configs": configs}, handle, indent=2)


if __name__ == "__main__":
    main()
