"""Mixture of experts on the CPU: a real megatron-core ``MoELayer`` (local spec: ``SequentialMLP`` experts on
Column/RowParallelLinear) on 2 gloo ranks, with the allgather and the alltoall dispatcher, expert parallel 1
(data parallel 2) and 2, Megatron's default experts (bias on both linears, gelu; the bias-gelu fusion in one
case, unfused in the others) and top-2
routing with the load-balancing loss, against a float64 reference written here: every token through every
expert (gelu's tanh form where Megatron's bias-gelu fusion runs), the top-k mask and the renormalised top-k probabilities applied densely, plus the Switch load-balancing
loss. Forward output and the gradients of the input, the router and every local expert parameter agree to
1e-5 relative (Megatron runs in fp32).

Before ascendspeed these fail in the expert MLP ("Only support fusion of swiglu and quick_gelu with
per_token_scale in MLP", or without the fusion an in-place update of a view), on 0.15/0.16 in the router
(``te_general_gemm`` undefined without Transformer Engine), and with alltoall over 2 expert ranks in gloo's
``all_to_all_single`` (split sizes given as numpy arrays).
"""
import functools
import inspect

import pytest
import torch
import torch.nn.functional as F

from ascendspeed.features import default_arguments, disable_features, enable_features
from ascendspeed.features.moe import FEATURE
from tests.helpers.distributed import run_distributed_cases

TOLERANCE = 1e-5
EXPERTS, TOPK, HIDDEN, FFN, SEQ, BATCH = 4, 2, 16, 24, 6, 2
AUX_COEFF = 1e-2
#: (dispatcher, expert-parallel size, bias-gelu fusion, capacity). The fusion is torch.compile on the CPU, which compiles
#: again for every new expert batch size (~10 s a case): one case has it (the path that raised), the others
#: run Megatron's unfused gelu (the path that modified a view in place).
#: The last case drops and pads tokens to a capacity (compared with the unfused path only).
CASES = [("allgather", 1, True, False), ("allgather", 2, False, False), ("alltoall", 1, False, False),
         ("alltoall", 2, False, False), ("alltoall", 2, False, True)]


def _full_weights():
    """The same full weights on every rank (router [E, H] + [E] (a bias: add_bias_linear); experts fc1 [E, F, H] + [E, F], fc2 [E, H, F] + [E, H])."""
    generator = torch.Generator().manual_seed(7)

    def draw(*shape, scale):
        return torch.randn(*shape, generator=generator, dtype=torch.float64) * scale

    return {
        "router": draw(EXPERTS, HIDDEN, scale=0.5), "router_bias": draw(EXPERTS, scale=0.1),
        "w1": draw(EXPERTS, FFN, HIDDEN, scale=HIDDEN ** -0.5), "b1": draw(EXPERTS, FFN, scale=0.1),
        "w2": draw(EXPERTS, HIDDEN, FFN, scale=FFN ** -0.5), "b2": draw(EXPERTS, HIDDEN, scale=0.1),
    }


def _inputs(rank):
    generator = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=generator, dtype=torch.float64)
    output_grad = torch.randn(SEQ, BATCH, HIDDEN, generator=generator, dtype=torch.float64)
    return hidden, output_grad


def _reference(weights, hidden, output_grad, fusion):
    """Float64, dense: output = sum over the top-k experts of p * (W2 gelu(W1 x + b1) + b2); the loss is
    <output, output_grad> plus the load-balancing loss E * sum_i f_i P_i * coeff. Returns the output and the
    gradients of the input and of every weight."""
    weights = {name: value.clone().requires_grad_(True) for name, value in weights.items()}
    x = hidden.clone().requires_grad_(True)
    tokens = x.reshape(-1, HIDDEN)
    logits = tokens @ weights["router"].t() + weights["router_bias"]
    top_logits, top_experts = torch.topk(logits, TOPK, dim=-1)
    mask = torch.zeros_like(logits).scatter(1, top_experts, 1.0)
    probs = torch.zeros_like(logits).scatter(1, top_experts, torch.softmax(top_logits, dim=-1))
    # Megatron's bias-gelu fusion (its default) computes the tanh approximation of gelu
    inner = F.gelu(torch.einsum("th,efh->tef", tokens, weights["w1"]) + weights["b1"],
                   approximate="tanh" if fusion else "none")
    expert_out = torch.einsum("tef,ehf->teh", inner, weights["w2"]) + weights["b2"]
    output = torch.einsum("te,teh->th", probs, expert_out).reshape_as(hidden)
    count = tokens.shape[0]
    fraction = mask.sum(0) / (count * TOPK)
    mean_prob = torch.softmax(logits, dim=-1).sum(0) / count
    aux = AUX_COEFF * EXPERTS * (fraction * mean_prob).sum()
    ((output * output_grad).sum() + aux).backward()
    return output.detach(), x.grad, {name: value.grad for name, value in weights.items()}


