"""``--context-parallel-size N`` with the local transformer: flags, validation and patches.

Flags keep the Ascend ecosystem's names so users' scripts carry over: ``--context-parallel-algo``,
``--ulysses-degree-in-cp``, ``--cp-attention-mask-type``. ``--context-parallel-size`` is Megatron-LM's.
"""
from __future__ import annotations

import argparse
from typing import Optional

from ascendspeed.features.base import Feature, FeatureArgumentError, Unsupported, defaults_of, refuse_unsupported
from ascendspeed.features.context_parallel import megatron_attention
from ascendspeed.features.context_parallel.telemetry import RingOverlapReport, RingTelemetry
from ascendspeed.features.context_parallel.settings import (
    ALGORITHMS,
    HYBRID,
    MASK_TYPES,
    RING,
    ULYSSES,
    ContextParallelSettings,
)

#: Flag values context parallelism cannot run with.
UNSUPPORTED = (
    Unsupported("sft", "--sft", False, "packed sequences are not supported"),
    Unsupported("window_size", "--window-size", None, "sliding-window attention is not supported"),
    Unsupported("softmax_type", "--softmax-type", "vanilla", "only the vanilla softmax is supported"),
    Unsupported("use_legacy_models", "--use-legacy-models", False, "legacy models are not supported"),
    Unsupported("hybrid_context_parallel", "--hybrid-context-parallel", False,
                "Megatron's dynamic context parallelism of packed sequences is not supported; ascendspeed's "
                "hybrid is --context-parallel-algo hybrid_cp_algo --ulysses-degree-in-cp K"),
)

#: What Transformer Engine's ``--cp-comm-type`` values correspond to with the local transformer.
ALGORITHM_OF_CP_COMM_TYPE = {"p2p": RING, "a2a": ULYSSES, "a2a+p2p": HYBRID}


