"""The router's gating linear without Transformer Engine on megatron-core releases that need TE for it.

megatron-core 0.15 and 0.16 import ``te_general_gemm`` from Transformer Engine in ``moe_utils`` and define no
fallback when TE is absent, yet ``RouterGatingLinearFunction`` tests ``te_general_gemm is not None``: every
router forward without TE ends in ``NameError: name 'te_general_gemm' is not defined``. Where the name is
missing, the gating runs as one linear in ``router_dtype`` through autograd (what megatron-core's own non-TE
branch computes: the input and the weight cast to ``router_dtype``, gradients cast back to their dtypes).
Where the module defines the name (TE present, or megatron-core 0.17+ with its ``None`` fallback), Megatron's
function runs unchanged.
"""
from __future__ import annotations

import functools
import sys

import torch.nn.functional as F

from ascendspeed.patching import Patch, wrap

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"


def wrap_router_gating_linear(original):
    @functools.wraps(original)
    def router_gating_linear(inp, weight, bias, router_dtype):
        if hasattr(sys.modules[MOE_UTILS], "te_general_gemm"):
            return original(inp, weight, bias, router_dtype)
        return F.linear(inp.to(router_dtype), weight.to(router_dtype),
                        None if bias is None else bias.to(router_dtype))

    return router_gating_linear


def patches() -> list[Patch]:
    return [
        wrap("megatron.core.transformer.moe.moe_utils:router_gating_linear", wrap_router_gating_linear,
             expect="(inp, weight, bias, router_dtype)",
             name="moe: router gating as a plain linear where moe_utils lacks te_general_gemm (wrap)"),
    ]
