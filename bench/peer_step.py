"""The entry's training step against the same model written in plain PyTorch (issue 28).

    python bench/peer_step.py [--sizes small large] [--dtypes fp32 bf16] [--configs megatron_defaults default_job]
                              [--rounds 24 --steps 1 --profile-steps 4] [--table ROWS] [--output FILE.json]

Per size, dtype and entry configuration, one 2-rank gloo job (one thread per rank) builds both:

* the entry's model, optimizer and step exactly as ``ascendspeed.training.pretrain_gpt`` trains them
  (``Trainer.train_step``: Megatron's GPTModel, DDP, optimizer, clipping, schedule), with Megatron's
  defaults (``--position-embedding-type learned_absolute --no-swiglu --no-overlap-grad-reduce``) or the
  default job (ALiBi, fused SwiGLU with its default width, ``--overlap-grad-reduce``);
* the peer: the same architecture in plain PyTorch, nanoGPT style: ``nn.Embedding`` for tokens and learned
  positions, pre-norm blocks of ``nn.LayerNorm``, a fused-QKV ``nn.Linear``, torch's causal
  ``scaled_dot_product_attention``, a GeLU MLP, the output layer tied to the embedding, ``F.cross_entropy``,
  ``DistributedDataParallel`` over gloo, ``clip_grad_norm_`` and ``torch.optim.AdamW`` with the entry's
  hyper-parameters; bf16 is ``torch.autocast`` over fp32 parameters. Same batches, same parameter count.

The two alternate in blocks of ``--steps`` steps for ``--rounds`` rounds (machine noise hits both alike; one
step per block, the default, keeps the ratio within a few per cent between runs on a shared machine, where
blocks of 4-6 steps moved it by up to 30 %);
throughput is tokens per second over all ranks from the median step time. The paired ratio is the median over
rounds of the peer's block time over the entry's adjacent block: a machine whose speed drifts during the run
(a shared host's neighbours) moves both blocks of a round alike, so it moves less between runs.
``--compiled-bias-dropout-add`` adds a third block per round (the rotation shifts by one each round): the
entry's step with Megatron's compiled bias-dropout-add put back, an A/B of that CPU shim in one process.
Then ``--profile-steps`` steps of each under torch.profiler give the per-phase breakdown (milliseconds per step, rank 0): forward,
backward, gradient reduction (collectives, and Megatron's ``finalize_model_grads``), optimizer (clipping
included) and the rest (data, zeroing, the loss all-reduce, Python between phases).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import finish_results, machine, run_on_gloo_ranks  # noqa: E402

SIZES = {
    "small": ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
              "--micro-batch-size", "8"],
    "large": ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "256",
              "--micro-batch-size", "4"],
}
#: The entry's configurations. Both leave --ffn-hidden-size at its default: 4 x hidden for the GeLU MLP
#: (the peer's), 2/3 of that rounded down to a multiple of 64 for SwiGLU (fewer parameters in all).
CONFIGS = {
    "megatron_defaults": ["--position-embedding-type", "learned_absolute", "--no-swiglu", "--no-overlap-grad-reduce"],
    "default_job": [],
}
DTYPES = {"fp32": [], "bf16": ["--bf16"]}
PHASES = ("forward", "backward", "grad_reduce", "optimizer", "rest")
#: The entry's step with Megatron's compiled bias-dropout-add (``--compiled-bias-dropout-add``).
COMPILED_BDA = "entry_compiled_bias_dropout_add"
COLLECTIVE_MARKERS = ("allreduce", "all_reduce", "c10d::", "gloo:", "reduce_scatter", "allgather", "all_gather")


def build_peer(args, vocab_size: int):
    """The plain-PyTorch GPT of ``args`` (the entry's parsed flags), wrapped in DDP, and its optimizer."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            hidden, heads = args.hidden_size, args.num_attention_heads
            self.heads = heads
            self.norm1 = nn.LayerNorm(hidden, eps=args.norm_epsilon)
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.proj = nn.Linear(hidden, hidden)
            self.norm2 = nn.LayerNorm(hidden, eps=args.norm_epsilon)
            self.fc1 = nn.Linear(hidden, args.ffn_hidden_size)
            self.fc2 = nn.Linear(args.ffn_hidden_size, hidden)

        def forward(self, x):
            batch, length, hidden = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(attention.transpose(1, 2).reshape(batch, length, hidden))
            return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(vocab_size, args.hidden_size)
            self.positions = nn.Embedding(args.seq_length, args.hidden_size)
            self.blocks = nn.ModuleList(Block() for _ in range(args.num_layers))
            self.norm = nn.LayerNorm(args.hidden_size, eps=args.norm_epsilon)
            for parameter in self.parameters():
                if parameter.dim() > 1:
                    nn.init.normal_(parameter, std=args.init_method_std)

        def forward(self, tokens, labels):
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.tokens(tokens) + self.positions(positions)
            for block in self.blocks:
                x = block(x)
            logits = F.linear(self.norm(x), self.tokens.weight)
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    model = torch.nn.parallel.DistributedDataParallel(GPT())
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
    return model, optimizer


class PeerStep:
    """One step of the peer on the entry's batches: forward, loss, backward (DDP reduces), clip, AdamW."""

    def __init__(self, trainer, model, optimizer, dtype):
        self.trainer, self.model, self.optimizer, self.dtype = trainer, model, optimizer, dtype
        self.iteration = 0

    def __call__(self):
        import torch
        from megatron.core import parallel_state
        from ascendspeed.training.data import train_microbatches

        args = self.trainer.args
        batches = train_microbatches(
            self.trainer.splits.train, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            num_microbatches=args.num_microbatches, data_parallel_rank=parallel_state.get_data_parallel_rank(),
            data_parallel_size=parallel_state.get_data_parallel_world_size(), seed=args.seed,
            iteration=self.iteration, device=self.trainer.device)
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autograd.profiler.record_function("phase:forward_backward"):
            for index, batch in enumerate(batches):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.dtype == "bf16"):
                    loss = self.model(batch.tokens, batch.labels) / len(batches)
                if index < len(batches) - 1:
                    with self.model.no_sync():
                        loss.backward()
                else:
                    loss.backward()
        with torch.autograd.profiler.record_function("phase:optimizer"):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.clip_grad)
            self.optimizer.step()
        self.iteration += 1


