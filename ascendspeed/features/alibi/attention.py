"""ALiBi inside megatron-core's attention: the feature's patches and what they install.

Which models use ALiBi is decided per model: ``GPTModel(position_embedding_type="alibi")`` (or an entry
that knows the flags, through ``configure_transformer_config``) marks the model's ``TransformerConfig``
with the feature's ``AlibiSettings`` under the one declared attribute ``CONFIG_ATTRIBUTE``. Each
self-attention ``DotProductAttention`` built from such a config holds an ``AlibiLayer`` (``.alibi``):

* local path: Megatron's own forward runs unchanged; its ``FusedScaleMaskSoftmax`` receives the scaled
  ``baddbmm`` scores and first adds the bias in place (``ascendspeed::alibi_bias_``), then normalises
  them with subnormals flushed to zero;
* fused path (``AlibiSettings(fused=True)``, or ``fused_where_exact`` with a fused ``attention_backend``,
  Megatron's default ``auto``, where the kernel computes what the local path does): the forward is
  ``ascendspeed.ops.alibi_attention``.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Optional

import torch

from ascendspeed.features.attention_masks import is_plain_causal
from ascendspeed.features.megatron_flags import FUSED_ATTENTION_BACKENDS, attention_backend_name
from ascendspeed.ops.alibi import alibi_attention, alibi_bias_, local_alibi_slopes
from ascendspeed.ops.core_attention import attention_dropout
from ascendspeed.ops.subnormals import flush_subnormals_in_backward, flushing_subnormals
from ascendspeed.patching import Patch, wrap

#: The ``TransformerConfig`` attribute that carries a model's ``AlibiSettings`` to its attention layers.
CONFIG_ATTRIBUTE = "alibi"


@dataclasses.dataclass(frozen=True)
class AlibiSettings:
    """How a model applies ALiBi. ``fused``: the fused attention kernel instead of Megatron's local path
    (``--alibi-fused-attention``); ``fused_where_exact``: the fused kernel in each layer whose config asks
    for a fused attention backend and whose attention the kernel computes exactly as the local path does
    (no dropout drawn, no sliding window, no softmax offset), the local path in the others."""

    fused: bool = False
    fused_where_exact: bool = False


def settings_of(config) -> Optional[AlibiSettings]:
    """The ALiBi settings a ``TransformerConfig`` carries, or None for a model without ALiBi."""
    return getattr(config, CONFIG_ATTRIBUTE, None)


def mark_config(config, settings: AlibiSettings) -> None:
    """Make every self-attention built from ``config`` use ALiBi with ``settings``."""
    setattr(config, CONFIG_ATTRIBUTE, settings)


@dataclasses.dataclass
class AlibiLayer:
    """The ALiBi of one attention layer: which heads it owns and which form of the bias it adds.

    ``slopes`` is None for the paper's slopes of this rank's heads (cached per heads, rank and device);
    assign a float32 tensor of ``heads / tp`` slopes to use others.
    """

    num_heads: int
    tp_rank: int
    tp_size: int
    causal: bool
    fused: bool
    slopes: Optional[torch.Tensor] = None
    #: Fused only where it is exact (``AlibiSettings.fused_where_exact``): a causal layer given a mask other
    #: than the causal triangle (the kernel would ignore it) takes the local path for that call.
    exact_only: bool = False

    def slopes_on(self, device: torch.device) -> torch.Tensor:
        if self.slopes is not None:
            return self.slopes
        return local_alibi_slopes(self.num_heads, self.tp_rank, self.tp_size, device)

    def add_bias_(self, scores: torch.Tensor) -> None:
        """Add the bias to Megatron's scaled [b, heads, sq, sk] scores; queries end where the keys end."""
        alibi_bias_(scores, self.slopes_on(scores.device), symmetric=not self.causal)

    def bias_span(self, keys: int) -> float:
        """How far, in nats, the bias alone puts the most distant of ``keys`` keys below the nearest."""
        if self.slopes is not None:
            return float(self.slopes.abs().max()) * (keys - 1)
        return _steepest_paper_slope(self.num_heads, self.tp_rank, self.tp_size) * (keys - 1)


