"""Adaptive recompute while training: profile the first steps, choose the plan, apply it, report.

Profiling steps run every layer of the rank with one option at a time (none, core attention, core attention
and MLP, full, core attention and MLP and the norms), cycling, and record per layer the activation bytes it keeps
(``training.activations.SavedTensorAccount``) and the forward seconds of the layer, its core attention, its MLP
and its norms (the recompute cost of each option). What recomputing the norms saves does not depend on the rest
of the option (their outputs are kept by the next linear, or by the MLP's checkpoint, either way), so the step
with the norms gives the norm variants of every selective option.
After the last profiling step the plan is solved (``solver.solve``) against

    budget = static + other + the plan's activation peak

where static is the rank's parameters, gradients and optimizer state (``training.memory.account``), other
the activations outside the layers, measured in the no-recompute steps as the step's peak less the layers'
share, and the plan's activation peak its layers' bytes for every micro-batch in flight plus what backward
re-materialises beyond the layers already freed (``solver``). The step after applies the
plan and is measured; its measured peak is printed beside the predicted one. The ranks of one pipeline stage
solve the largest of their measurements, so they agree on the plan (``agreed_within_stage``).

Where the device's allocator has statistics (CUDA, NPU) the step's peak is its ``max_memory_allocated``; on
the CPU it is static plus the peak of the saved-tensor account.
"""
from __future__ import annotations

import math
import weakref
from typing import Optional

import torch

from ascendspeed.features.adaptive_recompute import solver
from ascendspeed.features.adaptive_recompute.account import ModuleProbe
from ascendspeed.features.base import FeatureArgumentError
from ascendspeed.features.timing import max_over_ranks
from ascendspeed.training.activations import SavedTensorAccount, model_state_tensors

MIB = 2**20
PROFILED_OPTIONS = (solver.NONE, solver.ATTENTION, solver.ATTENTION_MLP, solver.FULL, solver.ATTENTION_MLP_NORMS)
ATTRIBUTION_SLACK_BYTES = 4096


class AdaptiveRecomputeError(FeatureArgumentError):
    """The budget cannot be met, found at the end of profiling."""


def transformer_blocks(model_chunks) -> list:
    from megatron.core.transformer.transformer_block import TransformerBlock

    return [module for chunk in model_chunks for module in chunk.modules() if isinstance(module, TransformerBlock)]


def mlp_recompute_supported(layer) -> bool:
    """Whether this layer has an MLP megatron-core can checkpoint (dense or MoE)."""
    return getattr(layer, "mlp", None) is not None


#: megatron-core's per-layer switches of norm recompute (read in the layer's forward), and their norms.
NORM_RECOMPUTE_SWITCHES = (("recompute_input_layernorm", "input_layernorm"),
                           ("recompute_pre_mlp_layernorm", "pre_mlp_layernorm"))


def _is_separate_norm(module) -> bool:
    from megatron.core.transformer.identity_op import IdentityOp

    return module is not None and not isinstance(module, IdentityOp)


def separate_norms(layer) -> list:
    """The layer's norms megatron-core can recompute on their own: modules of their own, not fused into the
    next linear (``IdentityOp`` in their place, as in Transformer Engine's specs)."""
    return [getattr(layer, norm) for switch, norm in NORM_RECOMPUTE_SWITCHES
            if hasattr(layer, switch) and _is_separate_norm(getattr(layer, norm, None))]


def _fc2_handing_out_its_bias(layer):
    """The dense MLP's fc2 when it returns its bias for the layer's fused bias-dropout-add (``skip_bias_add``,
    linear biases on), else None."""
    fc2 = getattr(getattr(layer, "mlp", None), "linear_fc2", None)
    if fc2 is not None and getattr(fc2, "bias", None) is not None and (
            getattr(fc2, "skip_bias_add", False) or getattr(fc2, "_ascendspeed_bias_folded", False)):
        return fc2
    return None


def fold_fc2_bias(layer, fold: bool) -> None:
    """Inside megatron-core's MLP checkpoint, fc2 adds its bias itself instead of handing the bias parameter
    out: a checkpoint that returns a parameter makes backward re-enter the checkpoint without end (megatron-core
    0.15-0.19 on torch 2.13). The layer's bias-dropout-add then gets no bias and computes the same sum:
    ``residual + dropout(fc2 + bias)`` either way. ``fold=False`` restores Megatron's path."""
    fc2 = _fc2_handing_out_its_bias(layer)
    if fc2 is None:
        return
    fc2.skip_bias_add = not fold
    fc2._ascendspeed_bias_folded = fold


