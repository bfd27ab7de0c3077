"""The recompute plan: per transformer layer none, selective (core attention; core attention and MLP) or full
recompute, the cheapest in recompute time whose activations fit the budget.

Megatron's full recompute by block recomputes the first ``k`` layers of every model chunk, so the full layers
are a prefix; the solver tries every ``k`` and, for the layers after it, finds the exact cheapest mix of the
selective options with a Pareto frontier of (bytes, seconds) over the layers (no rounding of bytes, so the
chosen plan is optimal, which the tests check against brute force).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

NONE, ATTENTION, ATTENTION_MLP, FULL = "none", "attention", "attention+mlp", "full"
OPTIONS = (NONE, ATTENTION, ATTENTION_MLP, FULL)
SELECTIVE = (NONE, ATTENTION, ATTENTION_MLP)


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """One layer, measured: the activation bytes it keeps for backward and the seconds its recomputation
    costs, per option it can take (every layer can take none and full)."""

    saved_bytes: Mapping[str, int]
    recompute_seconds: Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class Plan:
    """An option per layer (in the order of the profiles), with the layers' activation bytes (per in-flight
    micro-batch) and recompute seconds (per micro-batch) it costs."""

    options: tuple[str, ...]
    saved_bytes: int
    recompute_seconds: float

    @property
    def full_layers(self) -> int:
        return sum(option == FULL for option in self.options)

    def describe(self) -> str:
        counts = {option: self.options.count(option) for option in OPTIONS if self.options.count(option)}
        return ", ".join(f"{count} x {option}" for option, count in counts.items())


def plan_of(layers: Sequence[LayerProfile], options: Sequence[str]) -> Plan:
    return Plan(tuple(options), sum(layer.saved_bytes[o] for layer, o in zip(layers, options)),
                sum(layer.recompute_seconds[o] for layer, o in zip(layers, options)))


def _frontier(layers: Sequence[LayerProfile]) -> list[tuple[int, float, tuple[str, ...]]]:
    """Every (bytes, seconds, options) of ``layers`` with selective options that no other beats on both."""
    states = [(0, 0.0, ())]
    for layer in layers:
        grown = sorted(((saved + layer.saved_bytes[o], seconds + layer.recompute_seconds[o], chosen + (o,))
                        for saved, seconds, chosen in states for o in SELECTIVE if o in layer.saved_bytes),
                       key=lambda s: (s[0], s[1]))
        states, best = [], float("inf")
        for state in grown:  # ascending bytes: keep a state only if it is faster than every smaller one
            if state[1] < best:
                states.append(state)
                best = state[1]
    return states


def solve(chunks: Sequence[Sequence[LayerProfile]], units_in_flight: int, allowed_bytes: int,
          full_overhead: int = 0) -> Optional[Plan]:
    """The cheapest plan whose layer activations, times ``units_in_flight`` (micro-batches held at once),
    fit ``allowed_bytes``; None when not even full recompute of every layer fits. ``chunks`` are the model
    chunks of the rank (one without virtual pipelining), each a list of its layers: the ``k`` full layers are
    the first ``k`` of every chunk. ``full_overhead``: bytes any full recompute keeps besides the layers'
    inputs (what the checkpoints save once, e.g. the attention mask)."""
    depth = min(len(chunk) for chunk in chunks) if chunks else 0
    best: Optional[Plan] = None
    for full in range(depth + 1):
        prefix = [layer for chunk in chunks for layer in chunk[:full]]
        rest = [layer for chunk in chunks for layer in chunk[full:]]
        fixed = plan_of(prefix, [FULL] * len(prefix))
        # the frontier grows in bytes and shrinks in seconds: the largest state that fits is the cheapest
        for saved, seconds, chosen in reversed(_frontier(rest)):
            total = fixed.saved_bytes + saved
            if total * units_in_flight + (full_overhead if full else 0) > allowed_bytes:
                continue
            cost = fixed.recompute_seconds + seconds
            if best is None or cost < best.recompute_seconds:
                best = Plan(_interleave(chunks, full, chosen), total, cost)
            break
    return best


def _interleave(chunks, full: int, rest_options: tuple[str, ...]) -> tuple[str, ...]:
    """Per layer in chunk order: ``full`` for the first ``full`` of each chunk, then ``rest_options``."""
    options, remaining = [], iter(rest_options)
    for chunk in chunks:
        options += [FULL] * full
        options += [next(remaining) for _ in chunk[full:]]
    return tuple(options)
