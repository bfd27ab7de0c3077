"""Public operators of ascendspeed."""
from ascendspeed.ops.swiglu import swiglu, weighted_swiglu
from ascendspeed.ops.bias_gelu import bias_gelu
from ascendspeed.ops.alibi import alibi_attention, alibi_bias_, alibi_slopes, local_alibi_slopes
from ascendspeed.ops.rms_norm import rms_norm
from ascendspeed.ops.rotary import rotary_embedding
from ascendspeed.ops.bf16_split import bf16_join_, bf16_split_
from ascendspeed.ops.moe_permute import permute_tokens, sort_chunks, unpermute_tokens
from ascendspeed.ops.grouped_linear import grouped_linear