#: Bias spans (nats) from which the local path flushes subnormals: probabilities reach fp32's subnormal
#: range (below e^-87) only when scores spread that far, and a span of 40 leaves the query-key part
#: little to add. Below it the per-call switches of the threads' mode are not worth it (the short
#: sequences of the default job); above it either choice is exact to fp32, flushing is the fast one.
FLUSH_FROM_BIAS_SPAN = 40.0


@functools.lru_cache(maxsize=None)
def _steepest_paper_slope(num_heads: int, tp_rank: int, tp_size: int) -> float:
    return float(local_alibi_slopes(num_heads, tp_rank, tp_size).max())


def _causal(attn_mask_type) -> bool:
    return "causal" in attn_mask_type.name


def _tensor_parallel_group(pg_collection):
    """The attention's tensor-parallel group, found as megatron-core finds it: the given collection's, else
    the global one (megatron-core 0.16+ also keeps it as ``self.pg_collection``; 0.15 does not)."""
    if pg_collection is not None:
        return pg_collection.tp
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def wrap_attention_init(original):
    """Give each self-attention built from an ALiBi config its ``AlibiLayer``; refuse what it cannot do."""

    @functools.wraps(original)
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        original(self, config, layer_number, attn_mask_type, attention_type, attention_dropout, softmax_scale,
                 cp_comm_type, pg_collection)
        settings = settings_of(config)
        if settings is None:
            return
        if attention_type != "self":
            raise ValueError(
                f"ALiBi biases self-attention by token distance; {attention_type} attention (layer "
                f"{layer_number}) relates two different sequences and is not supported"
            )
        if config.apply_query_key_layer_scaling:
            raise ValueError("ALiBi does not support apply_query_key_layer_scaling (it would scale the bias)")
        unfusable = self.scale_mask_softmax.window_size is not None or self.softmax_offset is not None
        if settings.fused and unfusable:
            raise ValueError("fused ALiBi attention supports neither window_size nor softmax_type other than vanilla")
        exact_only = not settings.fused and (
            settings.fused_where_exact and not unfusable and self.attention_dropout.p == 0
            and attention_backend_name(getattr(config, "attention_backend", "auto")) in FUSED_ATTENTION_BACKENDS
        )
        tp_group = _tensor_parallel_group(pg_collection)
        self.alibi = AlibiLayer(
            num_heads=config.num_attention_heads,
            tp_rank=tp_group.rank(),
            tp_size=tp_group.size(),
            causal=_causal(attn_mask_type),
            fused=settings.fused or exact_only,
            exact_only=exact_only,
        )
        self.scale_mask_softmax.alibi = self.alibi

    return __init__


def wrap_softmax_forward(original):
    """The local path: the bias goes onto the scaled scores right before Megatron masks and normalises.

    Where the bias spans ``FLUSH_FROM_BIAS_SPAN`` nats or more, the softmax and its backward run with
    subnormals flushed to zero (``ascendspeed.ops.subnormals``): the bias makes distant keys'
    probabilities subnormal, which many x86 CPUs process a hundred times slower than other numbers, and
    flushing changes each of them by less than 1.2e-38.
    """

    @functools.wraps(original)
    def forward(self, input, mask, softmax_offset=None):
        alibi = self.__dict__.get("alibi")
        if alibi is None:
            return original(self, input, mask, softmax_offset)
        alibi.add_bias_(input)
        if alibi.bias_span(input.size(-1)) < FLUSH_FROM_BIAS_SPAN:
            return original(self, input, mask, softmax_offset)
        with flushing_subnormals(input.device):
            probs = original(self, input, mask, softmax_offset)
        flush_subnormals_in_backward(probs, input)
        return probs

    return forward


def wrap_attention_forward(original):
    """The fused path replaces the score buffer, softmax and dropout of layers with ``alibi.fused``."""

    @functools.wraps(original)
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        alibi = self.__dict__.get("alibi")
        if alibi is None or not alibi.fused or _mask_needs_the_local_path(alibi, attention_mask, query, key):
            return original(self, query, key, value, attention_mask, attn_mask_type, attention_bias,
                            packed_seq_params)
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("fused ALiBi attention supports neither packed sequences nor an attention_bias")
        return _fused_forward(self, alibi, query, key, value, attention_mask)

    return forward


