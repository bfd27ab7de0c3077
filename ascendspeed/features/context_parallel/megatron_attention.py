"""Context parallelism inside megatron-core's local ``DotProductAttention``.

megatron-core 0.16 asserts ``context_parallel_size == 1`` in ``DotProductAttention.__init__`` (only
Transformer Engine has context parallelism there). The patches here build the layer as if it were not
context parallel, then give it a ``ContextParallelAttention`` that its forward uses instead of Megatron's
``baddbmm``/softmax/``bmm`` whenever the context-parallel group has more than one rank. ALiBi layers (the
``alibi`` feature) keep their slopes; Megatron's local and fused ALiBi paths are both replaced by the
blockwise attention under context parallelism. Attention dropout masks by position (``dropout.py``), so
the result does not depend on how the sequence is split.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from typing import Optional

import torch

from ascendspeed.features.context_parallel import layout
from ascendspeed.features.context_parallel.dropout import SEED_BOUND, PositionalDropout
from ascendspeed.features.context_parallel.hybrid import HybridGroups, build_hybrid_groups, hybrid_attention
from ascendspeed.features.context_parallel.ring import ring_attention
from ascendspeed.features.context_parallel.settings import HYBRID, RING, ULYSSES, ContextParallelSettings
from ascendspeed.features.context_parallel.telemetry import RingTelemetry
from ascendspeed.features.context_parallel.ulysses import local_core_attention, ulysses_attention
from ascendspeed.patching import Patch, wrap

@dataclasses.dataclass
class ContextParallelState:
    """What one application of the feature keeps: the ring telemetry every layer adds to (with
    ``--log-cp-ring-overlap``; reset it to measure a window, read ``ring.summary()``), and the hybrid
    algorithm's Ulysses and ring groups, created once per (context-parallel ranks, Ulysses degree)."""

    ring: Optional[RingTelemetry] = None
    hybrid_cache: dict[tuple[tuple[int, ...], int], HybridGroups] = dataclasses.field(default_factory=dict)

    def hybrid_groups(self, cp_group, ulysses_degree: int) -> HybridGroups:
        """This rank's Ulysses and ring groups inside ``cp_group``."""
        import torch.distributed as dist

        key = (tuple(dist.get_process_group_ranks(cp_group)), ulysses_degree)
        if key not in self.hybrid_cache:
            self.hybrid_cache[key] = build_hybrid_groups(key[0], ulysses_degree)
        return self.hybrid_cache[key]


