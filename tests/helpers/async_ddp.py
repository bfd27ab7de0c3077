"""Rank bodies for the async DDP tests (run on spawned gloo ranks by ``run_distributed``)."""
from __future__ import annotations

import torch

HIDDEN = 16
LAYERS = 4


def setup_ascendspeed(**settings):
    """Install the adaptor and switch async DDP on in this (spawned) process."""
    import ascendspeed.megatron_adaptor  # noqa: F401
    from ascendspeed.features import disable_features, enable_features

    disable_features(["async_ddp"])
    args = enable_features(**settings)
    if recorder() is not None:
        recorder().log = None
    return args


def recorder():
    """The collective recorder of the applied async DDP feature (``--log-grad-reduce-overlap``), or None."""
    from ascendspeed.features import applied_features

    return next((applied.state for applied in applied_features() if applied.name == "async_ddp"), None)


def initialize_parallel(tp=1, pp=1, vpp=None):
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )


class SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: compute that the collectives already dispatched can hide behind."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import time

        time.sleep(ctx.seconds)
        return grad, None


class Net(torch.nn.Module):
    """Linear layers; ``frozen`` ones do not train, ``unused`` ones only join when ``use_unused`` is set.
    ``slow_backward_s`` makes the backward between the first and second layer take that long."""

    def __init__(self, frozen=(), unused=(), slow_backward_s=0.0):
        super().__init__()
        torch.manual_seed(1234)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS))
        self.unused = set(unused)
        self.use_unused = False
        self.slow_backward_s = slow_backward_s
        for index in frozen:
            for param in self.layers[index].parameters():
                param.requires_grad_(False)

    def forward(self, x):
        for index, layer in enumerate(self.layers):
            if index in self.unused and not self.use_unused:
                continue
            if index == 1 and self.slow_backward_s:
                x = SlowBackward.apply(x, self.slow_backward_s)
            x = torch.tanh(layer(x))
        return x


def transformer_config():
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, use_cpu_initialization=True)


def wrap_ddp(module, overlap, bucket_size=None, distributed_optimizer=False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap, bucket_size=bucket_size, use_distributed_optimizer=distributed_optimizer
    )
    return DistributedDataParallel(transformer_config(), ddp_config, module)


def batch(rank, step, rows=8):
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(rows, HIDDEN, generator=generator)


def loss_of(output):
    return output.pow(2).mean()


def reduced_gradients(rank, world_size, configs, steps=2):
    """For each config, the all-reduced main_grads of ``steps`` steps, plus a local reference.

    The reference is what a single process gets: the mean of every rank's gradients, computed here
    with plain autograd on every rank's batch.
    """
    initialize_parallel()
    results = {}
    for name, config in configs.items():
        net = Net(frozen=config.get("frozen", ()), unused=config.get("unused", ()),
                  slow_backward_s=config.get("slow_backward_s", 0.0))
        model = wrap_ddp(net, config["overlap"], config.get("bucket_size"))
        per_step = []
        for step in range(steps):
            net.use_unused = step in config.get("use_unused_at", ())
            model.zero_grad_buffer()
            backwards = config.get("backwards", 1)
            for _ in range(backwards):
                loss_of(model(batch(rank, step))).backward()
            model.finish_grad_sync()
            per_step.append({n: p.main_grad.clone() for n, p in net.named_parameters() if p.requires_grad})
        results[name] = {
            "grads": per_step,
            "buckets": len(model.bucket_groups),
            "telemetry": telemetry_summary(),
            "expected": {n: overlap_expectations(model).get(p) for n, p in net.named_parameters()},
        }
    reference = {}
    for name, config in configs.items():
        net = Net(frozen=config.get("frozen", ()), unused=config.get("unused", ()))
        per_step = []
        for step in range(steps):
            net.use_unused = step in config.get("use_unused_at", ())
            grads = {}
            for source in range(world_size):
                net.zero_grad()
                for _ in range(config.get("backwards", 1)):
                    loss_of(net(batch(source, step))).backward()
                for n, p in net.named_parameters():
                    if p.requires_grad:
                        g = p.grad if p.grad is not None else torch.zeros_like(p)
                        grads[n] = grads.get(n, 0) + g / world_size
            per_step.append(grads)
        reference[name] = per_step
    return {"results": results, "reference": reference}