def instrument_entry(trainer):
    """Name the entry's phases for the profiler: its schedule call, Megatron's finalize_model_grads and the
    optimizer step (instance attributes only; nothing global is patched)."""
    import torch

    def ranged(name, function):
        def call(*args, **kwargs):
            with torch.autograd.profiler.record_function(name):
                return function(*args, **kwargs)
        return call

    trainer.forward_backward = ranged("phase:forward_backward", trainer.forward_backward)
    trainer.config.finalize_model_grads_func = ranged("phase:finalize_model_grads",
                                                      trainer.config.finalize_model_grads_func)
    trainer.optimizer.step = ranged("phase:optimizer", trainer.optimizer.step)


def paired_ratio(peer: list[float], entry: list[float], steps: int) -> float:
    """The median over rounds of the peer's block time over the entry's block of the same round."""
    return statistics.median(sum(peer[start:start + steps]) / sum(entry[start:start + steps])
                             for start in range(0, len(entry), steps))


def _is_collective(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in COLLECTIVE_MARKERS)


def phase_breakdown(profile, steps: int) -> dict[str, float]:
    """Milliseconds per step of each phase, from the profiler's events of this thread: forward-backward
    minus the autograd engine's top-level backward functions is forward; collectives anywhere outside the
    optimizer (and Megatron's finalize_model_grads) are gradient reduction."""
    events = [event for event in profile.events() if event.device_type.name == "CPU"]
    main_thread = next(event.thread for event in events if event.name == "phase:step")
    events = [event for event in events if event.thread == main_thread]

    def inside(event, names):
        parent = event.cpu_parent
        while parent is not None:
            if parent.name in names:
                return True
            parent = parent.cpu_parent
        return False

    def total(selected):
        return sum(event.time_range.elapsed_us() for event in selected) / 1e3 / steps

    step = total(e for e in events if e.name == "phase:step")
    forward_backward = total(e for e in events if e.name == "phase:forward_backward")
    optimizer = total(e for e in events if e.name == "phase:optimizer")
    finalize = total(e for e in events if e.name == "phase:finalize_model_grads")
    backward_functions = [e for e in events if e.name.startswith("autograd::engine::evaluate_function")
                          and not inside(e, {"phase:finalize_model_grads"})
                          and not any(p.name.startswith("autograd::engine::evaluate_function")
                                      for p in _ancestors(e))]
    collectives = [e for e in events if _is_collective(e.name)
                   and not any(_is_collective(p.name) for p in _ancestors(e))
                   and not inside(e, {"phase:optimizer", "phase:finalize_model_grads"})]
    in_backward = total(e for e in collectives if inside(e, {n.name for n in backward_functions}))
    collective = total(collectives)
    backward = total(backward_functions) - in_backward
    grad_reduce = finalize + collective
    forward = forward_backward - finalize - backward - collective
    return {"forward": forward, "backward": backward, "grad_reduce": grad_reduce, "optimizer": optimizer,
            "rest": step - forward_backward - optimizer, "step": step}


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def with_compiled_bias_dropout_add(step):
    """``step`` with Megatron's compiled fused bias-dropout-add, which the adaptor replaces on CPU tensors by
    the eager function it compiles (``ascendspeed/accelerator/cpu_fusions.py``), put back for its duration."""
    from megatron.core.fusions import fused_bias_dropout

    eager = fused_bias_dropout.bias_dropout_add_fused_train

    def compiled_step():
        fused_bias_dropout.bias_dropout_add_fused_train = eager.__wrapped__
        try:
            step()
        finally:
            fused_bias_dropout.bias_dropout_add_fused_train = eager

    return compiled_step


