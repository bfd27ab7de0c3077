"""Attention dropout whose mask depends only on a seed and the global positions of query and key.

Under context parallelism one attention row is computed in pieces, on several ranks, in an order that depends
on the layout (ring steps, Ulysses head split, hybrid groups). A mask drawn from a random stream as the pieces
are computed would change with the layout, and the backward would need the forward's stream state. Here the
decision for (batch row, head, query position, key position) is a counter-based hash of those four numbers and
a per-call seed: the forward and the backward recompute the same mask, every layout drops the same entries,
and a single-process float64 reference can rebuild it (``keep_scale`` over the whole sequence).

The hash is a 32-bit integer mixer (Chris Wellons' lowbias32) evaluated in int64 tensor arithmetic, so it
gives the same bits on every device and never overflows: products are split into 16-bit halves.

Dropout applies to the normalised probabilities, as Megatron's ``attention_dropout`` does:
``out = (P * keep / (1 - p)) V``; the softmax denominator (each block's log-sum-exp) is not masked, so the
blockwise merge is unchanged, and in backward ``dS = P * (dP * keep / (1 - p) - rowsum(dO * out))``.
"""
from __future__ import annotations

import dataclasses

import torch

_LOW32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
#: Seeds are drawn in [0, SEED_BOUND) from the device's random stream (the model-parallel RNG tracker's).
SEED_BOUND = 2**31


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for x in [0, 2**32), without int64 overflow."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _LOW32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit avalanche mixer (lowbias32) of int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@dataclasses.dataclass(frozen=True)
class PositionalDropout:
    """Dropout of attention probabilities with probability ``p``, keyed by ``seed`` and positions.

    ``heads``: int64 ids of the heads at hand, in their order (a Ulysses rank keeps its share of them, so
    a head keeps its mask whichever rank computes it).
    """

    p: float
    seed: int
    heads: torch.Tensor

    def __post_init__(self):
        if not 0.0 < self.p < 1.0:
            raise ValueError(f"attention dropout probability must be in (0, 1), got {self.p}")
        if not 0 <= self.seed < SEED_BOUND:
            raise ValueError(f"dropout seed must be in [0, {SEED_BOUND}), got {self.seed}")

    @classmethod
    def for_heads(cls, p: float, seed: int, heads: int) -> "PositionalDropout":
        return cls(p, seed, torch.arange(heads, dtype=torch.int64))

    def head_share(self, parts: int, index: int) -> "PositionalDropout":
        """The dropout of the ``index``-th of ``parts`` equal groups of the heads (Ulysses' split)."""
        return dataclasses.replace(self, heads=self.heads.chunk(parts)[index])

    @property
    def threshold(self) -> int:
        """Hash values below this are dropped: a fraction ``p`` of [0, 2**32)."""
        return round(self.p * 2**32)

    def keep_scale(self, batch: int, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype,
                   device) -> torch.Tensor:
        """[batch, heads, queries, keys]: ``1 / (1 - p)`` where kept, 0 where dropped."""
        rows = torch.arange(batch, dtype=torch.int64, device=device)
        heads = self.heads.to(device)
        q_pos, k_pos = q_pos.to(device=device, dtype=torch.int64), k_pos.to(device=device, dtype=torch.int64)
        per_row = mix32((mix32(rows ^ _GOLDEN) ^ self.seed) & _LOW32)
        per_head = mix32(per_row[:, None] ^ mix32(heads ^ (_GOLDEN >> 1)))
        per_query = mix32(per_head[:, :, None] ^ mix32(q_pos ^ (_GOLDEN >> 2)))
        per_key = mix32(per_query[..., None] ^ mix32(k_pos ^ (_GOLDEN >> 3)))
        kept = per_key >= self.threshold
        return kept.to(dtype) * (1.0 / (1.0 - self.p))