def overlap_expectations(model):
    """How many gradients per step each parameter's bucket group waits for (learnt by async DDP)."""
    from ascendspeed.features.async_ddp.state import overlap_state

    expected = {}
    for group in model.bucket_groups:
        expected.update(overlap_state(group).expected or {})
    return expected


def two_rank_checks(rank, world_size, gradient_configs, training_configs):
    setup_ascendspeed(overlap_grad_reduce=True, log_grad_reduce_overlap=True)
    return {
        "gradients": reduced_gradients(rank, world_size, gradient_configs, steps=3),
        "training": train_with_optimizer(rank, world_size, training_configs),
    }


def telemetry_summary():
    telemetry = recorder()
    telemetry.end_iteration()
    out = [
        {
            "compute_end": r.compute_end,
            "buckets": [(b.label, b.kind, b.ready, b.start, b.end) for b in r.buckets],
            "summary": r.summary(),
        }
        for r in telemetry.records()
    ]
    telemetry.history.clear()
    return out


def train_with_optimizer(rank, world_size, configs, steps=3):
    """Several optimizer steps per config; returns each rank's final parameters and losses."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    initialize_parallel()
    results = {}
    for name, config in configs.items():
        net = Net()
        model = wrap_ddp(net, config["overlap"], config.get("bucket_size"), config["distributed_optimizer"])
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=config["distributed_optimizer"],
                            clip_grad=0.0),
            [model],
        )
        losses = []
        for step in range(steps):
            model.zero_grad_buffer()
            optimizer.zero_grad()
            loss = loss_of(model(batch(rank, step)))
            loss.backward()
            model.finish_grad_sync()
            optimizer.step()
            losses.append(loss.item())
        results[name] = {
            "params": {n: p.detach().clone() for n, p in net.named_parameters()},
            "losses": losses,
        }
    return results


def pipeline_training(rank, world_size, layouts, steps=3, global_batch=16):
    """Train a tiny GPT for ``steps`` steps in each layout; per layout return the parameters (full names),
    the bucket count of each chunk and the telemetry of every step."""
    from tests.helpers import megatron as mu

    shape = mu.TinyGPT(num_layers=4)
    mu.initialize_parallel()
    full = mu.full_parameters(mu.build_gpt_model(shape.config(), shape))
    mu.destroy_parallel()
    results = {}
    for name, layout in layouts.items():
        setup_ascendspeed(overlap_grad_reduce=layout["overlap"], log_grad_reduce_overlap=True,
                          overlap_grad_reduce_all_stages=layout.get("all_stages", True))
        mu.initialize_parallel(pp=layout.get("pp", 1), vpp=layout.get("vpp"))
        chunks = mu.build_model_chunks(shape.config(), shape)
        mu.load_full_parameters(chunks, full)
        model = mu.wrap_ddp(chunks, use_distributed_optimizer=layout.get("distributed_optimizer", False),
                            overlap_grad_reduce=layout["overlap"], bucket_size=layout.get("bucket_size"))
        if layout.get("align_grad_reduce"):
            syncs = [chunk.start_grad_sync for chunk in model]
            mu.unwrap(model[0]).config.grad_sync_func = syncs if len(syncs) > 1 else syncs[0]
        optimizer = mu.make_optimizer(model, lr=1e-2, adam_eps=1e-3)  # eps: near-zero grads must not flip
        for step in range(steps):
            batch = mu.data_parallel_slice(mu.make_batch(shape, batch_size=global_batch, seed=step))
            mu.train_step(model, optimizer, batch, shape)
        from megatron.core import parallel_state

        results[name] = {
            "params": {n: p.detach().clone() for n, p in mu.named_parameters_full(model)},
            "buckets": [len(chunk.bucket_groups) for chunk in model],
            "telemetry": telemetry_summary(),
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "dp_rank": parallel_state.get_data_parallel_rank(),
        }
        mu.destroy_parallel()
    return results