def worker(rank: int, world_size: int, flags: list[str], dtype: str, rounds: int, steps: int, profile_steps: int,
           table_rows: int, compiled_bias_dropout_add: bool = False):
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from ascendspeed.adaptor import install

    install()
    from ascendspeed.features import apply_features
    from ascendspeed.training.arguments import parse_args
    from ascendspeed.training.data import padded_vocab_size
    from ascendspeed.training.initialize import initialize_parallel, set_seed
    from ascendspeed.training.trainer import Trainer

    args = parse_args(["--distributed-backend", "gloo", "--eval-iters", "1", *flags])
    apply_features(args)
    state = initialize_parallel(args)
    trainer = Trainer(args, state.device)
    set_seed(args.seed)
    peer_args = parse_args(["--no-swiglu", *flags])  # the peer is always Megatron's default architecture
    peer_model, peer_optimizer = build_peer(peer_args, padded_vocab_size(256, args.make_vocab_size_divisible_by, 1))
    peer = PeerStep(trainer, peer_model, peer_optimizer, dtype)
    entry_step = trainer.train_step
    counts = {"entry": trainer.num_parameters(), "peer": sum(p.numel() for p in peer_model.parameters())}

    def timed_block(step):
        dist.barrier()
        seconds = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
        return seconds

    contestants = {"entry": entry_step, "peer": peer}
    if compiled_bias_dropout_add:
        contestants[COMPILED_BDA] = with_compiled_bias_dropout_add(entry_step)
    times = {name: [] for name in contestants}
    for step in contestants.values():
        timed_block(step)  # warm-up: allocator, first-call paths, compilation
    names = list(contestants)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name] += timed_block(contestants[name])
    instrument_entry(trainer)
    phases = {}
    for name, step in (("entry", trainer.train_step), ("peer", peer)):
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            for _ in range(profile_steps):
                with torch.autograd.profiler.record_function("phase:step"):
                    step()
        phases[name] = phase_breakdown(profiler, profile_steps)
        if table_rows and rank == 0:
            print(f"==== {name}\n" + profiler.key_averages().table(sort_by="self_cpu_time_total",
                                                                     row_limit=table_rows), flush=True)
    tokens = args.global_batch_size * args.seq_length
    return {
        "parameters": counts,
        "tokens_per_step": tokens,
        "median_step_s": {name: statistics.median(seconds) for name, seconds in times.items()},
        "entry_over_peer_paired": paired_ratio(times["peer"], times["entry"], steps),
        **({"compiled_bias_dropout_add_over_peer_paired": paired_ratio(times["peer"], times[COMPILED_BDA], steps)}
           if compiled_bias_dropout_add else {}),
        "tokens_per_s": {name: tokens / statistics.median(seconds) for name, seconds in times.items()},
        "phases_ms": phases,
        "threads": torch.get_num_threads(),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--steps", type=int, default=1, help="steps per timed block")
    parser.add_argument("--profile-steps", type=int, default=4)
    parser.add_argument("--table", type=int, default=0, metavar="ROWS",
                        help="also print rank 0's profiled operators, the ROWS most expensive (self CPU time)")
    parser.add_argument("--compiled-bias-dropout-add", action="store_true",
                        help="also time the entry's step with Megatron's compiled bias-dropout-add in each round "
                             "(the adaptor runs the eager function on a CPU) and report its paired ratio")
    parser.add_argument("--output", help="write the results as JSON here")
    options = parser.parse_args(argv)
    import torch

    results = {"machine": machine(torch), "ranks": 2, "runs": []}
    for size in options.sizes:
        for dtype in options.dtypes:
            for config in options.configs:
                flags = SIZES[size] + CONFIGS[config] + DTYPES[dtype]
                result = run_on_gloo_ranks(worker, 2, flags, dtype, options.rounds, options.steps,
                                           options.profile_steps, options.table, options.compiled_bias_dropout_add)
                ratio = result["tokens_per_s"]["entry"] / result["tokens_per_s"]["peer"]
                result |= {"size": size, "dtype": dtype, "config": config, "entry_over_peer": ratio}
                results["runs"].append(result)
                print(f"{size:5s} {dtype} {config:17s} entry {result['tokens_per_s']['entry']:9,.0f} tok/s  "
                      f"peer {result['tokens_per_s']['peer']:9,.0f} tok/s  entry/peer {ratio:.3f} "
                      f"(paired {result['entry_over_peer_paired']:.3f}"
                      + (f"; compiled bias-dropout-add {result['compiled_bias_dropout_add_over_peer_paired']:.3f}"
                         if options.compiled_bias_dropout_add else "") + ")  "
                      f"(parameters {result['parameters']['entry']:,} / {result['parameters']['peer']:,})",
                      flush=True)
                for name in ("entry", "peer"):
                    phases = result["phases_ms"][name]
                    print(f"      {name:5s} ms/step: " + "  ".join(f"{phase} {phases[phase]:7.2f}"
                                                                 for phase in (*PHASES, "step")), flush=True)
    return finish_results(results, options.output)


if __name__ == "__main__":
    main()
