"""megatron-core's MoE router fusion (``moe_router_fusion``) without Transformer Engine.

With ``TransformerConfig(moe_router_fusion=True)`` (``--moe-router-fusion``) megatron-core's router calls three
functions of ``moe_utils`` with ``fused=True``: ``topk_routing_with_score_function`` (top-k, group-limited
top-k, score function, expert bias, scaling), ``compute_routing_scores_for_aux_loss`` and
``switch_load_balancing_loss_func``. Their fused branches run TE's CUDA kernels, and where TE is absent they raise
"... is not available. Please install TE >= 2.6.0" at the first forward. The fused kernels compute what the
unfused branches compute (the same score functions in fp32, the same top-k and normalisation), so here those
calls take megatron-core's unfused branch: the router trains as it does with ``moe_router_fusion=False``.
"""
from __future__ import annotations

import functools
import inspect

from ascendspeed.patching import EXISTS, wrap


def _wrap_on_unfused_branch(original):
    """``original`` with its ``fused`` argument, positional or keyword, set to False."""
    signature = inspect.signature(original)
    if "fused" not in signature.parameters:
        raise TypeError(f"ascendspeed's TE fallback expected a 'fused' parameter in {original.__module__}."
                        f"{original.__qualname__}{signature}: megatron-core changed its router fusion")

    @functools.wraps(original)
    def on_unfused_branch(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["fused"] = False
        return original(*bound.args, **bound.kwargs)

    return on_unfused_branch


def patches():
    """The functions' signatures differ between megatron-core releases (``padding_mask``, ``router_replay``,
    ``dense_output`` came later); every one takes ``fused``, which the wrapper checks for and binds by name."""
    return [
        wrap("megatron.core.transformer.moe.moe_utils:topk_routing_with_score_function", _wrap_on_unfused_branch,
             expect=EXISTS, name="te fallback: wrap topk_routing_with_score_function, router fusion unfused"),
        wrap("megatron.core.transformer.moe.moe_utils:compute_routing_scores_for_aux_loss", _wrap_on_unfused_branch,
             expect=EXISTS, name="te fallback: wrap compute_routing_scores_for_aux_loss, router fusion unfused"),
        wrap("megatron.core.transformer.moe.moe_utils:switch_load_balancing_loss_func", _wrap_on_unfused_branch,
             expect=EXISTS, name="te fallback: wrap switch_load_balancing_loss_func, router fusion unfused"),
    ]
