"""``--use-ascend-coc`` / ``--coc-parallel-num`` / ``--use-ascend-mc2`` (the Ascend plugin's names): when they
are on, what they refuse, and the telemetry ``--log-tp-comm-overlap`` adds."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from ascendspeed.accelerator import te_fallback
from ascendspeed.features.base import Feature, FeatureArgumentError
from ascendspeed.features.tp_comm_overlap.settings import TpCommOverlapSettings
from ascendspeed.features.tp_comm_overlap.telemetry import TpCommOverlapReport, TpCommRecorder

CHUNK_CHOICES = (1, 2, 4, 8)
DEFAULT_CHUNKS = 2


class TpCommOverlapFeature(Feature[TpCommOverlapSettings]):
    name = "tp_comm_overlap"
    example_flags = ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-ascend-coc",
                     "--coc-parallel-num", "4")
    megatron_arguments = {
        "tensor_model_parallel_size": 1,
        "sequence_parallel": False,
        "transformer_impl": "local",
        "tp_comm_overlap": False,
    }

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("ascendspeed tensor-parallel communication overlap")
        group.add_argument(
            "--use-ascend-coc", action="store_true",
            help="Communication over computation: every tensor-parallel linear splits its GEMM and collective "
            "into --coc-parallel-num chunks along the sequence, so each chunk's all-gather, reduce-scatter or "
            "all-reduce runs while the next chunk computes, forward and backward. Any device and process group.",
        )
        group.add_argument(
            "--coc-parallel-num", type=int, choices=CHUNK_CHOICES, default=None,
            help=f"With --use-ascend-coc, the chunks per GEMM (default {DEFAULT_CHUNKS}).",
        )
        group.add_argument(
            "--use-ascend-mc2", action="store_true",
            help="On Ascend NPUs with tensor and sequence parallelism, run the sequence-parallel linears as "
            "torch_npu's fused all-gather-matmul and matmul-reduce-scatter kernels.",
        )
        group.add_argument(
            "--log-tp-comm-overlap", action="store_true",
            help="With --use-ascend-coc or --use-ascend-mc2, time every tensor-parallel collective of the "
            "linears and report communication time, exposed time and hidden fraction (in the pretraining entry: a "
            "line per logging interval and a run total).",
        )

    def is_enabled(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, "use_ascend_coc", False) or getattr(args, "use_ascend_mc2", False))

    def validate(self, args: argparse.Namespace) -> None:
        coc, mc2 = getattr(args, "use_ascend_coc", False), getattr(args, "use_ascend_mc2", False)
        chunks = getattr(args, "coc_parallel_num", None)
        if chunks is not None and not coc:
            raise FeatureArgumentError(
                f"--coc-parallel-num {chunks} sets the chunks of --use-ascend-coc, which is off: add "
                "--use-ascend-coc or drop --coc-parallel-num")
        if getattr(args, "log_tp_comm_overlap", False) and not (coc or mc2):
            raise FeatureArgumentError(
                "--log-tp-comm-overlap times the collectives of --use-ascend-coc / --use-ascend-mc2, and neither "
                "is on: add one of them or drop --log-tp-comm-overlap")
        if not (coc or mc2):
            return
        flag = "--use-ascend-mc2" if mc2 else "--use-ascend-coc"
        if coc and mc2:
            raise FeatureArgumentError(
                "--use-ascend-coc and --use-ascend-mc2 overlap the same collectives two ways: pick one "
                "(--use-ascend-mc2 on Ascend NPUs, --use-ascend-coc anywhere)")
        tp = getattr(args, "tensor_model_parallel_size", 1) or 1
        if tp < 2:
            raise FeatureArgumentError(
                f"{flag} overlaps tensor-parallel communication, and --tensor-model-parallel-size {tp} has none: "
                f"use --tensor-model-parallel-size 2 or more, or drop {flag}")
        if getattr(args, "tp_comm_overlap", False):
            raise FeatureArgumentError(
                f"{flag} and --tp-comm-overlap (Transformer Engine's userbuffers) overlap the same collectives: "
                "pick one")
        if not te_fallback.serves_local_modules(args):
            raise FeatureArgumentError(
                f"{flag} chunks megatron-core's tensor-parallel linears, and with Transformer Engine installed "
                "--transformer-impl transformer_engine builds TE's own: use --transformer-impl local, or TE's "
                f"--tp-comm-overlap instead of {flag}")
        if mc2:
            self._validate_mc2(args)

    @staticmethod
    def _validate_mc2(args: argparse.Namespace) -> None:
        from ascendspeed.features.tp_comm_overlap.mc2 import mc2_absence

        if not getattr(args, "sequence_parallel", False):
            raise FeatureArgumentError(
                "--use-ascend-mc2 fuses the all-gather and reduce-scatter of sequence parallelism into the "
                "matmul: add --sequence-parallel, or use --use-ascend-coc, which also overlaps the all-reduce "
                "of tensor parallelism without it")
        absence = mc2_absence()
        if absence is not None:
            raise FeatureArgumentError(
                f"--use-ascend-mc2 needs torch_npu's fused kernels on an Ascend NPU, and {absence}: use "
                "--use-ascend-coc, the portable equivalent (the same overlap, chunked, on any device)")

    def settings(self, args: argparse.Namespace) -> TpCommOverlapSettings:
        return TpCommOverlapSettings(
            chunks=getattr(args, "coc_parallel_num", None) or DEFAULT_CHUNKS,
            mc2=bool(getattr(args, "use_ascend_mc2", False)),
            log_overlap=bool(getattr(args, "log_tp_comm_overlap", False)),
        )

    def new_state(self, settings: TpCommOverlapSettings) -> Optional[TpCommRecorder]:
        return TpCommRecorder() if settings.log_overlap else None

    def patches(self, settings: TpCommOverlapSettings, state: Optional[TpCommRecorder] = None):
        from ascendspeed.features.tp_comm_overlap import layers

        if settings.log_overlap and state is None:
            state = self.new_state(settings)
        return layers.patches(dataclasses.replace(settings, recorder=state))

    def telemetry(self, state: Optional[TpCommRecorder]) -> Optional[TpCommOverlapReport]:
        return TpCommOverlapReport(state) if state is not None else None
