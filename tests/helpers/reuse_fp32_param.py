"""Workers for the ``--reuse-fp32-param`` tests: the same bf16 training with and without the feature."""
from __future__ import annotations

import torch

from tests.helpers.megatron import (
    TinyGPT,
    build_gpt_model,
    data_parallel_slice,
    destroy_parallel,
    initialize_parallel,
    make_batch,
    make_optimizer,
    train_step,
    wrap_ddp,
)


def optimizer_parts(optimizer):
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def main_weights(optimizer) -> list[torch.Tensor]:
    """This rank's fp32 main weights, exact copies, in a fixed order (what checkpoints hold)."""
    weights = []
    for part in optimizer_parts(optimizer):
        if hasattr(part, "get_parameter_state_dp_reshardable"):
            state = part.get_parameter_state_dp_reshardable()
            for key in sorted(k for k in state if isinstance(k, int)):
                for buckets in state[key].values():
                    for bucket in buckets:
                        weights += [entry["param"].detach().clone().reshape(-1) for entry in bucket]
        else:
            for group in part.state_dict()["fp32_from_fp16_params"]:
                weights += [main.detach().clone().reshape(-1) for main in group]
    return weights


def model_weights(chunks) -> list[torch.Tensor]:
    return [param.detach().clone().reshape(-1) for chunk in chunks for param in chunk.parameters()]


def bits(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1).view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).to(torch.int64)
                      for t in tensors])


def _shares_model_memory(chunks, optimizer) -> bool:
    """Every main weight the inner optimizer updates lies in the storage of a model weight."""
    model_storages = {p.untyped_storage().data_ptr() for chunk in chunks for p in chunk.parameters()}
    mains = [p for part in optimizer_parts(optimizer) for g in part.optimizer.param_groups for p in g["params"]]
    return bool(mains) and all(p.untyped_storage().data_ptr() in model_storages for p in mains)


def train(distributed_optimizer: bool, reuse: bool, steps: int, shape: TinyGPT, lr: float = 1e-2):
    """Train ``steps`` Adam steps; returns losses and, per step, the bits of the main and model weights."""
    from ascendspeed.features import enable_features
    from ascendspeed.patching import PatchManager

    manager = PatchManager()
    if reuse:
        # The reference runs Megatron's own attention: compare with it, not with fused attention.
        enable_features(manager=manager, bf16=True, reuse_fp32_param=True,
                        use_distributed_optimizer=distributed_optimizer, attention_backend="unfused")
    try:
        initialize_parallel()
        config = shape.config(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
        chunks = wrap_ddp([build_gpt_model(config, shape)], use_distributed_optimizer=distributed_optimizer)
        optimizer = make_optimizer(chunks, lr=lr, weight_decay=0.1, clip_grad=1.0)
        state = [getattr(part, "reuse_fp32_param", None) for part in optimizer_parts(optimizer)]
        shared = reuse and all(s is not None for s in state) and _shares_model_memory(chunks, optimizer)
        ties = 0
        losses, mains, models = [], [], []
        for step in range(steps):
            batch = data_parallel_slice(make_batch(shape, batch_size=8, seed=step))
            step_losses = train_step(chunks, optimizer, batch, shape)
            losses.append(torch.stack(step_losses).double().mean().item())
            mains.append(bits(main_weights(optimizer)))
            models.append(bits(model_weights(chunks)))
            ties += sum(unit.ties.numel() for s in state if s is not None for unit in s.units)
        return losses, mains, models, shared, ties
    finally:
        destroy_parallel()
        manager.revert()


def exactness_worker(rank, world_size, distributed_optimizer, steps):
    shape = TinyGPT(hidden_size=64, vocab_size=128)
    reference = train(distributed_optimizer, False, steps, shape)
    reused = train(distributed_optimizer, True, steps, shape)
    report = {"steps": steps, "losses": (reference[0], reused[0])}
    for name, index in (("main", 1), ("model", 2)):
        report[name] = [int((a != b).sum()) for a, b in zip(reference[index], reused[index], strict=True)]
    report["elements"] = int(reference[1][0].numel())
    report["shared"], report["ties"] = reused[3], reused[4]
    return report
