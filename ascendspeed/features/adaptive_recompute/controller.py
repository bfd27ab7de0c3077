"""Adaptive recompute while training: profile the first steps, choose the plan, apply it, report.

Profiling steps run every layer of the rank with one option at a time (none, core attention, core attention
and MLP, full), cycling, and record per layer the activation bytes it keeps (``account.SavedTensorAccount``)
and the forward seconds of the layer, its core attention and its MLP (the recompute cost of each option).
After the last profiling step the plan is solved (``solver.solve``) against

    budget = static + other + in-flight units x plan's layer bytes + transient

where static is the rank's parameters, gradients and optimizer state (``training.memory.account``), other
the activations outside the layers, measured in the no-recompute steps as the step's peak less the layers'
share, and transient one layer's activations re-materialised during its backward. The step after applies the
plan and is measured; its measured peak is printed beside the predicted one.

Where the device's allocator has statistics (CUDA, NPU) the step's peak is its ``max_memory_allocated``; on
the CPU it is static plus the peak of the saved-tensor account.
"""
from __future__ import annotations

import math
import weakref
from typing import Optional

import torch

from ascendspeed.features.adaptive_recompute import solver
from ascendspeed.features.adaptive_recompute.account import ModuleProbe, SavedTensorAccount
from ascendspeed.features.base import FeatureArgumentError
from ascendspeed.features.timing import max_over_ranks

MIB = 2**20
PROFILED_OPTIONS = (solver.NONE, solver.ATTENTION, solver.ATTENTION_MLP, solver.FULL)


class AdaptiveRecomputeError(FeatureArgumentError):
    """The budget cannot be met, found at the end of profiling."""


def transformer_blocks(model_chunks) -> list:
    from megatron.core.transformer.transformer_block import TransformerBlock

    return [module for chunk in model_chunks for module in chunk.modules() if isinstance(module, TransformerBlock)]


def mlp_recompute_supported(layer) -> bool:
    """Whether megatron-core can checkpoint this layer's MLP. A dense MLP whose fc2 returns its bias for a
    later fused add (``skip_bias_add``, linear biases on) hands the bias parameter out of the checkpoint, and
    backward then re-enters the checkpoint without end (megatron-core 0.15-0.19 on torch 2.13)."""
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        return False
    if hasattr(mlp, "moe_layer_recompute") or hasattr(layer, "moe_layer_recompute"):
        return True
    fc2 = getattr(mlp, "linear_fc2", None)
    return not (fc2 is not None and getattr(fc2, "skip_bias_add", False) and getattr(fc2, "bias", None) is not None)


def set_layer_option(layer, option: str) -> None:
    """The selective part of ``option`` on one layer (full recompute is set on the block's config)."""
    attention = getattr(layer, "self_attention", None)
    if attention is not None and hasattr(attention, "checkpoint_core_attention"):
        attention.checkpoint_core_attention = option in (solver.ATTENTION, solver.ATTENTION_MLP)
    mlp_flag = option == solver.ATTENTION_MLP and mlp_recompute_supported(layer)
    moe_targets = [target for target in (layer, getattr(layer, "mlp", None))
                   if target is not None and hasattr(target, "moe_layer_recompute")]
    if moe_targets:
        for target in moe_targets:
            target.moe_layer_recompute = mlp_flag
    elif hasattr(layer, "recompute_mlp"):
        layer.recompute_mlp = mlp_flag


def apply_options(blocks, options_per_block) -> None:
    """Per block a list of per-layer options whose ``full`` ones are its first layers; the config (shared by
    the rank's blocks) gets Megatron's block-wise full recompute of that many layers."""
    full = {options.count(solver.FULL) for options in options_per_block}
    if len(full) != 1:
        raise ValueError(f"every model chunk must recompute the same number of full layers, got {sorted(full)}")
    full = full.pop()
    config = blocks[0].config
    if full:
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "block", full
    else:
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = None, None, None
    for block, options in zip(blocks, options_per_block):
        for layer, option in zip(block.layers, options):
            set_layer_option(layer, solver.NONE if option == solver.FULL else option)


def units_in_flight(schedule_name: str, num_microbatches: int) -> int:
    """Micro-batches whose activations a rank holds at once under ``schedule_name`` (1F1B: the first stage
    holds the most; interleaved: chunk micro-batches, expressed in whole-rank units)."""
    from megatron.core import parallel_state

    if schedule_name == "forward_backward_no_pipelining":
        return 1
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    if schedule_name == "forward_backward_pipelining_without_interleaving":
        return max(1, min(pp - rank, num_microbatches))
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    chunk_microbatches = min((pp - rank - 1) * 2 + (vpp - 1) * pp + 1, num_microbatches * vpp)
    return max(1, math.ceil(chunk_microbatches / vpp))


