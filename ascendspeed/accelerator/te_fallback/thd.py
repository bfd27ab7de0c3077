"""megatron-core's split of a packed (THD) batch over the context-parallel ranks, without Transformer Engine.

megatron-core 0.18+ (``utils._get_batch_on_this_cp_rank_per_document_balancing``, reached from
``get_batch_on_this_cp_rank`` when the batch carries ``cu_seqlens``) asks TE's C++ extension,
``transformer_engine_torch.thd_get_partitioned_indices``, which tokens of every document each rank keeps; the
module global ``tex`` is None where TE is absent. The stand-in gives the same indices from ascendspeed's layout
(``context_parallel.layout.packed_positions_on_rank``), the split that context-parallel attention over a pack
and the packed RoPE stand-in expect.
"""
from __future__ import annotations

import types

import torch

from ascendspeed.patching import EXISTS, replace


def thd_get_partitioned_indices(cu_seqlens: torch.Tensor, total_tokens: int, world_size: int,
                                rank: int) -> torch.Tensor:
    """TE's contract: the indices (in the pack of ``total_tokens``) of the tokens rank ``rank`` of
    ``world_size`` keeps, every document bounded by ``cu_seqlens`` cut into ``2 * world_size`` chunks."""
    from ascendspeed.features.context_parallel import layout

    bounds = cu_seqlens.to("cpu", torch.int64)
    if int(bounds[-1]) != total_tokens:
        raise ValueError(f"thd_get_partitioned_indices: the documents {bounds.tolist()} must fill the pack of "
                         f"{total_tokens} tokens; pad the last document (cu_seqlens_padded)")
    return layout.packed_positions_on_rank(bounds, rank, world_size).to(cu_seqlens.device)


#: What megatron-core reads of TE's C++ extension (``megatron.core.utils.tex``).
TEX_STAND_IN = types.SimpleNamespace(thd_get_partitioned_indices=thd_get_partitioned_indices)


def patches():
    return [
        replace("megatron.core.utils:tex", TEX_STAND_IN, expect=EXISTS, sweep=False, megatron=">=0.18",
                name="TE fallback: replace megatron.core.utils.tex (None without TE) by the THD batch split "
                     "over context-parallel ranks"),
    ]
