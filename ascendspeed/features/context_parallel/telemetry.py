"""How much of the ring's communication the block computation hid.

Each ring pass records the seconds spent computing blocks and the seconds spent blocked in ``wait()`` on
a hop (the exposed communication). The time one hop takes on its own is measured separately (see
``bench/bench_context_parallel.py``): hidden fraction = 1 - exposed / (hops x time per hop).
Timing is host clock; on devices it is only meaningful after a synchronisation, so enable it to measure.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RingTelemetry:
    compute_s: float = 0.0
    exposed_s: float = 0.0
    sent_bytes: int = 0

    def hidden_fraction(self, communication_s: float) -> float:
        """The share of ``communication_s`` (time the hops take without overlap) that was not waited for."""
        if communication_s <= 0:
            return 0.0
        return max(0.0, 1.0 - self.exposed_s / communication_s)

    def reset(self) -> None:
        self.compute_s = self.exposed_s = 0.0
        self.sent_bytes = 0
