"""``DotProductAttention`` with separate key and value head sizes (multi-latent attention)."""
from __future__ import annotations

import functools
import math

from ascendspeed.patching import Patch, wrap


def set_head_sizes(attention, k_channels, v_channels, softmax_scale) -> None:
    """Give a built ``DotProductAttention`` key heads of ``k_channels`` (the default softmax scale follows them)
    and value heads of ``v_channels`` (its output is ``heads * v_channels`` wide). None keeps kv_channels."""
    if k_channels is not None:
        attention.hidden_size_per_attention_head = k_channels
        if softmax_scale is None:
            attention.softmax_scale = 1.0 / math.sqrt(k_channels)
            if attention.config.apply_query_key_layer_scaling:
                attention.softmax_scale /= attention.layer_number
    if v_channels is not None:
        attention.hidden_size_per_partition = v_channels * attention.num_attention_heads_per_partition


def wrap_attention_init(original):
    """``DotProductAttention(..., k_channels=None, v_channels=None)``: megatron-core's constructor, then the head
    sizes of multi-latent attention (the score and context products follow the tensors' own head sizes)."""

    @functools.wraps(original)
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, *, k_channels=None, v_channels=None):
        original(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                 softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        set_head_sizes(self, k_channels, v_channels, softmax_scale)

    return __init__


def patches() -> list[Patch]:
    return [
        wrap("megatron.core.transformer.dot_product_attention:DotProductAttention.__init__", wrap_attention_init,
             expect="(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None, "
                    "softmax_scale=None, cp_comm_type=None, pg_collection=None)",
             name="local MLA: wrap DotProductAttention.__init__ to take k_channels and v_channels"),
    ]