def set_layer_option(layer, option: str) -> None:
    """The selective part of ``option`` on one layer (full recompute is set on the block's config)."""
    parts = solver.recomputed_parts(option)
    attention = getattr(layer, "self_attention", None)
    if attention is not None and hasattr(attention, "checkpoint_core_attention"):
        attention.checkpoint_core_attention = "attention" in parts
    for switch, norm in NORM_RECOMPUTE_SWITCHES:
        if hasattr(layer, switch):
            setattr(layer, switch, "norms" in parts and _is_separate_norm(getattr(layer, norm, None)))
    mlp_flag = "mlp" in parts and mlp_recompute_supported(layer)
    moe_targets = [target for target in (layer, getattr(layer, "mlp", None))
                   if target is not None and hasattr(target, "moe_layer_recompute")]
    if moe_targets:
        for target in moe_targets:
            target.moe_layer_recompute = mlp_flag
    elif hasattr(layer, "recompute_mlp"):
        layer.recompute_mlp = mlp_flag
        fold_fc2_bias(layer, mlp_flag)


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


def stage_groups() -> list:
    """The process groups that together span the ranks of this rank's pipeline stage: tensor-parallel, then
    data-parallel with context-parallel (expert-parallel ranks lie within both)."""
    from megatron.core import parallel_state

    if not (torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return []
    return [parallel_state.get_tensor_model_parallel_group(),
            parallel_state.get_data_parallel_group(with_context_parallel=True)]


def agreed_within_stage(profiles, *byte_counts: int):
    """The profiles and byte counts as their largest over the ranks of this pipeline stage, so that every rank
    of the stage solves the same inputs and gets the same plan: a layer recomputed on one rank and not on its
    tensor- or context-parallel peer would issue collectives the peer never joins (a hang, or a peer's
    message taken for another layer's)."""
    groups = stage_groups()
    if not groups:
        return profiles, byte_counts
    values = list(byte_counts)
    for layer in (layer for chunk in profiles for layer in chunk):
        for option in solver.OPTIONS:
            values += [layer.saved_bytes.get(option, -1), layer.recompute_seconds.get(option, -1.0)]
    values = iter(max_over_ranks(values, groups))
    counts = tuple(int(next(values)) for _ in byte_counts)
    agreed = []
    for chunk in profiles:
        agreed.append([])
        for layer in chunk:
            saved, seconds = {}, {}
            for option in solver.OPTIONS:
                option_bytes, option_seconds = next(values), next(values)
                if option in layer.saved_bytes:
                    saved[option], seconds[option] = int(option_bytes), option_seconds
            agreed[-1].append(solver.LayerProfile(saved, seconds))
    return agreed, counts


def _taken(available, option: str) -> str:
    """The option a layer took when asked for ``option``: without the MLP or the norms where it cannot
    recompute them (``available``: the options it can take)."""
    parts = solver.recomputed_parts(option)
    for dropped in ((), ("mlp",), ("norms",), ("mlp", "norms")):
        candidate = option if not dropped else solver.selective_option(parts - set(dropped))
        if candidate in available:
            return candidate
    raise ValueError(f"a layer that can take {sorted(available)} cannot take {option}")


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
        self.profiles: Optional[list] = None  # per model chunk, its layers' solver.LayerProfile

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
        probes.update({(b, i, "norm", n): norm for (b, i), layer in layers.items()
                       for n, norm in enumerate(separate_norms(layer))})
        probes.update({(b, "block"): block for b, block in enumerate(blocks)})
        account = SavedTensorAccount(model_state_tensors(model_chunks))
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
        profiles = [[self._layer_profile(b, i, mlp_recompute_supported(layer), len(separate_norms(layer)))
                     for i, layer in enumerate(block.layers)] for b, block in enumerate(blocks)]
        flat = [layer for chunk in profiles for layer in chunk]
        none_bytes = sum(layer.saved_bytes[solver.NONE] for layer in flat)
        # the no-recompute steps after the first (warm-up: optimizer state allocated during it)
        none_peak = max(self.peaks[solver.NONE][1:] or self.peaks[solver.NONE])
        other = max(0, none_peak - static - units * none_bytes)
        # what recompute keeps beyond the solver's formula: the full checkpoints' inputs besides the layers'
        # hidden states (the attention mask, saved once: the blocks' growth in the full step less the layers'
        # inputs), whatever else the profiled recompute steps kept, and a page per layer and micro-batch for
        # small tensors (scalars) the account gives to one layer or its neighbour depending on the plan
        checkpointed = sum(self._per_call(solver.FULL, (b, "block"), 0, max) for b in range(len(blocks)))
        shared = units * max(0, checkpointed - sum(layer.saved_bytes[solver.FULL] for layer in flat))
        residual = max(max(self.peaks[option]) - static - other
                       - solver.peak_bytes(profiles, self._profiled_options(flat, option), units)
                       for option in PROFILED_OPTIONS if option != solver.NONE)
        overhead = max(0, shared, residual) + ATTRIBUTION_SLACK_BYTES * len(flat) * units
        profiles, (static, other, overhead) = agreed_within_stage(profiles, static, other, overhead)
        self.profiles = profiles
        flat = [layer for chunk in profiles for layer in chunk]
        none_bytes = sum(layer.saved_bytes[solver.NONE] for layer in flat)
        allowed = self.budget_bytes - static - other
        plan = solver.solve(profiles, units, allowed, overhead)
        every_layer_full = [solver.FULL] * len(flat)
        self.minimum_bytes = static + other + solver.peak_bytes(profiles, every_layer_full, units, overhead)
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
        self.predicted_peak = static + other + plan.peak_bytes
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

    @staticmethod
    def _profiled_options(layers, option: str) -> list:
        """The per-layer options of a profiling step that gave every layer ``option`` (without the MLP or the
        norms where the layer cannot recompute them)."""
        return [_taken(layer.saved_bytes, option) for layer in layers]

    def _per_call(self, option: str, key, field: int, reduce=list):
        """A probed module's ``field`` (saved bytes 0, seconds 1, input bytes 2) per forward call, in each
        profiling step of ``option``, reduced."""
        return reduce([sample[key][field] / sample[key][3] for sample in self.samples[option] if key in sample])

    def _layer_profile(self, block: int, index: int, mlp_recompute: bool, norms: int) -> solver.LayerProfile:
        """The layer's bytes and seconds per option it can take: measured for the profiled options, and for
        the norm variants the profiled selective option less what the norms saved in their profiling step."""
        per_call = self._per_call

        def measured(option):
            return int(max(per_call(option, (block, index), 0)))

        def seconds(key):
            values = per_call(solver.NONE, key, 1)
            timed = values[1:] or values  # the first no-recompute step warms up
            return min(timed) if timed else 0.0

        attention, mlp = seconds((block, index, "attention")), seconds((block, index, "mlp"))
        saved = {solver.NONE: measured(solver.NONE), solver.ATTENTION: measured(solver.ATTENTION),
                 solver.FULL: int(max(per_call(solver.NONE, (block, index), 2)))}
        costs = {solver.NONE: 0.0, solver.ATTENTION: attention, solver.FULL: seconds((block, index))}
        if mlp_recompute:
            saved[solver.ATTENTION_MLP], costs[solver.ATTENTION_MLP] = measured(solver.ATTENTION_MLP), attention + mlp
        if norms:
            without_norms = solver.ATTENTION_MLP if mlp_recompute else solver.ATTENTION
            norms_saved = max(0, saved[without_norms] - measured(solver.ATTENTION_MLP_NORMS))
            norms_seconds = sum(seconds((block, index, "norm", n)) for n in range(norms))
            for option in [option for option in saved if option != solver.FULL]:
                with_norms = solver.selective_option(solver.recomputed_parts(option) | {"norms"})
                saved[with_norms] = max(0, saved[option] - norms_saved)
                costs[with_norms] = costs[option] + norms_seconds
        return solver.LayerProfile(saved, costs)

    # -- memory outside the activations --------------------------------------------------------------
    def _static_bytes(self, model_chunks) -> int:
        from ascendspeed.training.memory import account

        optimizer = self.optimizer_ref() if self.optimizer_ref is not None else None
        return account(model_chunks, optimizer).total
