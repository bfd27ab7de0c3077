"""Optimizer state across a change of precision on resume (``--bf16`` / ``--fp16`` added or dropped).

megatron-core stores the state of each optimizer its own way, and each loader reads only its own: an fp32
checkpoint has no ``optimizer`` key for a bf16 run (``KeyError``), a bf16 one no ``state`` for an fp32
run, and a distributed optimizer's buckets are keyed by their dtypes (an ``AssertionError`` on the
bucket sizes). What they hold is the same: Adam's moments and an fp32 main weight per parameter (in an
fp32 run the weight itself). So a change of precision continues exactly: the fp32 main weights and the
moments carry over unchanged; a 16-bit model starts from their rounding, as after any of its steps.
``--reuse-fp32-param`` stores plain fp32 main weights in checkpoints, so it changes nothing here.
"""
from __future__ import annotations

from typing import Optional

from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from ascendspeed.training.model import unwrap


class ConversionError(ValueError):
    """The saved optimizer state does not fit this run's optimizer; the message says why."""


def parts(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_mixed(part) -> bool:
    """megatron-core's ``Float16OptimizerWithFloat16Params`` (with or without ``--reuse-fp32-param``)."""
    return hasattr(part, "float16_groups")


def _names(model: list) -> dict[int, tuple[int, str]]:
    """Each parameter's (model chunk, state-dict key)."""
    return {id(param): (index, name) for index, chunk in enumerate(model)
            for name, param in unwrap(chunk).named_parameters()}


def _only_local_part(optimizer):
    local = [part for part in parts(optimizer) if not isinstance(part, DistributedOptimizer)]
    if len(local) != 1 or len(parts(optimizer)) != 1:
        raise ConversionError(f"this run has {len(parts(optimizer))} optimizers; only one converts")
    return local[0]


def _saved_is_mixed(saved) -> bool:
    return isinstance(saved, dict) and "fp32_from_fp16_params" in saved


def convert_local(saved, model_states: list[dict], optimizer, model: list) -> Optional[dict]:
    """Make the saved state of a non-distributed optimizer loadable by this run's; returns it, or None when
    it already fits. A mixed-precision checkpoint loaded in fp32 also puts its fp32 main weights into
    ``model_states`` (the model's own saved weights are their 16-bit rounding)."""
    part = _only_local_part(optimizer)
    names = _names(model)
    if _is_mixed(part) and not _saved_is_mixed(saved):
        if "state" not in saved:
            raise ConversionError("the checkpoint's optimizer state is neither fp32 nor mixed precision")
        main = []
        for group in part.float16_groups:
            weights = []
            for param in group:
                chunk, name = names[id(param)]
                weight = model_states[chunk][name]
                if weight.shape != param.shape:
                    raise ConversionError(f"{name}: checkpoint {tuple(weight.shape)}, model {tuple(param.shape)}")
                weights.append(weight.float())
            main.append(weights)
        return {"optimizer": saved, "fp32_from_fp16_params": main}
    if not _is_mixed(part) and _saved_is_mixed(saved):
        groups = part.optimizer.param_groups
        main = saved["fp32_from_fp16_params"]
        if len(main) != len(groups) or any(len(m) != len(g["params"]) for m, g in zip(main, groups)):
            raise ConversionError("the checkpoint's parameter groups differ from this run's")
        for weights, group in zip(main, groups):
            for weight, param in zip(weights, group["params"]):
                chunk, name = names[id(param)]
                if weight.shape != param.shape:
                    raise ConversionError(f"{name}: checkpoint {tuple(weight.shape)}, model {tuple(param.shape)}")
                model_states[chunk][name] = weight
        return saved["optimizer"]
    return None


def _single_key(mapping: dict, what: str):
    keys = list(mapping)
    if len(keys) != 1:
        raise ConversionError(f"{what} holds {len(keys)} dtypes; only one converts")
    return keys[0]


def retag_distributed(saved_states: list[dict], optimizer) -> bool:
    """A distributed optimizer keys its per-bucket state by (parameter dtype, gradient dtype), which a
    precision change changes while the fp32 main weights and moments inside stay the same: key the saved
    state by this run's dtypes. Returns whether anything was re-keyed; raises ``ConversionError`` when the
    buckets themselves differ."""
    distributed = [part for part in parts(optimizer) if isinstance(part, DistributedOptimizer)]
    changed = False
    for part, state in zip(distributed, saved_states, strict=True):
        for index, ranges in enumerate(part.gbuf_ranges):
            current = _single_key(ranges, "a gradient buffer")
            saved_key = _single_key(state[index], "a saved gradient buffer")
            if saved_key != current:
                state[index] = {current: state[index][saved_key]}
                changed = True
        for field in ("per_bucket_numel", "per_bucket_numel_unpadded"):
            if field in state:
                state[field] = [{_single_key(mine, "a gradient buffer"): next(iter(theirs.values()))}
                                for mine, theirs in zip(getattr(part, field), state[field], strict=True)]
        saved_sizes = [next(iter(entry.values())) for entry in state.get("per_bucket_numel_unpadded", [])]
        sizes = [next(iter(entry.values())) for entry in part.per_bucket_numel_unpadded]
        if saved_sizes and saved_sizes != sizes:
            raise ConversionError(f"the distributed optimizer's gradient buckets hold {saved_sizes} elements in the "
                                  f"checkpoint and {sizes} in this run (--ddp-bucket-size and the model decide them)")
    return changed


def gather_parameters(model: list) -> None:
    """After a distributed optimizer loaded its shard of the main weights into an fp32 model (whose shard is
    a view of the weights), every rank's weights take every shard's values, as after a step."""
    for chunk in model:
        chunk.start_param_sync(force_sync=True)


def main_weights_into(saved, model_states: list[dict], model: list, optimizer) -> None:
    """Without the optimizer state (``--no-load-optim``), an fp32 run still takes a mixed-precision
    checkpoint's fp32 main weights rather than their 16-bit rounding."""
    part = _only_local_part(optimizer)
    if not _is_mixed(part) and _saved_is_mixed(saved):
        convert_local(saved, model_states, optimizer, model)


__all__ = ["ConversionError", "convert_local", "gather_parameters", "main_weights_into", "parts",
           "retag_distributed"]
