"""The features ascendspeed offers, in the order their patches are applied (wraps stack in this order)."""
FEATURE_MODULES = (
    "ascendspeed.features.fused_attention",  # first: the features that keep Megatron's attention wrap around it
    "ascendspeed.features.async_ddp",
    "ascendspeed.features.alibi",
    "ascendspeed.features.fused_swiglu",
    "ascendspeed.features.local_norm",
    "ascendspeed.features.fused_rope",
    "ascendspeed.features.reuse_fp32_param",
    "ascendspeed.features.context_parallel",
    "ascendspeed.features.moe",
    "ascendspeed.features.moe_permute_fusion",
    "ascendspeed.features.tp_comm_overlap",
    "ascendspeed.features.adaptive_recompute",
    "ascendspeed.features.local_mla",  # last: its DotProductAttention.__init__ wrap takes MLA's extra arguments
)
