"""The recompute plan: per transformer layer none, selective (core attention, core attention and MLP, each with
or without the layer norms; the norms alone) or full recompute, the cheapest in recompute time whose activations
fit the budget.

The activation peak of a plan: ``units`` micro-batches in flight each keep the plan's bytes ``S``; and while
backward re-materialises layer ``i`` (``none(i) - plan(i)`` more bytes), the layers after it in the same model
chunk have already been freed by their backward. So

    peak = units * S + max(0, max_i [none(i) - plan(i) - S_after(i)])

with ``S_after(i)`` the plan's bytes of the layers after ``i`` in its chunk (with several chunks, whose
backward interleaves, no credit is taken: ``S_after = 0``), plus, for a plan that recomputes anything, what the
profiled recompute steps kept beyond this formula (the checkpoints' saved mask and the like).

Megatron's full recompute by block recomputes the first ``k`` layers of every model chunk, so the full layers
are a prefix; the solver tries every ``k`` and, for the layers after it, finds the exact cheapest mix of the
selective options with a Pareto frontier over the layers, built from the last layer backwards: a partial plan
is kept unless another is no larger in bytes ``S``, no slower, and no larger in ``credit * S + re-materialised
excess`` (which bounds every later term; no rounding of bytes, so the chosen plan is optimal, which the tests
check against brute force).
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Mapping, Optional, Sequence

NONE, NORMS, FULL = "none", "norms", "full"
ATTENTION, ATTENTION_NORMS = "attention", "attention+norms"
ATTENTION_MLP, ATTENTION_MLP_NORMS = "attention+mlp", "attention+mlp+norms"
SELECTIVE = (NONE, NORMS, ATTENTION, ATTENTION_NORMS, ATTENTION_MLP, ATTENTION_MLP_NORMS)
OPTIONS = SELECTIVE + (FULL,)


def recomputed_parts(option: str) -> frozenset:
    """What a selective option recomputes: a subset of {"attention", "mlp", "norms"} (none for none and full)."""
    return frozenset() if option in (NONE, FULL) else frozenset(option.split("+"))


def selective_option(parts) -> str:
    """The selective option recomputing ``parts`` (a subset of {"attention", "mlp", "norms"})."""
    name = "+".join(part for part in ("attention", "mlp", "norms") if part in parts)
    if name and name not in SELECTIVE:
        raise ValueError(f"no selective option recomputes {sorted(parts)}: the MLP is recomputed with core attention")
    return name or NONE


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """One layer, measured: the activation bytes it keeps for backward and the seconds its recomputation
    costs, per option it can take (every layer can take none and full)."""

    saved_bytes: Mapping[str, int]
    recompute_seconds: Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class Plan:
    """An option per layer (in the order of the profiles), with the layers' activation bytes (per in-flight
    micro-batch), recompute seconds (per micro-batch) and the activation peak (module doc) it costs."""

    options: tuple[str, ...]
    saved_bytes: int
    recompute_seconds: float
    peak_bytes: int

    @property
    def full_layers(self) -> int:
        return sum(option == FULL for option in self.options)

    def describe(self) -> str:
        counts = {option: self.options.count(option) for option in OPTIONS if self.options.count(option)}
        return ", ".join(f"{count} x {option}" for option, count in counts.items())


def plan_of(chunks: Sequence[Sequence[LayerProfile]], options: Sequence[str], units_in_flight: int,
            recompute_overhead: int = 0) -> Plan:
    """The plan ``options`` (per layer, in chunk order) makes of ``chunks``."""
    layers = [layer for chunk in chunks for layer in chunk]
    return Plan(tuple(options), sum(layer.saved_bytes[o] for layer, o in zip(layers, options)),
                sum(layer.recompute_seconds[o] for layer, o in zip(layers, options)),
                peak_bytes(chunks, options, units_in_flight, recompute_overhead))


def peak_bytes(chunks: Sequence[Sequence[LayerProfile]], options: Sequence[str], units_in_flight: int,
               recompute_overhead: int = 0) -> int:
    """The activation peak of ``options`` (per layer, in chunk order) by the formula of the module doc."""
    credit = 1 if len(chunks) == 1 else 0
    total, excess, start = 0, 0, 0
    for chunk in chunks:
        mine = options[start:start + len(chunk)]
        start += len(chunk)
        after = 0
        for layer, option in zip(reversed(chunk), reversed(mine)):
            rematerialised = layer.saved_bytes[NONE] - layer.saved_bytes[option]
            excess = max(excess, rematerialised - credit * after)
            after += layer.saved_bytes[option]
        total += after
    overhead = recompute_overhead if any(option != NONE for option in options) else 0
    return units_in_flight * total + excess + overhead


def _prepend(states, layer: LayerProfile, options: Sequence[str], credit: int):
    """The partial plans with ``layer`` (one of ``options``) put before each of ``states``: (bytes, seconds,
    excess, options), pruned to the frontier."""
    grown = []
    for saved, seconds, excess, chosen in states:
        for option in options:
            if option in layer.saved_bytes:
                rematerialised = layer.saved_bytes[NONE] - layer.saved_bytes[option]
                grown.append((saved + layer.saved_bytes[option], seconds + layer.recompute_seconds[option],
                              max(excess, rematerialised - credit * saved), (option,) + chosen))
    grown.sort(key=lambda state: (state[0], state[1], credit * state[0] + state[2]))
    # ascending bytes: keep a state unless a kept one is no slower and no higher in bound; the kept states'
    # least bound per seconds is a staircase (seconds ascending, bounds descending), so that is one bisection
    kept, stair_seconds, stair_bounds = [], [], []
    for state in grown:
        seconds, bound = state[1], credit * state[0] + state[2]
        at = bisect.bisect_right(stair_seconds, seconds)
        if at and stair_bounds[at - 1] <= bound:
            continue
        kept.append(state)
        end = at
        while end < len(stair_bounds) and stair_bounds[end] >= bound:
            end += 1
        stair_seconds[at:end], stair_bounds[at:end] = [seconds], [bound]
    return kept


def solve(chunks: Sequence[Sequence[LayerProfile]], units_in_flight: int, allowed_bytes: int,
          recompute_overhead: int = 0) -> Optional[Plan]:
    """The cheapest plan whose activation peak (module doc) fits ``allowed_bytes``; None when not even full
    recompute of every layer fits. ``chunks`` are the model chunks of the rank (one without virtual
    pipelining), each a list of its layers: the ``k`` full layers are the first ``k`` of every chunk.
    ``recompute_overhead``: bytes any plan that recomputes keeps beyond the formula (module doc)."""
    depth = min(len(chunk) for chunk in chunks) if chunks else 0
    credit = 1 if len(chunks) == 1 else 0
    best: Optional[tuple[float, int, int, tuple, int]] = None
    rest, order = [(0, 0.0, 0, ())], []  # partial plans of the layers after the full prefix; their layers

    def prepend(c: int, i: int) -> None:
        nonlocal rest
        rest = _prepend(rest, chunks[c][i], SELECTIVE, credit)
        order.insert(0, (c, i))

    for c in reversed(range(len(chunks))):  # layers beyond the shortest chunk's depth are never full
        for i in reversed(range(depth, len(chunks[c]))):
            prepend(c, i)
    for full in range(depth, -1, -1):
        if full < depth:
            for c in reversed(range(len(chunks))):
                prepend(c, full)
        full_saved = sum(layer.saved_bytes[FULL] for chunk in chunks for layer in chunk[:full])
        full_seconds = sum(layer.recompute_seconds[FULL] for chunk in chunks for layer in chunk[:full])
        full_excess = _full_prefix_excess(chunks, full, credit)  # less credit * (bytes after the prefix)
        for saved, seconds, excess, chosen in rest:
            recomputes = full or seconds > 0 or any(option != NONE for option in chosen)
            peak = (units_in_flight * (saved + full_saved) + max(excess, full_excess - credit * saved)
                    + (recompute_overhead if recomputes else 0))
            cost = full_seconds + seconds
            if peak <= allowed_bytes and (best is None or cost < best[0]):
                best = (cost, saved + full_saved, peak, dict(zip(order, chosen)), full)
    if best is None:
        return None
    cost, saved, peak, chosen, full = best
    options = tuple(FULL if i < full else chosen[(c, i)] for c, chunk in enumerate(chunks) for i in range(len(chunk)))
    return Plan(options, saved, cost, peak)


def _full_prefix_excess(chunks, full: int, credit: int) -> int:
    """The largest re-materialised excess of the ``full`` prefix layers, counting (with ``credit``) the prefix
    layers after each; the caller takes off ``credit`` times the bytes after the prefix."""
    excess = 0
    for chunk in chunks:
        after = 0
        for layer in reversed(chunk[:full]):
            excess = max(excess, layer.saved_bytes[NONE] - layer.saved_bytes[FULL] - credit * after)
            after += layer.saved_bytes[FULL]
    return excess
