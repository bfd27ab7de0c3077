"""Fused SwiGLU: ``--use-fused-swiglu`` (with ``--swiglu``) runs the SwiGLU of every gated MLP as one
operator, ``ascendspeed.ops.swiglu``, forward and backward, saving only its input for backward.

Both of megatron-core's SwiGLU paths are switched (``mlp.py``): ``bias_swiglu_impl`` is replaced, and
dense MLPs on the unfused gated path are routed to it. megatron-core users call
``ascendspeed.features.enable_features(swiglu=True, use_fused_swiglu=True)``. See
``docs/features/swiglu.md``.
"""
from ascendspeed.features.fused_swiglu.feature import FusedSwigluFeature

FEATURE = FusedSwigluFeature()

__all__ = ["FEATURE", "FusedSwigluFeature"]