class ContextParallelFeature(Feature[ContextParallelSettings]):
    name = "context_parallel"
    example_flags = ("--context-parallel-size", "2")
    megatron_arguments = {
        "context_parallel_size": 1,
        "transformer_impl": "local",
        "reset_attention_mask": False,
        "num_attention_heads": None,
        "tensor_model_parallel_size": 1,
        "seq_length": None,
        "cp_comm_type": ["p2p"],
        **defaults_of(UNSUPPORTED),
    }

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("ascendspeed context parallelism")
        group.add_argument(
            "--context-parallel-algo", choices=ALGORITHMS, default=RING,
            help="How attention runs over the --context-parallel-size ranks of a sequence: megatron_cp_algo "
            "(ring attention), ulysses_cp_algo (all-to-all to a head split), hybrid_cp_algo (Ulysses inside "
            "groups of --ulysses-degree-in-cp ranks, ring across them).",
        )
        group.add_argument(
            "--ulysses-degree-in-cp", type=int, default=None,
            help="Ulysses group size of --context-parallel-algo hybrid_cp_algo; divides --context-parallel-size.",
        )
        group.add_argument(
            "--cp-attention-mask-type", choices=MASK_TYPES, default="causal",
            help="causal: mask by token position (the data's attention mask is not read); general: apply the "
            "attention mask of the batch (e.g. --reset-attention-mask) to every block.",
        )
        group.add_argument(
            "--log-cp-ring-overlap", action="store_true",
            help="Time every ring hop (a watcher thread per hop) to report how much of the ring's communication "
            "the block computation hid (in the pretraining entry: a line per logging interval and a run total).",
        )

    def is_enabled(self, args: argparse.Namespace) -> bool:
        return (getattr(args, "context_parallel_size", 1) or 1) > 1 and \
            getattr(args, "transformer_impl", "local") == "local"

    def validate(self, args: argparse.Namespace) -> None:
        cp = getattr(args, "context_parallel_size", 1) or 1
        algorithm = getattr(args, "context_parallel_algo", RING)
        degree = getattr(args, "ulysses_degree_in_cp", None)
        if degree is not None and algorithm != HYBRID:
            raise FeatureArgumentError(
                f"--ulysses-degree-in-cp only applies to --context-parallel-algo {HYBRID}; drop it or choose "
                f"{HYBRID}"
            )
        self._validate_layout(args, cp, algorithm, degree)
        self._validate_ring_telemetry(args, cp, algorithm, degree)

    def _validate_layout(self, args: argparse.Namespace, cp: int, algorithm: str, degree) -> None:
        if cp == 1:
            return
        if getattr(args, "transformer_impl", "local") != "local":
            if algorithm != RING:
                raise FeatureArgumentError(
                    f"--context-parallel-algo {algorithm} runs in the local transformer; with --transformer-impl "
                    f"{args.transformer_impl} context parallelism is Transformer Engine's: use --transformer-impl "
                    "local or drop --context-parallel-algo"
                )
            return
        refuse_unsupported(args, UNSUPPORTED, f"--context-parallel-size {cp}")
        self._refuse_cp_comm_type(args)
        if getattr(args, "reset_attention_mask", False) and getattr(args, "cp_attention_mask_type", "causal") != "general":
            raise FeatureArgumentError(
                "--reset-attention-mask builds document masks, which --cp-attention-mask-type causal ignores: "
                "pass --cp-attention-mask-type general"
            )
        seq_length = getattr(args, "seq_length", None)
        if seq_length is not None and seq_length % (2 * cp):
            raise FeatureArgumentError(
                f"--seq-length {seq_length} must divide by 2 x --context-parallel-size = {2 * cp}: each rank holds "
                "two of 2 x cp equal chunks (the balanced causal layout)"
            )
        heads = getattr(args, "num_attention_heads", None)
        tp = getattr(args, "tensor_model_parallel_size", 1) or 1
        ulysses = {ULYSSES: cp, HYBRID: degree, RING: 1}[algorithm]
        if algorithm == HYBRID:
            if degree is None or degree < 1 or cp % degree:
                raise FeatureArgumentError(
                    f"--context-parallel-algo {HYBRID} needs --ulysses-degree-in-cp K dividing "
                    f"--context-parallel-size {cp} (got {degree})"
                )
        if heads is not None and (heads % tp or (heads // tp) % ulysses):
            raise FeatureArgumentError(
                f"--context-parallel-algo {algorithm} splits the {heads} attention heads (--num-attention-heads) "
                f"over --tensor-model-parallel-size {tp} x a Ulysses degree of {ulysses}"
                f"{' (--context-parallel-size)' if algorithm == ULYSSES else ' (--ulysses-degree-in-cp)'}: "
                f"they must divide it; choose sizes whose product divides {heads}"
            )

    @staticmethod
    def _refuse_cp_comm_type(args) -> None:
        """Megatron-LM's ``--cp-comm-type`` picks Transformer Engine's communication; the local transformer
        would ignore it, so anything but its default is refused with the matching algorithm named."""
        comm = getattr(args, "cp_comm_type", None) or ["p2p"]
        comm = [comm] if isinstance(comm, str) else list(comm)
        if set(comm) == {"p2p"}:
            return
        suggestions = ", ".join(f"{kind} -> --context-parallel-algo {algorithm}"
                                for kind, algorithm in ALGORITHM_OF_CP_COMM_TYPE.items())
        raise FeatureArgumentError(
            f"--cp-comm-type {' '.join(comm)} selects Transformer Engine's context-parallel communication, which "
            f"--transformer-impl local does not use: drop --cp-comm-type and choose --context-parallel-algo "
            f"({suggestions}; allgather has no counterpart)"
        )

    @staticmethod
    def _validate_ring_telemetry(args, cp: int, algorithm: str, degree) -> None:
        """``--log-cp-ring-overlap`` needs a ring of at least two ranks to time."""
        if not getattr(args, "log_cp_ring_overlap", False):
            return
        ring_size = {RING: cp, HYBRID: cp // (degree or cp), ULYSSES: 1}[algorithm]
        impl = getattr(args, "transformer_impl", "local")
        if ring_size < 2 or impl != "local":
            given = [f"--context-parallel-size {cp}", f"--context-parallel-algo {algorithm}"]
            given += [f"--ulysses-degree-in-cp {degree}"] if algorithm == HYBRID else []
            given += [f"--transformer-impl {impl}"] if impl != "local" else []
            raise FeatureArgumentError(
                f"--log-cp-ring-overlap times the hops of ascendspeed's ring attention, and this run has none "
                f"({', '.join(given)}): drop the flag, or use {RING} (or {HYBRID} with two or more Ulysses "
                f"groups) at --context-parallel-size 2 or more with --transformer-impl local"
            )

    def settings(self, args: argparse.Namespace) -> ContextParallelSettings:
        algorithm = getattr(args, "context_parallel_algo", RING)
        return ContextParallelSettings(
            algorithm=algorithm,
            ulysses_degree=(getattr(args, "ulysses_degree_in_cp", None) or 1) if algorithm == HYBRID else 1,
            mask_type=getattr(args, "cp_attention_mask_type", "causal"),
            telemetry=bool(getattr(args, "log_cp_ring_overlap", False)),
        )

    def new_state(self, settings: ContextParallelSettings) -> megatron_attention.ContextParallelState:
        return megatron_attention.ContextParallelState(ring=RingTelemetry() if settings.telemetry else None)

    def patches(self, settings: ContextParallelSettings, state=None):
        return megatron_attention.patches(settings, state if state is not None else self.new_state(settings))

    def telemetry(self, state) -> Optional[RingOverlapReport]:
        return RingOverlapReport(state.ring) if state is not None and state.ring is not None else None

    def configure_transformer_config(self, config, settings) -> None:
        """Nothing to carry: the patches hold the settings, Megatron's config holds the size."""

