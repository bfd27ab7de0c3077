"""Attention-mask facts the attention features share (Megatron's convention: a bool mask, True where a query
may not attend)."""
from __future__ import annotations

import weakref

import torch

#: id(mask) -> (a weak reference to it, its version then, whether it is exactly the causal triangle): the
#: layers of a model share each step's mask, so it is checked once per step. Tensors compare elementwise,
#: so they are looked up by identity; an entry goes when its mask does.
_PLAIN_CAUSAL: dict[int, tuple[weakref.ref, int, bool]] = {}


def is_plain_causal(mask: torch.Tensor, sq: int, sk: int) -> bool:
    """Whether ``mask`` (True: masked out) is the causal triangle in every batch and head it spans."""
    known = _PLAIN_CAUSAL.get(id(mask))
    if known is not None and known[0]() is mask and known[1] == mask._version:
        return known[2]
    triangle = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu(diagonal=1)
    answer = mask.shape[-2:] == (sq, sk) and bool(torch.equal(mask, triangle.expand_as(mask)))
    key = id(mask)
    _PLAIN_CAUSAL[key] = (weakref.ref(mask, lambda _, key=key: _PLAIN_CAUSAL.pop(key, None)), mask._version, answer)
    return answer
