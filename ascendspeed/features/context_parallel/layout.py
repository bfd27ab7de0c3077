"""Which tokens each context-parallel rank holds: the load-balanced chunk layout for causal attention.

The sequence of length ``S`` is cut into ``2 * cp`` equal chunks and rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r``, in that order. Under a causal mask the early chunks attend to few keys and the late
ones to many, so pairing an early chunk with a late one gives every rank the same amount of work.

A pack of sequences (Transformer Engine's ``thd`` format: sequences one after another, bounded by
``cu_seqlens``) is split sequence by sequence: every sequence is cut into ``2 * cp`` chunks and rank ``r``
holds chunks ``r`` and ``2 * cp - 1 - r`` of each, sequence after sequence. Positions in a pack count
through the whole pack, so a key is visible to a query of its own sequence only (``segment_ids``).

Positions are kept as int64 CPU tensors: they are small, and the ring plans its blocks from them on
the host without synchronising a device.
"""
from __future__ import annotations

from typing import Sequence

import torch


def check_divisible(seq_length: int, cp_size: int) -> None:
    if cp_size < 1:
        raise ValueError(f"context parallel size must be >= 1, got {cp_size}")
    if seq_length % (2 * cp_size):
        raise ValueError(
            f"the balanced context-parallel layout cuts the sequence into 2 x cp = {2 * cp_size} chunks; "
            f"sequence length {seq_length} does not divide by it: choose --seq-length a multiple of {2 * cp_size}"
        )


def chunk_ids(rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp_size``) that rank ``rank`` holds, earliest first."""
    if not 0 <= rank < cp_size:
        raise ValueError(f"context parallel rank {rank} outside [0, {cp_size})")
    return rank, 2 * cp_size - 1 - rank


def positions_on_rank(seq_length: int, rank: int, cp_size: int) -> torch.Tensor:
    """Absolute positions of the tokens rank ``rank`` holds, in the order it holds them (ascending)."""
    check_divisible(seq_length, cp_size)
    chunk = seq_length // (2 * cp_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunk_ids(rank, cp_size)])


def split_for_rank(tensor: torch.Tensor, dim: int, rank: int, cp_size: int) -> torch.Tensor:
    """This rank's two chunks of ``tensor`` along its sequence dimension ``dim`` (a new tensor)."""
    check_divisible(tensor.size(dim), cp_size)
    chunks = tensor.chunk(2 * cp_size, dim=dim)
    first, second = chunk_ids(rank, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def packed_positions_on_rank(bounds: torch.Tensor, rank: int, cp_size: int) -> torch.Tensor:
    """Positions in the pack (ascending) of the tokens rank ``rank`` holds of the sequences bounded by ``bounds``."""
    bounds = bounds.to("cpu", torch.int64)
    pieces = []
    for start, length in zip(bounds[:-1].tolist(), bounds.diff().tolist()):
        if cp_size == 1:
            pieces.append(torch.arange(start, start + length))
            continue
        if length % (2 * cp_size):
            raise ValueError(
                f"a packed sequence of {length} tokens cannot be split into {2 * cp_size} equal chunks for context "
                f"parallelism over {cp_size} ranks: pad it to a multiple of {2 * cp_size} (cu_seqlens_padded)"
            )
        pieces.append(start + positions_on_rank(length, rank, cp_size))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def segment_ids(positions: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """The index of the sequence (of those bounded by ``bounds``) each position of a pack lies in."""
    return torch.searchsorted(bounds[1:].to(positions.device), positions, right=True)


def merge_from_ranks(pieces: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The inverse of ``split_for_rank``: the full sequence from every rank's piece (in rank order)."""
    cp_size = len(pieces)
    chunks = [None] * (2 * cp_size)
    for rank, piece in enumerate(pieces):
        first, second = chunk_ids(rank, cp_size)
        chunks[first], chunks[second] = piece.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)