def _mask_needs_the_local_path(alibi: AlibiLayer, attention_mask, query, key) -> bool:
    """A layer fused only where exact, called with a mask the causal kernel would not apply as given."""
    if not alibi.exact_only or not alibi.causal or attention_mask is None:
        return False
    sq, sk = query.shape[0], key.shape[0]
    return sq != sk or attention_mask.dtype != torch.bool or not is_plain_causal(attention_mask, sq, sk)


def _fused_forward(self, alibi: AlibiLayer, query, key, value, attention_mask):
    """[sq, b, heads, d] in, [sq, b, heads * d] out, like Megatron's DotProductAttention.

    Causal layers ignore ``attention_mask`` and use the kernel's causal mask, as Megatron's fused
    backends do for the causal mask type (validation refuses --reset-attention-mask with this path).
    """
    sq, batch = query.shape[:2]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    dropout_p, rng = attention_dropout(self)
    with rng:
        context = alibi_attention(
            q, k, v, alibi.slopes_on(q.device),
            causal=alibi.causal,
            masked_out=None if alibi.causal else attention_mask,
            scale=self.softmax_scale,
            dropout_p=dropout_p,
        )
    return context.permute(2, 0, 1, 3).reshape(sq, batch, self.hidden_size_per_partition)


def wrap_gpt_model_init(settings: AlibiSettings):
    """``GPTModel(position_embedding_type="alibi")``: no position embedding, ALiBi in every self-attention.

    megatron-core only knows 'none' for "no position embedding", so the model is built with 'none' and the
    config's ALiBi settings (``mark_config``, unless the config carries some already) switch the attention
    layers.
    """

    def factory(original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def __init__(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            config = bound.arguments["config"]
            requested = bound.arguments.get("position_embedding_type", "learned_absolute")
            if requested != "alibi":
                if settings_of(config) is not None:
                    raise ValueError(
                        f"the TransformerConfig carries ALiBi settings but GPTModel was asked for "
                        f"position_embedding_type={requested!r}; pass 'alibi' (or build the config without "
                        f"ALiBi: config.{CONFIG_ATTRIBUTE} = None)"
                    )
                return original(*bound.args, **bound.kwargs)
            if settings_of(config) is None:
                mark_config(config, settings)
            bound.arguments["position_embedding_type"] = "none"
            original(*bound.args, **bound.kwargs)
            _check_every_self_attention_has_alibi(self)

        return __init__

    return factory


def _check_every_self_attention_has_alibi(model: torch.nn.Module) -> None:
    from megatron.core.transformer.attention import SelfAttention

    for name, module in model.named_modules():
        if isinstance(module, SelfAttention) and getattr(module.core_attention, "alibi", None) is None:
            raise ValueError(
                f"ALiBi is applied by megatron-core's DotProductAttention, but {name}.core_attention is a "
                f"{type(module.core_attention).__name__}: build the model with the local layer spec "
                "(--transformer-impl local; Transformer Engine attention is not supported yet)"
            )


def patches(settings: AlibiSettings) -> list[Patch]:
    return [
        wrap("megatron.core.models.gpt.gpt_model:GPTModel.__init__", wrap_gpt_model_init(settings),
             expect="(self, config, transformer_layer_spec, vocab_size, max_sequence_length, pre_process=True, "
                    "post_process=True, fp16_lm_cross_entropy=False, parallel_output=True, "
                    "share_embeddings_and_output_weights=False, position_embedding_type='learned_absolute', "
                    "rotary_percent=1.0, rotary_base=10000, rope_scaling=False, rope_scaling_factor=8.0, "
                    "scatter_embedding_sequence_parallel=True, seq_len_interpolation_factor=None, "
                    "mtp_block_spec=None, pg_collection=None, vp_stage=None)",
             name="alibi: GPTModel(position_embedding_type='alibi')"),
        wrap("megatron.core.transformer.dot_product_attention:DotProductAttention.__init__", wrap_attention_init,
             expect="(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None, "
                    "softmax_scale=None, cp_comm_type=None, pg_collection=None)",
             name="alibi: each self-attention of an ALiBi model gets its AlibiLayer"),
        wrap("megatron.core.transformer.dot_product_attention:DotProductAttention.forward", wrap_attention_forward,
             expect="(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, "
                    "packed_seq_params=None)",
             name="alibi: the fused attention path"),
        wrap("megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.forward", wrap_softmax_forward,
             expect="(self, input, mask, softmax_offset=None)",
             name="alibi: the local path adds the bias to the scaled scores"),
    ]