class ContextParallelAttention:
    """The core attention of one layer over its context-parallel group (see the package docstring)."""

    def __init__(self, settings: ContextParallelSettings, state: ContextParallelState, cp_group, causal_layer: bool):
        self.settings = settings
        self.group = cp_group
        self.size = cp_group.size()
        self.rank = cp_group.rank()
        self.causal = settings.mask_type == "causal"
        if self.causal and not causal_layer:
            raise ValueError(
                "--cp-attention-mask-type causal masks by position, but this attention layer's mask type is "
                "not causal: use --cp-attention-mask-type general to apply the layer's attention_mask"
            )
        self.hybrid = state.hybrid_groups(cp_group, settings.ulysses_degree) if settings.algorithm == HYBRID else None
        self.telemetry = state.ring

    def mask_rows(self, attention_mask: Optional[torch.Tensor], positions, seq_length: int):
        """This rank's rows of Megatron's boolean ``attention_mask`` (given whole, already split by rows, or
        one row for every query). A query that sees no key at all gets a zero output (Megatron's -10000 fill
        would average every value): only padding queries, whose loss is masked, can be affected."""
        if self.causal:
            return None
        if attention_mask is None:
            raise ValueError("--cp-attention-mask-type general needs an attention_mask in the attention layers")
        if attention_mask.size(-1) != seq_length:
            raise ValueError(
                f"attention_mask must cover every key of the sequence ({seq_length}) in its last dimension, "
                f"got shape {tuple(attention_mask.shape)}"
            )
        local_length = positions[self.rank].numel()
        if attention_mask.size(-2) == 1:
            return attention_mask.bool().expand(*attention_mask.shape[:-2], local_length, seq_length)
        if attention_mask.size(-2) == seq_length and seq_length != local_length:
            return attention_mask.index_select(-2, positions[self.rank].to(attention_mask.device)).bool()
        return attention_mask.bool()

    def dropout(self, layer, heads: int, device) -> Optional[PositionalDropout]:
        """The layer's attention dropout for this call, or None (evaluation, or p = 0). The seed is drawn
        where Megatron draws its dropout mask: from the model-parallel RNG tracker without sequence
        parallelism, from the default stream with it. Every context-parallel rank draws the same seed (the
        tracker is seeded alike across them), and a recomputed forward draws it again from the restored
        state."""
        p = layer.attention_dropout.p
        if not layer.training or p == 0:
            return None
        from megatron.core import tensor_parallel

        rng = contextlib.nullcontext() if layer.config.sequence_parallel else tensor_parallel.get_cuda_rng_tracker().fork()
        with rng:
            seed = int(torch.randint(0, SEED_BOUND, (1,), device=device).item())
        return PositionalDropout.for_heads(p, seed, heads)

    def __call__(self, layer, query, key, value, attention_mask, packed_seq_params=None):
        """Megatron's [s, b, heads, d] q/k/v in, [s, b, heads * d] out; or a THD pack (``packed_seq_params``),
        [t, heads, d] in, [t, heads * d] out, as Transformer Engine takes and returns it."""
        if packed_seq_params is None:
            seq_length = query.size(0) * self.size
            positions = _balanced_positions(seq_length, self.size)
            return self._attend(layer, query, key, value, positions, self.mask_rows(attention_mask, positions,
                                                                                    seq_length))
        if not self.causal and attention_mask is not None:
            raise ValueError("context-parallel attention over packed sequences masks by the pack's sequences "
                             "(causally with --cp-attention-mask-type causal, else each sequence whole): pass no "
                             "attention_mask with packed_seq_params")
        if query.dim() != 3:
            raise ValueError(f"context-parallel attention takes a pack in THD layout, [tokens, heads, head dim]; got "
                             f"query {tuple(query.shape)} (packed_seq_params.qkv_format 'thd')")
        pack = PackOnRanks.of(packed_seq_params, self.size)
        if pack.positions[self.rank].numel() != query.size(0):
            raise ValueError(
                f"this context-parallel rank holds {query.size(0)} tokens of the pack, but its sequences "
                f"{pack.slots.tolist()} split over {self.size} ranks give it {pack.positions[self.rank].numel()}: "
                "split the pack by sequence (megatron-core's get_batch_on_this_cp_rank for THD)")
        unbatched = (t.unsqueeze(1) for t in (query, key, value))
        padding = None if self.causal else pack.padding_keys(self.rank, query.device)
        out = self._attend(layer, *unbatched, pack.positions, padding, segments=pack.slots).squeeze(1)
        tokens = pack.tokens_on_rank(self.rank)
        return out if tokens is None else out * tokens.to(out.device, out.dtype)[:, None]

    def _attend(self, layer, query, key, value, positions, mask, segments=None):
        local_length, batch, heads, _ = query.shape
        dropout = self.dropout(layer, heads, query.device)
        query, key, value, value_dim = _common_head_dim(query, key, value)
        groups = heads // key.size(2)
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=2), value.repeat_interleave(groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        scale = layer.softmax_scale * (layer.scale_mask_softmax.scale or 1.0)
        alibi = layer.__dict__.get("alibi")
        slopes = alibi.slopes_on(q.device) if alibi is not None else None
        symmetric = (not alibi.causal) if alibi is not None else None
        algorithm = self.settings.algorithm
        if algorithm == RING:
            out = ring_attention(q, k, v, positions, group=self.group, causal=self.causal, scale=scale,
                                 slopes=slopes, symmetric_alibi=symmetric, mask=mask, dropout=dropout,
                                 telemetry=self.telemetry, segments=segments)
        elif algorithm == ULYSSES:
            core = local_core_attention(self.causal, scale, symmetric, segments)
            out = ulysses_attention(q, k, v, positions, group=self.group, core=core, slopes=slopes, mask=mask,
                                    dropout=dropout)
        else:
            out = hybrid_attention(q, k, v, positions, self.hybrid, causal=self.causal, scale=scale, slopes=slopes,
                                   symmetric_alibi=symmetric, mask=mask, dropout=dropout, telemetry=self.telemetry,
                                   segments=segments)
        return out[..., :value_dim].permute(2, 0, 1, 3).reshape(local_length, batch, heads * value_dim)


@dataclasses.dataclass(frozen=True)
class PackOnRanks:
    """A THD pack over the context-parallel ranks: the slots of its sequences (``cu_seqlens_q_padded``, or
    ``cu_seqlens_q`` without padding), each rank's positions in the pack (``layout.packed_positions_on_rank``)
    and, with padding, the tokens' sequence lengths (``cu_seqlens_q``): a slot's tail is padding, whose output
    is zero (as Transformer Engine leaves it)."""

    slots: torch.Tensor
    lengths: Optional[torch.Tensor]
    positions: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, packed_seq_params, cp_size: int) -> "PackOnRanks":
        def bounds(name):
            value = getattr(packed_seq_params, name, None)
            return None if value is None else value.to("cpu", torch.int64)

        sequences, slots = bounds("cu_seqlens_q"), bounds("cu_seqlens_q_padded")
        for query_side in ("cu_seqlens_q", "cu_seqlens_q_padded"):
            key_side = query_side.replace("_q", "_kv")
            queries, keys = bounds(query_side), bounds(key_side)
            if keys is not None and (queries is None or not torch.equal(keys, queries)):
                raise ValueError(f"context-parallel attention over a pack needs {key_side} equal to {query_side}")
        if sequences is None:
            raise ValueError("context-parallel attention over a pack needs packed_seq_params.cu_seqlens_q")
        lengths = None
        if slots is None or torch.equal(slots, sequences):
            slots = sequences
        else:
            lengths = sequences.diff()
            if slots.shape != sequences.shape or bool((slots.diff() < lengths).any()):
                raise ValueError(f"a pack's padded bounds {slots.tolist()} must hold its sequences "
                                 f"{sequences.tolist()}")
        positions = tuple(layout.packed_positions_on_rank(slots, rank, cp_size) for rank in range(cp_size))
        return cls(slots, lengths, positions)

    def padding_keys(self, rank: int, device) -> Optional[torch.Tensor]:
        """A mask of every key that is padding, for the rank's queries ([1, 1, queries, pack]; None without
        padding): causally the padding at a slot's end is hidden from its sequence anyway, without the causal
        mask it must be hidden by this."""
        if self.lengths is None:
            return None
        every = torch.arange(int(self.slots[-1]))
        sequence = layout.segment_ids(every, self.slots)
        padding = every - self.slots[sequence] >= self.lengths[sequence]
        return padding.to(device).view(1, 1, 1, -1).expand(1, 1, self.positions[rank].numel(), -1)

    def tokens_on_rank(self, rank: int) -> Optional[torch.Tensor]:
        """Which of the rank's positions are tokens, not padding (None: all are)."""
        if self.lengths is None:
            return None
        positions = self.positions[rank]
        sequence = layout.segment_ids(positions, self.slots)
        return positions - self.slots[sequence] < self.lengths[sequence]


