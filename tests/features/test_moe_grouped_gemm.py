"""``--moe-grouped-gemm`` without Transformer Engine: megatron-core's ``TEGroupedMLP`` on ascendspeed's grouped
linears against ``SequentialMLP`` (the local spec's experts), in real ``MoELayer``s on 2 gloo ranks.

Each case builds both layers, gives the grouped one the sequential one's weights (router and every local
expert, rank by rank), and runs the same tokens through both: the outputs and the gradients of the input, the
router and every expert parameter agree to 1e-6 relative (fp32). The products are the same, but not always to
the bit: a BLAS matmul's rounding can depend on where a group's rows start in memory (one tensor for all
experts here, one per expert there), and with biases ``TEGroupedMLP`` adds ``bias * probs`` after the second
linear where ``SequentialMLP`` scales ``output + bias``. Cases cover both dispatchers, expert parallelism 1 and 2, expert
tensor parallelism 2, SwiGLU (Megatron's and the fused operator, which must run inside the grouped experts)
and gelu. The grouped_linear operator must be in every grouped layer's autograd graph.

A distributed checkpoint of either layer loads into the other (``TEGroupedMLP`` saves under
``SequentialMLP``'s keys), expert parallel 2: the loaded weights are the saved ones, expert by expert.
"""
import functools
import tempfile

import pytest
import torch
import torch.nn.functional as F

from ascendspeed.features import enable_features
from tests.features.test_moe import _ascendspeed_operators
from tests.helpers.distributed import call, run_distributed_cases

EXPERTS, TOPK, HIDDEN, FFN, SEQ, BATCH = 4, 2, 16, 12, 8, 2
TOLERANCE = 1e-6
#: (dispatcher, expert-parallel size, expert-tensor-parallel size, bias, activation). The fused-SwiGLU cases
#: come last: switching the feature on reverts and reapplies the patches once per rank.
CASES = [
    ("alltoall", 2, 1, False, "swiglu"),
    ("allgather", 1, 1, True, "gelu"),
    ("alltoall", 1, 2, False, "swiglu"),
    ("alltoall", 2, 1, True, "fused-swiglu"),
    ("allgather", 1, 1, False, "fused-swiglu"),
]
CASE_IDS = [f"{d}-ep{ep}-etp{etp}{'-bias' if bias else ''}-{act}" for d, ep, etp, bias, act in CASES]


def _config(dispatcher, ep, etp, bias, activation):
    from megatron.core.transformer.transformer_config import TransformerConfig

    gated = activation != "gelu"
    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, moe_ffn_hidden_size=FFN, num_attention_heads=4,
        hidden_dropout=0.0, attention_dropout=0.0, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, add_bias_linear=bias,
        bias_dropout_fusion=False, bias_activation_fusion=False, gated_linear_unit=gated,
        activation_func=F.silu if gated else F.gelu,
    )


def _layer(config, grouped: bool):
    """A MoELayer: TEGroupedMLP experts (the TE spec with grouped GEMM) or SequentialMLP (the local spec)."""
    import dataclasses

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    config = dataclasses.replace(config, moe_grouped_gemm=grouped)
    spec = get_moe_module_spec(use_te=grouped, num_experts=EXPERTS, moe_grouped_gemm=grouped)
    # megatron-core 0.19 spells the MoE layer as a partial of the class, older releases as a ModuleSpec
    layer = build_module(spec, config=config) if isinstance(spec, ModuleSpec) else spec(config=config)
    layer.set_layer_number(1)
    return layer


def _expert_parameters(layer) -> dict:
    """Every local expert parameter by (expert, linear, kind): the same keys for both kinds of layer."""
    experts = layer.experts
    if hasattr(experts, "local_experts"):
        return {(index, linear, kind): getattr(getattr(expert, linear), kind)
                for index, expert in enumerate(experts.local_experts)
                for linear in ("linear_fc1", "linear_fc2") for kind in ("weight", "bias")
                if getattr(getattr(expert, linear), kind) is not None}
    return {(index, linear, kind): getattr(getattr(experts, linear), f"{kind}{index}")
            for index in range(experts.num_local_experts) for linear in ("linear_fc1", "linear_fc2")
            for kind in ("weight", "bias") if hasattr(getattr(experts, linear), f"{kind}{index}")}


def _router_parameters(layer) -> dict:
    return {name: param for name, param in layer.router.named_parameters()}


