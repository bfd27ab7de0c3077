"""Training data: a byte-level view of plain text, split into training and validation parts.

The default job trains on a public-domain novel shipped with the package (see ``data/README.md``), so it
needs neither a download nor a tokenizer file. Bytes are tokens: any text in any encoding tokenizes, and
the loss per token is the loss per byte, which makes runs with different settings directly comparable.
"""
from __future__ import annotations

import dataclasses
import gzip
import zlib
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from ascendspeed.training.errors import DataError

DEFAULT_TEXT = Path(__file__).parent / "data" / "pride_and_prejudice.txt.gz"


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """Token id = byte value. ``vocab_size`` is 256 before Megatron's padding of the embedding table."""

    vocab_size: int = 256

    def encode(self, text: str) -> torch.Tensor:
        return bytes_to_tokens(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def bytes_to_tokens(data: bytes) -> torch.Tensor:
    """A uint8 tensor sharing nothing with ``data`` (kept compact: one byte per token)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Round up so every tensor-parallel shard of the embedding holds a multiple of ``divisible_by`` rows."""
    multiple = divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


def _read_file(path: Path) -> bytes:
    if not path.exists():
        raise DataError(f"--data-path: no such file: {path}")
    if not path.is_file():
        raise DataError(f"--data-path: {path} is not a file; name the text files themselves")
    try:
        if path.suffix != ".gz":
            return path.read_bytes()
        with gzip.open(path, "rb") as handle:
            return handle.read()
    except (gzip.BadGzipFile, EOFError, zlib.error) as cause:
        raise DataError(f"--data-path: {path} is not a complete gzip file ({type(cause).__name__}: {cause}); it is "
                        f"truncated or damaged: fetch it again (`gzip -t {path}` checks it), or, if it is plain "
                        f"text, rename it without .gz") from cause
    except OSError as cause:
        raise DataError(f"--data-path: cannot read {path}: {cause}") from cause


def read_text(paths: Optional[Sequence[str]] = None) -> bytes:
    """The bytes of ``paths`` (``.gz`` files are decompressed), joined by a blank line; the novel if none.

    Raises ``DataError`` naming the file for a missing, unreadable, damaged or empty file.
    """
    files = [Path(p) for p in paths] if paths else [DEFAULT_TEXT]
    parts = []
    for path in files:
        data = _read_file(path)
        if not data:
            raise DataError(f"--data-path: {path} is empty{' after decompression' if path.suffix == '.gz' else ''}; "
                            f"give a file with text in it")
        parts.append(data)
    return b"\n\n".join(parts)


def check_text_suffices(splits: "TextSplits", args, data_parallel_size: int) -> None:
    """Before the model is built: the training part holds one window of ``--seq-length + 1`` bytes, and
    the validation part one per data-parallel rank (what periodic validation needs at the least)."""
    source = f"--data-path {' '.join(args.data_path)}" if args.data_path else f"the embedded {DEFAULT_TEXT.name}"
    need = args.seq_length + 1
    interleaved = args.virtual_pipeline_model_parallel_size is not None
    windows = eval_windows(splits.valid, args.seq_length)
    plan = EvalPlan.fit(len(windows), args.micro_batch_size, data_parallel_size,
                        args.pipeline_model_parallel_size if interleaved else 1)
    if len(splits.train) < need:
        part = f"its training part has {len(splits.train):,} bytes, fewer than one sequence ({need} bytes)"
    elif plan is None:
        part = (f"its validation part has {len(splits.valid):,} bytes: {len(windows)} sequence(s), while "
                f"{data_parallel_size} data-parallel rank(s) need at least one each")
    else:
        return
    raise DataError(f"{source} is too short for --seq-length {args.seq_length} and --split {args.split}: {part}. "
                    f"Give more text, a smaller --seq-length, or a --split with a larger share for that part")


def parse_split(split: str) -> tuple[float, float]:
    """Megatron's ``--split`` weights ("95,5" or "969,30,1") as (train, validation) fractions.

    A third (test) weight is accepted for command-line compatibility; that part of the text goes unused.
    """
    try:
        weights = [float(w) for w in split.replace("/", ",").split(",") if w.strip()]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected comma-separated weights such as 95,5") from None
    if not 2 <= len(weights) <= 3 or any(w < 0 for w in weights) or weights[0] <= 0 or weights[1] <= 0:
        raise ValueError(f"--split {split!r}: need positive train and validation weights (e.g. 95,5)")
    total = sum(weights)
    return weights[0] / total, weights[1] / total


@dataclasses.dataclass(frozen=True)
class TextSplits:
    """Contiguous parts of one text: training first, validation after it, so validation text is unseen."""

    train: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def from_bytes(cls, data: bytes, split: str = "95,5") -> "TextSplits":
        train_fraction, valid_fraction = parse_split(split)
        tokens = bytes_to_tokens(data)
        train_end = int(len(tokens) * train_fraction)
        valid_end = train_end + int(len(tokens) * valid_fraction)
        return cls(train=tokens[:train_end], valid=tokens[train_end:valid_end])


@dataclasses.dataclass
class Batch:
    """One micro-batch as ``GPTModel.forward`` takes it; ``labels`` are ``tokens`` shifted by one."""

    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor

    @classmethod
    def from_windows(cls, windows: torch.Tensor, device: torch.device) -> "Batch":
        """``windows`` is [batch, length + 1] of token ids."""
        windows = windows.to(device=device, dtype=torch.long)
        length = windows.shape[1] - 1
        return cls(
            tokens=windows[:, :-1].contiguous(),
            labels=windows[:, 1:].contiguous(),
            position_ids=torch.arange(length, device=device).unsqueeze(0).expand(windows.shape[0], -1),
            attention_mask=causal_mask(length, device),
        )


def causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """Megatron's mask convention: [1, 1, s, s] bool, True where attention is forbidden (the future)."""
    return torch.ones(length, length, dtype=torch.bool, device=device).triu(diagonal=1).view(1, 1, length, length)


def _window_starts(num_tokens: int, seq_length: int, count: int, seed: int, iteration: int) -> torch.Tensor:
    """Random window offsets for one iteration, the same on every rank (each rank then takes its share)."""
    if num_tokens < seq_length + 1:
        raise DataError(f"training text has {num_tokens} tokens, fewer than --seq-length + 1 = {seq_length + 1}")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + iteration)
    return torch.randint(0, num_tokens - seq_length, (count,), generator=generator)


