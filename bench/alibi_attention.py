"""Speed and memory of attention with ALiBi, against the same path without a bias and with a materialised bias.

    python bench/alibi_attention.py [--batch 1 --heads 16 --seq 2048 --head-dim 64] [--output FILE.json]

Two paths, each in three variants, forward + backward, fp32, causal, no dropout:

* ``local``: megatron-core's ``DotProductAttention`` (baddbmm into a score buffer, masked softmax, bmm).
  ``none`` without position bias; ``alibi`` with ascendspeed's in-place bias operator; ``materialised``
  adds a precomputed [1, heads, seq, seq] fp32 bias to the scores, as implementations without a kernel do.
* ``fused``: torch's CPU flash attention. ``none`` is causal attention without bias; ``alibi`` is
  ``ascendspeed.ops.alibi_attention`` (an O(heads * seq) bias); ``materialised`` passes the full
  [1, heads, seq, seq] fp32 bias (causal positions at -inf) as the attention mask.

Time: the median of ``--repeats`` steps per variant after a warm-up, variants interleaved so machine noise
hits all alike. The time spent inside the in-place operator is also measured on its own: on a shared machine
that is the figure least affected by noise.
Memory: each variant runs in a fresh process (glibc's mmap threshold fixed at 64 KiB, so freed buffers leave
the resident set at once): the peak resident memory of a step (after a warm-up step, the kernel's
high-water mark reset through /proc/self/clear_refs) minus the resident memory before the variant built
its state, so a materialised bias counts.
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

VARIANTS = ("local/none", "local/alibi", "local/materialised", "fused/none", "fused/alibi", "fused/materialised")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--output", help="write the results as JSON here")
    parser.add_argument("--memory-of", choices=VARIANTS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


class Bench:
    """Inputs, modules and one forward + backward step per variant."""

    def __init__(self, args):
        import ascendspeed.megatron_adaptor  # noqa: F401 - megatron-core on the CPU

        import torch
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from ascendspeed.features import enable_features

        self.torch = torch
        self.store = tempfile.mkdtemp()
        torch.distributed.init_process_group("gloo", init_method=f"file://{self.store}/store", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(0)
        enable_features(position_embedding_type="alibi")

        b, h, s, d = args.batch, args.heads, args.seq, args.head_dim
        self.megatron_inputs = [torch.randn(s, b, h, d, requires_grad=True) for _ in range(3)]
        self.sdpa_inputs = [torch.randn(b, h, s, d, requires_grad=True) for _ in range(3)]
        self.shape = (b, h, s, d)
        self.steps = {}

    def full_bias(self, causal_minus_inf: bool):
        from ascendspeed.ops import alibi_slopes

        torch = self.torch
        _, h, s, _ = self.shape
        distance = (torch.arange(s)[:, None] - torch.arange(s)).float()
        bias = -alibi_slopes(h)[:, None, None] * distance
        if causal_minus_inf:
            bias = bias.masked_fill(distance < 0, float("-inf"))
        return bias[None]

    def attention(self, alibi):
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.transformer_config import TransformerConfig

        from ascendspeed.features.alibi import AlibiSettings

        _, h, _, d = self.shape
        config = TransformerConfig(
            num_layers=1, hidden_size=h * d, num_attention_heads=h, attention_dropout=0.0, hidden_dropout=0.0,
            masked_softmax_fusion=False, bias_activation_fusion=False, gradient_accumulation_fusion=False,
            persist_layer_norm=False, apply_rope_fusion=False,
        )
        if alibi:
            config.alibi = AlibiSettings()
        return DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")

    def time_operator(self, alibi):
        """Accumulate the time spent in the in-place operator itself (robust to machine noise)."""
        add_bias = alibi.add_bias_
        self.operator_ms = []

        def timed(scores):
            start = time.perf_counter()
            add_bias(scores)
            self.operator_ms.append((time.perf_counter() - start) * 1e3)

        alibi.add_bias_ = timed

    def step(self, variant):
        """A closure running one forward + backward of ``variant``."""
        if variant in self.steps:
            return self.steps[variant]
        torch = self.torch
        path, bias = variant.split("/")
        if path == "local":
            module = self.attention(alibi=bias == "alibi")
            if bias == "materialised":
                full = self.full_bias(causal_minus_inf=False)
                module.scale_mask_softmax.register_forward_pre_hook(lambda _, inputs: (inputs[0] + full, *inputs[1:]))
            if bias == "alibi":
                self.time_operator(module.alibi)
            inputs = self.megatron_inputs

            def forward():
                return module(*inputs, None)
        else:
            import torch.nn.functional as F

            from ascendspeed.ops import alibi_attention, alibi_slopes

            inputs = self.sdpa_inputs
            slopes = alibi_slopes(self.shape[1])
            full = self.full_bias(causal_minus_inf=True) if bias == "materialised" else None

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


def time_variants(args) -> tuple[dict, float]:
    """The median step time per variant, and the median time of one in-place operator call."""
    bench = Bench(args)
    for variant in VARIANTS:
        bench.step(variant)()
    bench.operator_ms.clear()
    samples = {variant: [] for variant in VARIANTS}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            start = time.perf_counter()
            bench.step(variant)()
            samples[variant].append((time.perf_counter() - start) * 1e3)
    medians = {variant: statistics.median(times) for variant, times in samples.items()}
    return medians, statistics.median(bench.operator_ms)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def measure_memory_here(args) -> float:
    """Extra resident memory (MiB) of ``args.memory_of`` in this process: what the variant keeps (a
    materialised bias, Megatron's score buffer) plus the peak of one step after a warm-up step."""
    bench = Bench(args)
    before = _status_kib("VmRSS")
    run = bench.step(args.memory_of)
    run()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset VmHWM to the current resident size
    run()
    return (_status_kib("VmHWM") - before) / 1024


def measure_memory(args, variant) -> float:
    command = [sys.executable, os.path.abspath(__file__), "--memory-of", variant,
               "--batch", str(args.batch), "--heads", str(args.heads), "--seq", str(args.seq),
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

    medians, operator_ms = time_variants(args)
    memory = {variant: measure_memory(args, variant) for variant in VARIANTS}
    b, h, s, d = args.batch, args.heads, args.seq, args.head_dim
    print(f"attention forward+backward, b{b} h{h} s{s} d{d} fp32, causal, {torch.get_num_threads()} threads, "
          f"{args.repeats} steps per variant")
    print(f"{'variant':<22}{'median ms':>11}{'vs none':>9}{'MiB':>9}{'extra MiB':>11}")
    results = {}
    for variant in VARIANTS:
        baseline = variant.split("/")[0] + "/none"
        results[variant] = {
            "median_ms": round(medians[variant], 1),
            "time_vs_none": round(medians[variant] / medians[baseline], 3),
            "mib": round(memory[variant], 1),
            "extra_mib_vs_none": round(memory[variant] - memory[baseline], 1),
        }
        row = results[variant]
        print(f"{variant:<22}{row['median_ms']:>11.1f}{row['time_vs_none']:>9.3f}"
              f"{row['mib']:>9.1f}{row['extra_mib_vs_none']:>11.1f}")
    share = operator_ms / medians["local/none"]
    print(f"in-place operator alone: {operator_ms:.1f} ms per call, {share:.1%} of the local step without bias")
    results["local/alibi"]["operator_ms"] = round(operator_ms, 1)
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"shape": {"batch": b, "heads": h, "seq": s, "head_dim": d},
                       "threads": torch.get_num_threads(), "repeats": args.repeats, "results": results},
                      handle, indent=2)

if __name__ == "__main__":
    main()
