"""What a checkpoint records about the run that wrote it, as flag name -> value.

A checkpoint only resumes into the model that wrote it: ``load_state_dict`` catches a changed shape with a
``RuntimeError`` naming tensors, and misses what changes no shape at all (ALiBi and RoPE weights have the
same shapes). So every checkpoint carries a small record of the flags that define the model and of the
flags that decide how its optimizer state is stored, in ``ascendspeed_record.json`` beside Megatron's
distributed-checkpoint files (whose own ``metadata.json`` says how they are stored; checkpoints of the
rank-file format kept the record under that name). A resume compares it before any weight is read and names
each flag that differs with both values.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable, Optional

METADATA_FILE = "ascendspeed_record.json"
#: Where checkpoints of the rank-file format (before Megatron's distributed format) kept the record.
RANK_FILE_FORMAT_METADATA_FILE = "metadata.json"
FORMAT_VERSION = 1

#: Entries derived from a flag: the entry is compared, the flag only named (``--make-vocab-size-divisible-by
#: 64`` and ``128`` both pad 256 bytes to 256 entries: the same model).
DERIVED = {"padded vocabulary size": "--make-vocab-size-divisible-by"}


def architecture(args: argparse.Namespace, padded_vocab_size: int) -> dict:
    """The flags that define the model's parameters and its function (effective values, defaults filled in).

    Position-embedding settings are recorded only for the type that reads them (ALiBi refuses the rotary
    flags; only learned absolute embeddings have a table of ``--max-position-embeddings`` rows)."""
    record = {
        "--num-layers": args.num_layers,
        "--hidden-size": args.hidden_size,
        "--ffn-hidden-size": args.ffn_hidden_size,
        "--num-attention-heads": args.num_attention_heads,
        "--num-query-groups": args.num_query_groups,
        "--kv-channels": args.kv_channels,
        "--position-embedding-type": args.position_embedding_type,
        "--normalization": args.normalization,
        "--norm-epsilon": args.norm_epsilon,
        "--swiglu": bool(args.swiglu),
        "--untie-embeddings-and-output-weights": bool(args.untie_embeddings_and_output_weights),
        "--disable-bias-linear": not args.add_bias_linear,
        "--make-vocab-size-divisible-by": args.make_vocab_size_divisible_by,
        "padded vocabulary size": padded_vocab_size,
    }
    if args.position_embedding_type == "learned_absolute":
        record["--max-position-embeddings"] = args.max_position_embeddings
    if args.position_embedding_type in ("rope", "mrope"):
        record["--rotary-percent"] = args.rotary_percent
        record["--rotary-base"] = args.rotary_base
        record["--rotary-interleaved"] = bool(getattr(args, "rotary_interleaved", False))
        record["--rotary-seq-len-interpolation-factor"] = getattr(args, "rotary_seq_len_interpolation_factor", None)
    return record


def optimizer_storage(args: argparse.Namespace) -> dict:
    """The flags that decide what the optimizer state in the rank files looks like."""
    return {
        "--optimizer": args.optimizer,
        "--bf16": bool(args.bf16),
        "--fp16": bool(args.fp16),
        "--use-distributed-optimizer": bool(args.use_distributed_optimizer),
        "--reuse-fp32-param": bool(getattr(args, "reuse_fp32_param", False)),
    }


def precision(storage: dict) -> str:
    return "bf16" if storage.get("--bf16") else "fp16" if storage.get("--fp16") else "fp32"


def differences(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(entry, checkpoint value, this run's value) for entries both records hold (an entry only one side
    holds follows from another that differs, or is newer than the checkpoint)."""
    return [(key, saved[key], current[key]) for key in current
            if key in saved and key not in DERIVED.values() and saved[key] != current[key]]


def describe(changes: list[tuple[str, object, object]], saved: dict) -> str:
    parts = []
    for key, old, new in changes:
        flag = DERIVED.get(key)
        origin = f" (set by {flag}; the checkpoint used {flag} {saved.get(flag)})" if flag else ""
        parts.append(f"{key}: checkpoint {old}, now {new}{origin}")
    return "; ".join(parts)


def as_flags(changes: list[tuple[str, object, object]], saved: dict) -> str:
    """The command-line flags that restore the checkpoint's values."""
    flags = []
    for key, old, _ in changes:
        key = DERIVED.get(key, key)
        old = saved.get(key, old)
        if isinstance(old, bool):
            if key == "--swiglu":
                flags.append("--swiglu" if old else "--no-swiglu")
            elif old:
                flags.append(key)
            else:
                flags.append(f"(no {key})")
        else:
            flags.append(f"{key} {old}")
    return " ".join(flags)


def write(directory: Path, iteration: int, layout: dict, args: argparse.Namespace, padded_vocab_size: int,
          atomic_write: Callable) -> Path:
    """Write ``directory/ascendspeed_record.json`` (rank 0, after every rank has written its part)."""
    record = {
        "format": FORMAT_VERSION,
        "iteration": iteration,
        "architecture": architecture(args, padded_vocab_size),
        "optimizer_storage": optimizer_storage(args),
        "layout": layout,
        "written_by": {"host": socket.gethostname(), "pid": os.getpid(),
                       "time": time.strftime("%Y-%m-%d %H:%M:%S")},
    }
    path = directory / METADATA_FILE
    atomic_write(path, lambda handle: handle.write(json.dumps(record, indent=1, sort_keys=True).encode()))
    return path


def read(directory: Path) -> Optional[dict]:
    """The record of a checkpoint directory; None for a checkpoint written before records existed or by
    another program (Megatron-LM)."""
    path = directory / METADATA_FILE
    if not path.is_file():
        path = directory / RANK_FILE_FORMAT_METADATA_FILE
        if not path.is_file() or not any(directory.glob("rank_*.pt")):
            return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as cause:
        raise ValueError(f"cannot read {path}: {type(cause).__name__}: {cause}") from cause
    if not isinstance(record, dict) or not isinstance(record.get("architecture"), dict):
        raise ValueError(f"{path} is not an ascendspeed checkpoint record")
    return record
