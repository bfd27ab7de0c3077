"""Benchmark of grouped MoE experts on the CPU (not a test).

    python bench/grouped_experts.py [--json bench/results/grouped_experts.json] [--reps 5] [--threads 2]
                                    [--warm-allocator]

One run measures, on ``--threads`` threads, forward + backward of a MoE layer's local experts and of the
whole layer (router, fused permutation, experts, unpermutation), at scaled-down shapes of three MoE models,
fp32 and bf16, SwiGLU experts without bias (as those models have) on the fused SwiGLU operator:

* ``grouped``: megatron-core's ``TEGroupedMLP`` on ascendspeed's grouped linears (``--moe-grouped-gemm``
  without Transformer Engine): two ``grouped_linear`` calls and one SwiGLU for all local experts;
* ``sequential``: megatron-core's ``SequentialMLP`` (what runs without the flag): a ``ColumnParallelLinear``,
  the activation and a ``RowParallelLinear`` per expert on ``torch.split`` pieces, concatenated.

Both get the same weights and tokens. Reported: medians of ``--reps`` interleaved rounds (one warm-up round
first), the sequential / grouped time ratio, the matmul rate the grouped experts reach (GFLOP/s of the six
products of forward and backward), and the activation memory each saves for backward (bytes of the tensors
autograd keeps, relative to the tokens' bytes). The machine (CPU model, vector flags, load) is recorded.
``--warm-allocator`` reruns with glibc keeping freed memory (bench/allocator.py): the grouped experts' large
intermediate tensors are otherwise fresh pages, zeroed by the kernel on first touch, at every step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from allocator import rerun_with_warm_allocator, warm_allocator_active  # noqa: E402
from harness import machine  # noqa: E402

#: name: (tokens, hidden, experts, top-k, expert ffn). Mixtral 8x7B: hidden 4096, 8 experts, top 2, ffn 14336;
#: DeepSeek-V3: hidden 7168, 256 experts, top 8, expert ffn 2048; Qwen3-30B-A3B: hidden 2048, 128 experts,
#: top 8, expert ffn 768. Scaled down to a 2-core machine, expert counts and top-k kept where they fit.
MODELS = {
    "Mixtral-like": (4096, 1024, 8, 2, 1792),
    "DeepSeek-V3-like": (4096, 1024, 64, 8, 256),
    "Qwen3-MoE-like": (4096, 512, 128, 8, 192),
}
QUICK_MODELS = {"quick": (128, 32, 8, 2, 16)}
DTYPES = ["float32", "bfloat16"]


def _setup():
    warnings.filterwarnings("ignore")
    import torch

    import ascendspeed.megatron_adaptor  # noqa: F401
    from megatron.core import parallel_state

    store = tempfile.mkdtemp()
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1)
    return torch


def _layers(torch, shape, dtype):
    import dataclasses

    import torch.nn.functional as F
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ascendspeed.features import enable_features

    tokens, hidden, experts, topk, ffn = shape
    enable_features(num_experts=experts, swiglu=True, use_fused_swiglu=True, moe_permute_fusion=True)
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn, num_attention_heads=8,
        num_moe_experts=experts, moe_router_topk=topk, moe_token_dispatcher_type="alltoall", add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=True, moe_permute_fusion=True,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, hidden_dropout=0.0,
    )
    layers = {}
    for name, grouped in (("grouped", True), ("sequential", False)):
        spec = get_moe_module_spec(use_te=grouped, num_experts=experts, moe_grouped_gemm=grouped)
        cfg = dataclasses.replace(config, moe_grouped_gemm=grouped)
        layer = build_module(spec, config=cfg) if isinstance(spec, ModuleSpec) else spec(config=cfg)
        layer.set_layer_number(1)
        layers[name] = layer
    with torch.no_grad():
        layers["grouped"].router.weight.copy_(layers["sequential"].router.weight)
        for index, expert in enumerate(layers["sequential"].experts.local_experts):
            getattr(layers["grouped"].experts.linear_fc1, f"weight{index}").copy_(expert.linear_fc1.weight)
            getattr(layers["grouped"].experts.linear_fc2, f"weight{index}").copy_(expert.linear_fc2.weight)
    return layers


def _saved_bytes(torch, fn) -> int:
    """Bytes of the distinct tensors autograd saves while ``fn`` runs."""
    seen = {}

    def pack(tensor):
        seen[(tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))] = \
            tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(seen.values())


def measure(torch, name, shape, dtype_name, reps):
    dtype = getattr(torch, dtype_name)
    tokens, hidden, experts, topk, ffn = shape
    layers = _layers(torch, shape, dtype)
    x = torch.randn(tokens, 1, hidden, dtype=dtype)
    grad = torch.randn_like(x)
    # the experts' own input: tokens in expert order, as the dispatcher hands them over
    counts = torch.multinomial(torch.ones(experts), tokens * topk, replacement=True).bincount(minlength=experts)
    rows = torch.randn(tokens * topk, hidden, dtype=dtype)
    probs = torch.rand(tokens * topk)
    row_grad = torch.randn_like(rows)

    def experts_step(layer):
        inp = rows.detach().requires_grad_(True)
        out, _ = layer.experts(inp, counts, probs)
        out.backward(row_grad)

    def layer_step(layer):
        inp = x.detach().requires_grad_(True)
        out, _ = layer(inp)
        out.backward(grad)

    seconds = {(part, impl): [] for part in ("experts", "layer") for impl in layers}
    for round_index in range(reps + 1):
        for impl, layer in layers.items():
            for part, step in (("experts", experts_step), ("layer", layer_step)):
                start = time.perf_counter()
                step(layer)
                if round_index:  # the first round warms up
                    seconds[part, impl].append(time.perf_counter() - start)
    medians = {f"{part} {impl}": statistics.median(values) for (part, impl), values in seconds.items()}
    flops = 6 * tokens * topk * (hidden * 2 * ffn + ffn * hidden)  # fc1 (gate and up) + fc2, forward + 2 backward
    token_bytes = rows.numel() * rows.element_size()
    saved = {impl: _saved_bytes(torch, lambda layer=layer: layer.experts(rows.detach().requires_grad_(True), counts,
                                                                         probs)) / token_bytes
             for impl, layer in layers.items()}
    return {
        "model": name, "dtype": dtype_name, "tokens": tokens, "hidden": hidden, "experts": experts, "topk": topk,
        "expert_ffn": ffn, "seconds": medians,
        "experts_speedup": medians["experts sequential"] / medians["experts grouped"],
        "layer_speedup": medians["layer sequential"] / medians["layer grouped"],
        "grouped_experts_gflops": flops / medians["experts grouped"] / 1e9,
        "saved_for_backward_per_token_byte": saved,
    }


def report(result) -> str:
    lines = [f"{result['benchmark']} on {result['machine']['cpu_model']}, {result['threads']} threads, "
             f"{'warm' if result['warm_allocator'] else 'default'} allocator "
             f"(load {result['load_before']:.2f} -> {result['load_after']:.2f})",
             "model             dtype     experts top-k  experts: seq/grouped  layer: seq/grouped  grouped GFLOP/s  "
             "saved (grouped, seq)"]
    for row in result["rows"]:
        s = row["seconds"]
        saved = row["saved_for_backward_per_token_byte"]
        lines.append(
            f"{row['model']:<17} {row['dtype']:<9} {row['experts']:>7} {row['topk']:>5}  "
            f"{s['experts sequential']:.3f}/{s['experts grouped']:.3f} s = {row['experts_speedup']:.2f}x  "
            f"{s['layer sequential']:.3f}/{s['layer grouped']:.3f} s = {row['layer_speedup']:.2f}x  "
            f"{row['grouped_experts_gflops']:>8.1f}  {saved['grouped']:.2f}, {saved['sequential']:.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="a small shape: check the script, not the speed")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=DTYPES,
                        help="bf16 only where the CPU has a bf16 GEMM (AVX-512 or AMX): torch's fallback is "
                             "orders of magnitude slower")
    parser.add_argument("--warm-allocator", action="store_true",
                        help="keep freed memory for reuse, as caching allocators do (see bench/allocator.py)")
    args = parser.parse_args()
    if args.warm_allocator:
        rerun_with_warm_allocator()
    torch = _setup()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    models = QUICK_MODELS if args.quick else MODELS
    rows = [measure(torch, name, shape, dtype, args.reps) for dtype in args.dtypes for name, shape in models.items()]
    result = {"benchmark": "MoE experts forward+backward: TEGroupedMLP on grouped_linear vs SequentialMLP",
              "machine": machine(torch), "threads": args.threads, "reps": args.reps,
              "warm_allocator": warm_allocator_active(), "load_before": load_before,
              "load_after": os.getloadavg()[0], "seconds": time.perf_counter() - started, "rows": rows}
    print(report(result))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