def _common_head_dim(query, key, value):
    """q, k, v with one head size, and the value head size to cut the output back to. Multi-latent attention's
    query/key heads (nope + rope features) are wider than its value heads, and the algorithms move keys and
    values as one tensor: the narrower side is zero-padded (zero query/key features add nothing to a score,
    zero value features give output features that are cut off)."""
    value_dim = value.size(-1)
    width = max(query.size(-1), value_dim)

    def padded(t):
        return torch.nn.functional.pad(t, (0, width - t.size(-1))) if t.size(-1) < width else t

    return padded(query), padded(key), padded(value), value_dim


@functools.lru_cache(maxsize=16)
def _balanced_positions(seq_length: int, cp_size: int) -> tuple[torch.Tensor, ...]:
    """Positions of every rank's tokens in the balanced layout (megatron-core's ``get_batch_on_this_cp_rank``)."""
    return tuple(layout.positions_on_rank(seq_length, rank, cp_size) for rank in range(cp_size))


def _cp_group(pg_collection):
    from megatron.core import parallel_state

    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    return group if group is not None else parallel_state.get_context_parallel_group()


def unsharded(config):
    """``config`` with one context-parallel rank, to build megatron-core's local attention (which asserts one)."""
    built = copy.copy(config)
    built.context_parallel_size = 1
    return built