def train_microbatches(
    tokens: torch.Tensor,
    *,
    seq_length: int,
    micro_batch_size: int,
    num_microbatches: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    seed: int,
    iteration: int,
    device: torch.device,
) -> list[Batch]:
    """The micro-batches of training iteration ``iteration`` (0-based) for one data-parallel rank.

    Windows are drawn at random offsets from a generator keyed by (seed, iteration), so the data order
    depends on nothing but the iteration: resuming from a checkpoint continues the same stream.
    """
    per_rank = micro_batch_size * num_microbatches
    starts = _window_starts(len(tokens), seq_length, per_rank * data_parallel_size, seed, iteration)
    mine = starts[data_parallel_rank * per_rank:(data_parallel_rank + 1) * per_rank]
    offsets = torch.arange(seq_length + 1)
    windows = tokens[mine.unsqueeze(1) + offsets]
    return [Batch.from_windows(chunk, device) for chunk in windows.split(micro_batch_size)]


def eval_windows(tokens: torch.Tensor, length: int) -> torch.Tensor:
    """Non-overlapping windows [n, length + 1] covering ``tokens``: each token is predicted exactly once."""
    count = (len(tokens) - 1) // length
    if count == 0:
        return tokens.new_empty((0, length + 1))
    return tokens[: count * length + 1].unfold(0, length + 1, length)


@dataclasses.dataclass(frozen=True)
class EvalPlan:
    """How evaluation windows are dealt to data-parallel ranks: equal whole micro-batches per rank."""

    micro_batch_size: int
    num_microbatches: int

    @property
    def windows_per_rank(self) -> int:
        return self.micro_batch_size * self.num_microbatches

    @classmethod
    def fit(cls, num_windows: int, micro_batch_size: int, data_parallel_size: int,
            microbatch_multiple: int = 1) -> Optional["EvalPlan"]:
        """Shrink the micro-batch when there are few windows; None when not every rank gets enough.

        ``microbatch_multiple``: the interleaved pipeline schedule needs a multiple of the pipeline size.
        """
        per_rank = num_windows // data_parallel_size
        micro_batch_size = min(micro_batch_size, per_rank // microbatch_multiple)
        if micro_batch_size == 0:
            return None
        num_microbatches = per_rank // micro_batch_size // microbatch_multiple * microbatch_multiple
        return cls(micro_batch_size, num_microbatches)


def eval_microbatches(
    windows: torch.Tensor, plan: EvalPlan, data_parallel_rank: int, device: torch.device
) -> Iterator[Batch]:
    start = data_parallel_rank * plan.windows_per_rank
    mine = windows[start:start + plan.windows_per_rank]
    return (Batch.from_windows(chunk, device) for chunk in mine.split(plan.micro_batch_size))
