"""The typed settings of context parallelism (from ``--context-parallel-algo`` and friends)."""
from __future__ import annotations

import dataclasses

RING = "megatron_cp_algo"
ULYSSES = "ulysses_cp_algo"
HYBRID = "hybrid_cp_algo"
ALGORITHMS = (ULYSSES, RING, HYBRID)
MASK_TYPES = ("causal", "general")


@dataclasses.dataclass(frozen=True)
class ContextParallelSettings:
    """``algorithm``: one of ``ALGORITHMS``; ``ulysses_degree``: Ulysses group size of the hybrid algorithm;
    ``mask_type``: ``causal`` (mask from positions, Megatron's ``attention_mask`` ignored) or ``general``
    (Megatron's ``attention_mask`` rows are applied, columns indexed by absolute key position);
    ``telemetry``: ring hops are timed into the application's ``ContextParallelState.ring``."""

    algorithm: str = RING
    ulysses_degree: int = 1
    mask_type: str = "causal"
    telemetry: bool = False

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"context parallel algorithm {self.algorithm!r} is not one of {', '.join(ALGORITHMS)}")
        if self.mask_type not in MASK_TYPES:
            raise ValueError(f"cp attention mask type {self.mask_type!r} is not one of {', '.join(MASK_TYPES)}")