def attach_context_parallel(layer, config, settings: ContextParallelSettings, state: ContextParallelState,
                            pg_collection, causal_layer: bool) -> ContextParallelAttention:
    """For ``layer`` built from ``unsharded(config)``: its real config back, and the attention over its
    context-parallel group."""
    layer.config = config
    if layer.softmax_offset is not None or layer.scale_mask_softmax.window_size is not None:
        raise ValueError("context-parallel attention supports neither --softmax-type other than vanilla "
                         "nor --window-size")
    return ContextParallelAttention(settings, state, _cp_group(pg_collection), causal_layer)


def wrap_attention_init(settings: ContextParallelSettings, state: ContextParallelState):
    """``DotProductAttention.__init__`` under context parallelism: build it as a one-rank layer (Megatron's
    assertion), keep the real config, attach the ``ContextParallelAttention``."""

    def factory(original):
        @functools.wraps(original)
        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None):
            if config.context_parallel_size == 1:
                return original(self, config, layer_number, attn_mask_type, attention_type, attention_dropout,
                                softmax_scale, cp_comm_type, pg_collection)
            original(self, unsharded(config), layer_number, attn_mask_type, attention_type, attention_dropout,
                     softmax_scale, cp_comm_type, pg_collection)
            self.context_parallel = attach_context_parallel(self, config, settings, state, pg_collection,
                                                            causal_layer="causal" in attn_mask_type.name)

        return __init__

    return factory


def wrap_attention_forward(original):
    """``DotProductAttention.forward``: layers with a ``context_parallel`` attention use it."""

    @functools.wraps(original)
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        context_parallel = self.__dict__.get("context_parallel")
        if context_parallel is None:
            return original(self, query, key, value, attention_mask, attn_mask_type, attention_bias,
                            packed_seq_params)
        if attention_bias is not None:
            raise ValueError("context-parallel attention does not take an attention_bias")
        return context_parallel(self, query, key, value, attention_mask, packed_seq_params)

    return forward


def patches(settings: ContextParallelSettings, state: ContextParallelState) -> list[Patch]:
    return [
        wrap("megatron.core.transformer.dot_product_attention:DotProductAttention.__init__",
             wrap_attention_init(settings, state),
             expect="(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None, "
                    "softmax_scale=None, cp_comm_type=None, pg_collection=None)",
             name="context parallel: local attention accepts a context-parallel group and holds the algorithm"),
        wrap("megatron.core.transformer.dot_product_attention:DotProductAttention.forward", wrap_attention_forward,
             expect="(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, "
                    "packed_seq_params=None)",
             name="context parallel: attention over the sequence shards of the context-parallel group"),
    ]
