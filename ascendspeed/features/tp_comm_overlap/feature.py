"""``--use-ascend-coc`` / ``--coc-parallel-num`` / ``--use-ascend-mc2`` / ``--optimize-recomp-communication-level``
(the Ascend plugin's names): when they are on, what they refuse, and the telemetry ``--log-tp-comm-overlap``
adds."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from ascendspeed.accelerator import te_fallback
from ascendspeed.features.base import Feature, FeatureArgumentError
from ascendspeed.features.tp_comm_overlap.recompute import RecomputeTracker
from ascendspeed.features.tp_comm_overlap.settings import TpCommOverlapSettings, TpCommState
from ascendspeed.features.tp_comm_overlap.telemetry import TpCommOverlapReport, TpCommRecorder

CHUNK_CHOICES = (1, 2, 4, 8)
DEFAULT_CHUNKS = 2


class TpCommOverlapFeature(Feature[TpCommOverlapSettings]):
    name = "tp_comm_overlap"
    example_flags = ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-ascend-coc",
                     "--coc-parallel-num", "4", "--recompute-granularity", "full",
                     "--optimize-recomp-communication-level", "2")
    megatron_arguments = {
        "tensor_model_parallel_size": 1,
        "sequence_parallel": False,
        "transformer_impl": "local",
        "tp_comm_overlap": False,
        "recompute_granularity": None,
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
            "--optimize-recomp-communication-level", type=int, choices=(0, 1, 2), default=0,
            help="With --recompute-granularity full and tensor parallelism, leave out the recomputed forward's "
            "redundant collectives: 1, each checkpointed chunk's last row-parallel reduction (its result is "
            "not needed for backward); 2 (with --sequence-parallel), also the backward re-gather of every "
            "column-parallel input, which the recomputed forward has just gathered. Losses are unchanged.",
        )
        group.add_argument(
            "--log-tp-comm-overlap", action="store_true",
            help="With --use-ascend-coc or --use-ascend-mc2, time every tensor-parallel collective of the "
            "linears and report communication time, exposed time and hidden fraction (in the pretraining entry: a "
            "line per logging interval and a run total).",
        )

    def is_enabled(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, "use_ascend_coc", False) or getattr(args, "use_ascend_mc2", False)
                    or _recompute_level(args))

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
        if _recompute_level(args):
            self._validate_recompute(args)
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
    def _validate_recompute(args: argparse.Namespace) -> None:
        level = _recompute_level(args)
        flag = f"--optimize-recomp-communication-level {level}"
        granularity = getattr(args, "recompute_granularity", None)
        if granularity != "full":
            raise FeatureArgumentError(
                f"{flag} removes collectives from the recomputed forward of full recompute, and this run has "
                f"--recompute-granularity {granularity}: add --recompute-granularity full or drop {flag}")
        tp = getattr(args, "tensor_model_parallel_size", 1) or 1
        if tp < 2:
            raise FeatureArgumentError(
                f"{flag} removes tensor-parallel collectives, and --tensor-model-parallel-size {tp} has none: use "
                f"--tensor-model-parallel-size 2 or more, or drop {flag}")
        if level == 2 and not getattr(args, "sequence_parallel", False):
            raise FeatureArgumentError(
                f"{flag} also keeps the all-gathered inputs of sequence parallelism, and --sequence-parallel is "
                "off: add --sequence-parallel or use level 1")
        if not te_fallback.serves_local_modules(args):
            raise FeatureArgumentError(
                f"{flag} works on megatron-core's tensor-parallel linears, and with Transformer Engine installed "
                "--transformer-impl transformer_engine builds TE's own: use --transformer-impl local")

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
        from ascendspeed.accelerator.cpu_half_gemm import widened_dtypes

        coc, mc2 = bool(getattr(args, "use_ascend_coc", False)), bool(getattr(args, "use_ascend_mc2", False))
        return TpCommOverlapSettings(
            overlap=coc or mc2,
            chunks=getattr(args, "coc_parallel_num", None) or DEFAULT_CHUNKS,
            mc2=mc2,
            recompute_level=_recompute_level(args),
            log_overlap=bool(getattr(args, "log_tp_comm_overlap", False)),
            cpu_fp32_gemm_dtypes=widened_dtypes(),
        )

    def new_state(self, settings: TpCommOverlapSettings) -> TpCommState:
        return TpCommState(recorder=TpCommRecorder() if settings.log_overlap else None,
                           recompute=RecomputeTracker() if settings.recompute_level else None)

    def patches(self, settings: TpCommOverlapSettings, state: Optional[TpCommState] = None):
        from ascendspeed.features.tp_comm_overlap import layers

        return layers.patches(dataclasses.replace(settings, state=state or self.new_state(settings)))

    def telemetry(self, state: Optional[TpCommState]) -> Optional[TpCommOverlapReport]:
        return TpCommOverlapReport(state.recorder) if state is not None and state.recorder is not None else None


def _recompute_level(args: argparse.Namespace) -> int:
    return getattr(args, "optimize_recomp_communication_level", 0) or 0