def _build_layer(config_kwargs, permute_fusion, ep):
    """A MoELayer with the full weights' local experts, and its first local expert's index."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(**config_kwargs, moe_permute_fusion=permute_fusion)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False).submodules.mlp
    # megatron-core 0.19 spells the MoE layer as a partial of the class, older releases as a ModuleSpec
    layer = build_module(spec, config=config) if isinstance(spec, ModuleSpec) else spec(config=config)
    layer.set_layer_number(1)
    weights = _full_weights()
    first = parallel_state.get_expert_model_parallel_rank() * (EXPERTS // ep)
    with torch.no_grad():
        layer.router.weight.copy_(weights["router"])
        layer.router.bias.copy_(weights["router_bias"])
        for index, expert in enumerate(layer.experts.local_experts):
            expert.linear_fc1.weight.copy_(weights["w1"][first + index])
            expert.linear_fc1.bias.copy_(weights["b1"][first + index])
            expert.linear_fc2.weight.copy_(weights["w2"][first + index])
            expert.linear_fc2.bias.copy_(weights["b2"][first + index])
    return layer, first


def _ascendspeed_operators(output) -> set:
    """The ascendspeed operators in the autograd graph behind ``output`` (what ran, not what was asked for)."""
    found, seen, stack = set(), set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if name.startswith("GeneratedBackwardFor_ascendspeed_"):
            found.add(name.removeprefix("GeneratedBackwardFor_ascendspeed_").removesuffix("_defaultBackward"))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _run_layer(layer, rank):
    """The layer's output, by name the gradients of the input and of every parameter, and the ascendspeed
    operators that ran."""
    hidden, output_grad = _inputs(rank)
    x = hidden.float().requires_grad_(True)
    output, bias = layer(x)
    assert bias is None
    operators = _ascendspeed_operators(output)
    (output * output_grad.float()).sum().backward()
    grads = {"input": x.grad, **{name: param.grad for name, param in layer.named_parameters()}}
    return output.detach(), grads, operators


def _moe_case(rank, world_size, dispatcher, ep, fusion, capacity):
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ascendspeed.features import applied_features

    if [feature.name for feature in applied_features()] != ["fused_attention", "moe", "moe_permute_fusion"]:
        # once per rank: reverting sweeps every loaded module (~15 s), and the ranks end with the job
        enable_features(num_experts=EXPERTS, moe_permute_fusion=True)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    try:
        config_kwargs = dict(
            num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=4, hidden_dropout=0.0,
            attention_dropout=0.0, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
            moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=ep,
            moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=AUX_COEFF,
            add_bias_linear=True, bias_activation_fusion=fusion, activation_func=F.gelu,
        )
        if capacity:
            config_kwargs.update(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        runs = {}
        for permute_fusion in (False, True):
            torch.manual_seed(1)
            model_parallel_cuda_manual_seed(1)
            layer, first = _build_layer(config_kwargs, permute_fusion, ep)
            runs[permute_fusion] = _run_layer(layer, rank)
        (output, grads, unfused_operators), (fused_output, fused_grads, fused_operators) = runs[False], runs[True]
        not_bitwise = [name for name in grads if not torch.equal(grads[name], fused_grads[name])]
        not_bitwise += [] if torch.equal(output, fused_output) else ["output"]
        result = {"not_bitwise": not_bitwise, "local_experts": len(layer.experts.local_experts), "errors": {},
                  "operators": (sorted(unfused_operators), sorted(fused_operators))}
        if capacity:  # the float64 reference does not drop tokens
            return result

        expected_output, expected_x_grad, expected = _reference(*(_full_weights(), *_inputs(rank)), fusion)
        if ep > 1:  # the local experts also served the other ranks' tokens: their gradients add up
            for other in range(world_size):
                if other != rank:
                    for name, grad in _reference(_full_weights(), *_inputs(other), fusion)[2].items():
                        if not name.startswith("router"):
                            expected[name] = expected[name] + grad

        def error(actual, reference):
            return ((actual.double() - reference).norm() / reference.norm()).item()

        errors = result["errors"]
        errors.update({"output": error(output, expected_output), "input grad": error(grads["input"], expected_x_grad),
                       "router grad": error(grads["router.weight"], expected["router"]),
                       "router bias grad": error(grads["router.bias"], expected["router_bias"])})
        for index in range(len(layer.experts.local_experts)):
            prefix = f"experts.local_experts.{index}."
            for name, param in (("w1", "linear_fc1.weight"), ("b1", "linear_fc1.bias"), ("w2", "linear_fc2.weight"),
                                ("b2", "linear_fc2.bias")):
                errors[f"expert {first + index} {name} grad"] = error(grads[prefix + param],
                                                                      expected[name][first + index])
        return result
    finally:
        parallel_state.destroy_model_parallel()


@functools.cache
def _moe_results():
    return run_distributed_cases(_moe_case, 2, CASES, timeout=600)


CASE_IDS = [f"{d}-ep{ep}{'-fused' if f else ''}{'-capacity' if c else ''}" for d, ep, f, c in CASES]


@pytest.mark.parametrize("case", [i for i, c in enumerate(CASES) if not c[3]],
                         ids=[name for name, c in zip(CASE_IDS, CASES) if not c[3]])
def test_moe_layer_equals_the_float64_reference(case):
    dispatcher, ep, _, _ = CASES[case]
    for rank, result in enumerate(_moe_results()[case]):
        assert result["local_experts"] == EXPERTS // ep
        worst = max(result["errors"], key=result["errors"].get)
        assert result["errors"][worst] <= TOLERANCE, f"rank {rank}: {worst} differs by {result['errors'][worst]:.2e}"


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
def test_permute_fusion_equals_the_unfused_layer_bit_for_bit(case):
    """--moe-permute-fusion without TE (ascendspeed's operators): the same output and every gradient, to the
    bit, as megatron-core's unfused permutation from the same weights and inputs."""
    dispatcher, ep, _, capacity = CASES[case]
    # the alltoall dispatcher regroups received chunks by local expert (a reshape where it pads to capacity)
    sorts_chunks = dispatcher == "alltoall" and EXPERTS // ep > 1 and not capacity
    expected = ["moe_gather", "moe_scatter_add"] + (["moe_sort_chunks"] if sorts_chunks else [])
    for rank, result in enumerate(_moe_results()[case]):
        assert result["operators"] == ([], expected), f"rank {rank}: operators in the graph {result['operators']}"
        assert result["not_bitwise"] == [], f"rank {rank}: {result['not_bitwise']} differ"


def test_feature_is_on_with_experts_only():
    assert not FEATURE.is_enabled(default_arguments())
    assert FEATURE.is_enabled(enable_features(num_experts=4))
    disable_features()


def test_router_bias_is_drawn_by_init_method():
    """megatron-core 0.15 made the router bias with torch.empty and never initialised it (runs differed from
    run to run); on every release the bias is now drawn by the config's init_method, as 0.16 draws it."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.helpers import megatron as mu

    def init_method(tensor):
        return tensor.data.fill_(0.25)

    enable_features(num_experts=EXPERTS)
    try:
        with mu.one_process_world():
            config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_moe_experts=EXPERTS,
                                       moe_router_topk=TOPK, add_bias_linear=True, init_method=init_method)
            groups = {}
            if "pg_collection" in inspect.signature(TopKRouter.__init__).parameters:
                from megatron.core.process_groups_config import ProcessGroupCollection

                groups["pg_collection"] = ProcessGroupCollection.use_mpu_process_groups()
            router = TopKRouter(config=config, **groups)
    finally:
        disable_features()
    assert torch.equal(router.weight, torch.full((EXPERTS, HIDDEN), 0.25))
    assert torch.equal(router.bias, torch.full((EXPERTS,), 0.25))
