"""megatron-core's fused token-permutation branch on ascendspeed's operators.

With ``moe_permute_fusion`` megatron-core's dispatchers call ``permute``, ``unpermute`` and
``sort_chunks_by_idxs`` (``megatron.core.transformer.moe.moe_utils``) with ``fused=True``, and those call
Transformer Engine's ``fused_permute`` / ``fused_permute_with_probs`` / ``fused_unpermute`` /
``fused_sort_chunks_by_index`` / ``fused_sort_chunks_by_index_with_probs`` behind a ``HAVE_TE`` test, which
``TransformerConfig`` also asks before it lets the flag through. Here:

* the five names are set in ``moe_utils`` to ascendspeed implementations with the calling convention
  megatron-core uses for TE's (on 0.15 and 0.16 ``moe_utils`` defines no such names without TE: they are
  added; from 0.17 it sets them to None: they are replaced);
* the three functions are wrapped: with ``fused=True`` they run what their fused branch runs, on those
  names, without the ``HAVE_TE`` test; with ``fused=False`` megatron-core's own code runs.

The permutation's row map is ascendspeed's (``e * num_tokens + t`` per row), not TE's: only the fused
unpermute here reads it, as only TE's unpermute reads TE's.
"""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Optional

import torch

from ascendspeed.patching import ABSENT, EXISTS, Patch, replace, wrap

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"


def _ops():
    from ascendspeed.ops import moe_permute

    return moe_permute


# -- the names megatron-core calls TE's fused functions by -----------------------------------------------------
def fused_permute(tokens: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: Optional[int] = None):
    """``(permuted_tokens, row_id_map)``."""
    permuted, _, row_id_map = _ops().permute_tokens(tokens, routing_map, None, num_out_tokens)
    return permuted, row_id_map


def fused_permute_with_probs(tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                             num_out_tokens: Optional[int] = None):
    """``(permuted_tokens, permuted_probs, row_id_map)``."""
    return _ops().permute_tokens(tokens, routing_map, probs, num_out_tokens)


def fused_unpermute(permuted_tokens: torch.Tensor, row_id_map: torch.Tensor, merging_probs=None,
                    restore_shape=None, pad_offsets=None):
    """The tokens of ``restore_shape`` back in place, each the sum of its rows weighted by ``merging_probs``."""
    if pad_offsets is not None:
        raise ValueError("fused_unpermute: pad_offsets (rows padded for fp8/fp4 alignment) is Transformer "
                         "Engine's; ascendspeed's permutation pads nothing")
    if restore_shape is None:
        raise ValueError("fused_unpermute: restore_shape is needed to know the number of tokens")
    return _ops().unpermute_tokens(permuted_tokens, row_id_map, restore_shape[0], merging_probs)


def fused_sort_chunks_by_index(tokens: torch.Tensor, split_sizes: torch.Tensor, sorted_idxs: torch.Tensor):
    return _ops().sort_chunks(tokens, split_sizes, sorted_idxs)[0]


def fused_sort_chunks_by_index_with_probs(tokens: torch.Tensor, probs: torch.Tensor, split_sizes: torch.Tensor,
                                          sorted_idxs: torch.Tensor):
    return _ops().sort_chunks(tokens, split_sizes, sorted_idxs, probs)


def _moe_utils_function(name: str):
    """The function megatron-core's fused branch calls, looked up when called (the patch sets it)."""
    return getattr(sys.modules[MOE_UTILS], name)


# -- the fused branches of permute / unpermute / sort_chunks_by_idxs, without the HAVE_TE test ----------------
def _wrap_fused_branch(original, fused_branch):
    """``original`` with its arguments bound by name: ``fused=False`` runs it as called, ``fused=True`` runs
    ``fused_branch(arguments)`` (defaults filled in)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        if not call.arguments["fused"]:
            return original(*args, **kwargs)
        return fused_branch(call.arguments)

    return wrapper


def wrap_permute(original):
    """megatron-core's ``permute``: three outputs before 0.17, five (pad offsets, tokens per expert) since."""
    five_outputs = "tokens_per_expert" in inspect.signature(original).parameters

    def fused_branch(a):
        if a.get("align_size", 0) > 0 and a["probs"] is not None and a.get("tokens_per_expert") is not None:
            raise ValueError("permute: padding each expert's rows to align_size (fp8/fp4) is Transformer "
                             "Engine's fused_permute_and_pad_with_probs; ascendspeed's permutation pads nothing")
        if a["probs"] is None:
            permuted, row_id_map = _moe_utils_function("fused_permute")(
                a["tokens"], a["routing_map"], num_out_tokens=a["num_out_tokens"])
            permuted_probs = None
        else:
            permuted, permuted_probs, row_id_map = _moe_utils_function("fused_permute_with_probs")(
                a["tokens"], a["probs"], a["routing_map"], num_out_tokens=a["num_out_tokens"])
        if five_outputs:
            return permuted, permuted_probs, row_id_map, None, a["tokens_per_expert"]
        return permuted, permuted_probs, row_id_map

    return _wrap_fused_branch(original, fused_branch)


