"""The router on megatron-core releases where it cannot run, or runs wrong, as released.

**Gating without Transformer Engine.**
megatron-core 0.15 and 0.16 import ``te_general_gemm`` from Transformer Engine in ``moe_utils`` and define no
fallback when TE is absent, yet ``RouterGatingLinearFunction`` tests ``te_general_gemm is not None``: every
router forward without TE ends in ``NameError: name 'te_general_gemm' is not defined``. Where the name is
missing, the gating runs as one linear in ``router_dtype`` through autograd (what megatron-core's own non-TE
branch computes: the input and the weight cast to ``router_dtype``, gradients cast back to their dtypes).
Where the module defines the name (TE present, or megatron-core 0.17+ with its ``None`` fallback), Megatron's
function runs unchanged.

**The router bias of megatron-core 0.15**, on every device: with ``add_bias_linear`` (Megatron's default)
``Router.__init__`` makes the bias with ``torch.empty`` and ``reset_parameters`` initialises only the weight,
so the bias starts as whatever the allocator hands out: the routing, and every loss, differ from run to run
(first losses 5.5327 to 5.5413 over four Megatron-LM runs of one command on a CPU), and a NaN or a huge
value in that memory breaks the routing. 0.16 initialises the bias with ``init_method`` after the weight;
``reset_parameters`` is replaced by that on 0.15.
"""
from __future__ import annotations

import functools
import sys

import torch.nn.functional as F

from ascendspeed.patching import Patch, replace, wrap

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"


def wrap_router_gating_linear(original):
    @functools.wraps(original)
    def router_gating_linear(inp, weight, bias, router_dtype):
        if hasattr(sys.modules[MOE_UTILS], "te_general_gemm"):
            return original(inp, weight, bias, router_dtype)
        return F.linear(inp.to(router_dtype), weight.to(router_dtype),
                        None if bias is None else bias.to(router_dtype))

    return router_gating_linear


def initialized_router_reset_parameters(self):
    """megatron-core 0.16's ``Router.reset_parameters``: the weight, then the bias, drawn by ``init_method``
    (when ``perform_initialization``), then both cast to ``params_dtype`` and marked for sequence parallelism."""
    if self.config.perform_initialization:
        self.config.init_method(self.weight)
        if self.bias is not None:
            self.config.init_method(self.bias)
    for param in (self.weight, self.bias):
        if param is not None:
            param.data = param.data.to(dtype=self.config.params_dtype)
            setattr(param, "sequence_parallel", self.config.sequence_parallel)


def patches() -> list[Patch]:
    return [
        replace("megatron.core.transformer.moe.router:Router.reset_parameters", initialized_router_reset_parameters,
                expect="(self)", megatron="<0.16",
                name="moe: the router bias initialised as megatron-core 0.16 does (0.15 leaves it torch.empty) "
                     "(replace)"),
        wrap("megatron.core.transformer.moe.moe_utils:router_gating_linear", wrap_router_gating_linear,
             expect="(inp, weight, bias, router_dtype)",
             name="moe: router gating as a plain linear where moe_utils lacks te_general_gemm (wrap)"),
    ]
