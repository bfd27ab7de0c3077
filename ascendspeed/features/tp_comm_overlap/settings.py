"""What the tensor-parallel communication overlap runs with, fixed when the feature is applied."""
from __future__ import annotations

import dataclasses
from typing import Optional

from ascendspeed.features.tp_comm_overlap.telemetry import TpCommRecorder


@dataclasses.dataclass(frozen=True)
class TpCommOverlapSettings:
    """``chunks``: ``--coc-parallel-num``, the pieces each GEMM and its collective are split into.
    ``mc2``: sequence-parallel linears run torch_npu's fused all-gather-matmul / matmul-reduce-scatter
    (``--use-ascend-mc2``); the linears without sequence parallelism keep the chunked kernels.
    ``log_overlap``: time every collective (``--log-tp-comm-overlap``).
    ``recorder``: the recorder of the application the patches are bound to (None without ``log_overlap``).
    """

    chunks: int = 2
    mc2: bool = False
    log_overlap: bool = False
    recorder: Optional[TpCommRecorder] = dataclasses.field(default=None, compare=False)