def device_allocator():
    """``torch.cuda`` / ``torch.npu`` where the device has a caching allocator, None on the CPU."""
    from ascendspeed.accelerator import device_type

    kind = device_type()
    return None if kind == "cpu" else getattr(torch, kind)


def _over_ranks_max(minimum: int, refused: bool) -> tuple[int, bool]:
    """The largest minimum over all ranks and whether any rank cannot meet the budget: every rank stops
    together, or the others would wait for it in their next collective."""
    worst, any_refused = max_over_ranks([minimum, refused])
    return int(worst), bool(any_refused)


def _print_on_rank(line: str) -> None:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    print(f"[adaptive-recompute rank {rank}] {line}", flush=True)


class AdaptiveRecompute:
    """One application of the feature: counts training steps, profiles, plans, applies."""

    def __init__(self, budget_mib: int, profiling_steps: int):
        self.budget_bytes = budget_mib * MIB
        self.profiling_steps = profiling_steps
        self.step = 0
        self.optimizer_ref = None
        self.samples = {option: [] for option in PROFILED_OPTIONS}
        self.peaks = {option: [] for option in PROFILED_OPTIONS}
        self.plan: Optional[solver.Plan] = None
        self.predicted_peak: Optional[int] = None
        self.measured_peak: Optional[int] = None
        self.minimum_bytes: Optional[int] = None
        self.none_peak_bytes: Optional[int] = None
        self.units: Optional[int] = None

    def remember_optimizer(self, optimizer) -> None:
        self.optimizer_ref = weakref.ref(optimizer)

    # -- one training step ---------------------------------------------------------------------------
    def run(self, schedule_name: str, run_step, model_chunks, num_microbatches: int):
        self.step += 1
        if self.step > self.profiling_steps + 1:
            return run_step()
        blocks = transformer_blocks(model_chunks)
        if not blocks:
            raise AdaptiveRecomputeError(
                "--adaptive-recompute-device-size plans recompute per transformer layer, and this model has no "
                "megatron-core TransformerBlock (hybrid and legacy models are not supported): drop the flag")
        measuring_plan = self.step == self.profiling_steps + 1
        option = None if measuring_plan else PROFILED_OPTIONS[(self.step - 1) % len(PROFILED_OPTIONS)]
        if option is not None:
            apply_options(blocks, [[option] * len(block.layers) for block in blocks])
        layers = {(b, i): layer for b, block in enumerate(blocks) for i, layer in enumerate(block.layers)}
        probes = dict(layers)
        probes.update({(b, i, "attention"): layer.self_attention.core_attention
                       for (b, i), layer in layers.items() if hasattr(getattr(layer, "self_attention", None),
                                                                       "core_attention")})
        probes.update({(b, i, "mlp"): layer.mlp for (b, i), layer in layers.items() if hasattr(layer, "mlp")})
        account = SavedTensorAccount(self._not_activations(model_chunks))
        probe = ModuleProbe(account, probes)
        allocator = device_allocator()
        if allocator is not None:
            allocator.reset_peak_memory_stats()
        try:
            with account.recording():
                result = run_step()
        finally:
            probe.remove()
        totals = probe.take()
        static = self._static_bytes(model_chunks)
        peak = int(allocator.max_memory_allocated()) if allocator is not None else static + account.peak
        if measuring_plan:
            self.measured_peak = peak
            _print_on_rank(f"measured peak with the plan: {peak / MIB:.1f} MiB (predicted "
                           f"{self.predicted_peak / MIB:.1f} MiB, budget {self.budget_bytes / MIB:.0f} MiB)")
            return result
        self.peaks[option].append(peak)
        self.samples[option].append(totals)
        if self.step == self.profiling_steps:
            self._plan(blocks, schedule_name, num_microbatches, static)
        return result

    # -- the plan ------------------------------------------------------------------------------------
    def _plan(self, blocks, schedule_name: str, num_microbatches: int, static: int) -> None:
        units = self.units = units_in_flight(schedule_name, num_microbatches)
        profiles = [[self._layer_profile(b, i, mlp_recompute_supported(layer)) for i, layer in enumerate(block.layers)]
                    for b, block in enumerate(blocks)]
        flat = [layer for chunk in profiles for layer in chunk]
        none_bytes = sum(layer.saved_bytes[solver.NONE] for layer in flat)
        # the no-recompute steps after the first (warm-up: optimizer state allocated during it)
        none_peak = min(self.peaks[solver.NONE][1:] or self.peaks[solver.NONE])
        other = max(0, none_peak - static - units * none_bytes)
        transient = max(layer.saved_bytes[solver.NONE] - layer.saved_bytes[solver.FULL] for layer in flat)
        allowed = self.budget_bytes - static - other - transient
        full_bytes = sum(layer.saved_bytes[solver.FULL] for layer in flat)
        # what the full-recompute steps kept beyond the layers' inputs (the checkpoints also save the mask)
        full_overhead = max(0, max(self.peaks[solver.FULL]) - (static + other + transient + units * full_bytes))
        plan = solver.solve(profiles, units, allowed, full_overhead)
        self.minimum_bytes = static + other + transient + units * full_bytes + full_overhead
        self.none_peak_bytes = static + other + units * none_bytes
        worst_minimum, refused = _over_ranks_max(self.minimum_bytes, plan is None)
        if refused:
            where = (f"on this rank (parameters, gradients and optimizer state {static / MIB:.1f} MiB, other "
                     f"activations {other / MIB:.1f} MiB, {units} micro-batch(es) in flight)" if plan is None
                     else "on another rank")
            raise AdaptiveRecomputeError(
                f"--adaptive-recompute-device-size {self.budget_bytes // MIB} cannot be met: even full recompute of "
                f"every layer needs {worst_minimum / MIB:.1f} MiB {where}; give at least "
                f"{math.ceil(worst_minimum / MIB)}")
        self.plan = plan
        self.predicted_peak = (static + other + transient + units * plan.saved_bytes
                               + (full_overhead if plan.full_layers else 0))
        per_block, start = [], 0
        for chunk in profiles:
            per_block.append(list(plan.options[start:start + len(chunk)]))
            start += len(chunk)
        apply_options(blocks, per_block)
        _print_on_rank(
            f"plan after {self.profiling_steps} profiling steps: {plan.describe()} per rank ({units} micro-batch(es) in "
            f"flight); activations {units * plan.saved_bytes / MIB:.1f} MiB of {units * none_bytes / MIB:.1f} MiB "
            f"without recompute, recompute {plan.recompute_seconds * 1e3:.1f} ms per micro-batch; predicted peak "
            f"{self.predicted_peak / MIB:.1f} MiB of the {self.budget_bytes / MIB:.0f} MiB budget (full recompute: "
            f"{self.minimum_bytes / MIB:.1f} MiB)")

    def _layer_profile(self, block: int, index: int, mlp_recompute: bool) -> solver.LayerProfile:
        def per_call(option, key, field):
            return [sample[key][field] / sample[key][3] for sample in self.samples[option] if key in sample]

        saved = {}
        for option in (solver.NONE, solver.ATTENTION, solver.ATTENTION_MLP):
            saved[option] = int(max(per_call(option, (block, index), 0)))
        saved[solver.FULL] = int(max(per_call(solver.NONE, (block, index), 2)))

        def seconds(key):
            values = per_call(solver.NONE, key, 1)
            timed = values[1:] or values  # the first no-recompute step warms up
            return min(timed) if timed else 0.0

        attention = seconds((block, index, "attention"))
        mlp = seconds((block, index, "mlp"))
        costs = {solver.NONE: 0.0, solver.ATTENTION: attention, solver.ATTENTION_MLP: attention + mlp,
                 solver.FULL: seconds((block, index))}
        if not mlp_recompute:
            del saved[solver.ATTENTION_MLP], costs[solver.ATTENTION_MLP]
        return solver.LayerProfile(saved, costs)

    # -- memory outside the activations --------------------------------------------------------------
    def _static_bytes(self, model_chunks) -> int:
        from ascendspeed.training.memory import account

        optimizer = self.optimizer_ref() if self.optimizer_ref is not None else None
        return account(model_chunks, optimizer).total

    @staticmethod
    def _not_activations(model_chunks) -> list:
        tensors = []
        for chunk in model_chunks:
            for param in chunk.parameters():
                tensors += [param, getattr(param, "main_grad", None), param.grad]
            for buffer in list(getattr(chunk, "buffers", [])):
                tensors += [getattr(buffer, "grad_data", None), getattr(buffer, "param_data", None)]
        return tensors
