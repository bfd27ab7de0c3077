"""What the tensor-parallel communication features run with, fixed when the feature is applied."""
from __future__ import annotations

import dataclasses
from typing import Optional

from ascendspeed.features.tp_comm_overlap.recompute import RecomputeTracker
from ascendspeed.features.tp_comm_overlap.telemetry import TpCommRecorder


@dataclasses.dataclass(frozen=True)
class TpCommState:
    """What one application keeps while it runs: the collective recorder (``--log-tp-comm-overlap``) and the
    checkpoint tracker (``--optimize-recomp-communication-level``), each None when not asked for."""

    recorder: Optional[TpCommRecorder] = None
    recompute: Optional[RecomputeTracker] = None


@dataclasses.dataclass(frozen=True)
class TpCommOverlapSettings:
    """``overlap``: the linears run the chunked kernels (``--use-ascend-coc``) or MC2 (``--use-ascend-mc2``:
    torch_npu's fused all-gather-matmul / matmul-reduce-scatter for the sequence-parallel linears, the chunked
    kernels for the others). ``chunks``: ``--coc-parallel-num``. ``recompute_level``:
    ``--optimize-recomp-communication-level`` (0: off). ``log_overlap``: ``--log-tp-comm-overlap``.
    ``cpu_fp32_gemm_dtypes``: the half-precision dtypes the chunked kernels multiply in fp32 on a CPU (those it
    has no fast GEMM for, ``ascendspeed.accelerator.cpu_half_gemm``). ``state``: what the application the
    patches are bound to keeps (not part of the settings' identity).
    """

    overlap: bool = True
    chunks: int = 2
    mc2: bool = False
    recompute_level: int = 0
    log_overlap: bool = False
    cpu_fp32_gemm_dtypes: frozenset = frozenset()
    state: TpCommState = dataclasses.field(default_factory=TpCommState, compare=False)

    @property
    def recorder(self) -> Optional[TpCommRecorder]:
        return self.state.recorder

    @property
    def recompute(self) -> Optional[RecomputeTracker]:
        return self.state.recompute