def wrap_unpermute(original):
    def fused_branch(a):
        extra = {"pad_offsets": a["pad_offsets"]} if a.get("pad_offsets") is not None else {}
        return _moe_utils_function("fused_unpermute")(
            a["permuted_tokens"], a["sorted_indices"], merging_probs=a["probs"], restore_shape=a["restore_shape"],
            **extra)

    return _wrap_fused_branch(original, fused_branch)


def wrap_sort_chunks_by_idxs(original):
    @functools.wraps(original)
    def sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=None, fused=False):  # noqa: A002 - upstream name
        if not fused:
            return original(input, split_sizes, sorted_idxs, probs, fused)
        if probs is None:
            return _moe_utils_function("fused_sort_chunks_by_index")(input, split_sizes, sorted_idxs), None
        return _moe_utils_function("fused_sort_chunks_by_index_with_probs")(input, probs, split_sizes, sorted_idxs)

    return sort_chunks_by_idxs


PERMUTE_V015 = "(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False)"
UNPERMUTE_V015 = ("(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False, "
                  "drop_and_pad=False)")


def _fused_name_patches(target: str, function) -> list[Patch]:
    """Set one of TE's fused names in ``moe_utils``: added on 0.15/0.16, a None replaced from 0.17."""
    name = f"moe_permute_fusion: {target.rsplit(':', 1)[1]} on ascendspeed's operators where TE is missing (replace)"
    return [replace(target, function, expect=ABSENT, megatron="<0.17", name=name),
            replace(target, function, expect=EXISTS, megatron=">=0.17", name=name)]


def patches() -> list[Patch]:
    permute = "moe_permute_fusion: permute(fused=True) on ascendspeed's operators where TE is missing (wrap)"
    unpermute = "moe_permute_fusion: unpermute(fused=True) on ascendspeed's operators where TE is missing (wrap)"
    sort_chunks = ("moe_permute_fusion: sort_chunks_by_idxs(fused=True) on ascendspeed's operators where TE is "
                   "missing (wrap)")
    return [
        *_fused_name_patches("megatron.core.transformer.moe.moe_utils:fused_permute", fused_permute),
        *_fused_name_patches("megatron.core.transformer.moe.moe_utils:fused_permute_with_probs",
                             fused_permute_with_probs),
        *_fused_name_patches("megatron.core.transformer.moe.moe_utils:fused_unpermute", fused_unpermute),
        *_fused_name_patches("megatron.core.transformer.moe.moe_utils:fused_sort_chunks_by_index",
                             fused_sort_chunks_by_index),
        *_fused_name_patches("megatron.core.transformer.moe.moe_utils:fused_sort_chunks_by_index_with_probs",
                             fused_sort_chunks_by_index_with_probs),
        wrap("megatron.core.transformer.moe.moe_utils:permute", wrap_permute, expect=PERMUTE_V015,
             megatron="<0.17", name=permute),
        wrap("megatron.core.transformer.moe.moe_utils:permute", wrap_permute,
             expect=PERMUTE_V015[:-1] + ", tokens_per_expert=None, align_size=-1)", megatron=">=0.17,<0.18",
             name=permute),
        wrap("megatron.core.transformer.moe.moe_utils:permute", wrap_permute,
             expect=PERMUTE_V015[:-1] + ", tokens_per_expert=None, align_size=0)", megatron=">=0.18", name=permute),
        wrap("megatron.core.transformer.moe.moe_utils:unpermute", wrap_unpermute, expect=UNPERMUTE_V015,
             megatron="<0.17", name=unpermute),
        wrap("megatron.core.transformer.moe.moe_utils:unpermute", wrap_unpermute,
             expect=UNPERMUTE_V015[:-1] + ", pad_offsets=None)", megatron=">=0.17", name=unpermute),
        wrap("megatron.core.transformer.moe.moe_utils:sort_chunks_by_idxs", wrap_sort_chunks_by_idxs,
             expect="(input, split_sizes, sorted_idxs, probs=None, fused=False)", name=sort_chunks),
    ]