def _run(layer, rank):
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=generator).requires_grad_(True)
    output_grad = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
    output, _ = layer(x)
    operators = _ascendspeed_operators(output)
    (output * output_grad).sum().backward()
    grads = {"output": output.detach(), "input grad": x.grad}
    grads.update({("router", name): p.grad for name, p in _router_parameters(layer).items()})
    grads.update({key: p.grad for key, p in _expert_parameters(layer).items()})
    return grads, operators


def _equivalence_case(rank, world_size, dispatcher, ep, etp, bias, activation):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from ascendspeed.features import applied_features

    fused = activation == "fused-swiglu"
    wanted = ["fused_attention", "fused_swiglu", "moe"] if fused else ["fused_attention", "moe"]
    if sorted(feature.name for feature in applied_features()) != wanted:
        enable_features(num_experts=EXPERTS, **({"swiglu": True, "use_fused_swiglu": True} if fused else {}))
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    try:
        torch.manual_seed(1)
        model_parallel_cuda_manual_seed(1)
        config = _config(dispatcher, ep, etp, bias, activation)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        sequential, grouped = _layer(config, grouped=False), _layer(config, grouped=True)
        with torch.no_grad():
            for name, param in _router_parameters(grouped).items():
                param.copy_(_router_parameters(sequential)[name])
            sequential_experts = _expert_parameters(sequential)
            assert sequential_experts.keys() == _expert_parameters(grouped).keys()
            for key, param in _expert_parameters(grouped).items():
                param.copy_(sequential_experts[key])
        expected, _ = _run(sequential, rank)
        actual, operators = _run(grouped, rank)
        errors = {str(key): ((actual[key] - value).norm() / value.norm()).item() for key, value in expected.items()}
        return {"experts": type(grouped.experts).__name__, "errors": errors, "operators": sorted(operators)}
    finally:
        parallel_state.destroy_model_parallel()


def _checkpoint_case(rank, world_size, directory):
    """Save one kind of layer, load into the other (fresh weights): per direction, whether every loaded expert
    parameter equals the saved one."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ascendspeed.features import applied_features

    if [feature.name for feature in applied_features()] != ["fused_attention", "moe"]:
        enable_features(num_experts=EXPERTS)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        config = _config("alltoall", 2, 1, True, "swiglu")
        equal = {}
        for saved_grouped in (False, True):
            torch.manual_seed(3)
            model_parallel_cuda_manual_seed(3)
            saved = _layer(config, grouped=saved_grouped)
            with torch.no_grad():
                for param in _expert_parameters(saved).values():
                    param.normal_()
            loaded = _layer(config, grouped=not saved_grouped)
            path = f"{directory}/{'grouped' if saved_grouped else 'sequential'}"
            if rank == 0:
                import os

                os.makedirs(path)
            torch.distributed.barrier()
            dist_checkpointing.save(saved.sharded_state_dict(), path)
            state = dist_checkpointing.load(loaded.sharded_state_dict(), path)
            loaded.load_state_dict(state)
            saved_params = _expert_parameters(saved)
            equal["grouped -> sequential" if saved_grouped else "sequential -> grouped"] = [
                str(key) for key, param in _expert_parameters(loaded).items() if not torch.equal(param, saved_params[key])
            ]
        return equal
    finally:
        parallel_state.destroy_model_parallel()


@functools.cache
def _results():
    with tempfile.TemporaryDirectory() as directory:
        cases = [(_equivalence_case, *case) for case in CASES] + [(_checkpoint_case, directory)]
        return run_distributed_cases(call, 2, cases, timeout=600)


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
def test_grouped_experts_equal_sequential_experts(case):
    activation = CASES[case][-1]
    expected_operators = ["grouped_linear"] + (["weighted_swiglu"] if activation == "fused-swiglu" else [])
    for rank, result in enumerate(_results()[case]):
        assert result["experts"] == "TEGroupedMLP"
        assert result["operators"] == expected_operators, f"rank {rank}: {result['operators']}"
        worst = max(result["errors"], key=result["errors"].get)
        assert result["errors"][worst] <= TOLERANCE, f"rank {rank}: {worst} differs by {result['errors'][worst]:.2e}"


def test_checkpoints_load_across_grouped_and_sequential_experts():
    for rank, result in enumerate(_results()[len(CASES)]):
        assert result == {"sequential -> grouped": [], "grouped -> sequential": []}, f"rank {rank}: {result}"
