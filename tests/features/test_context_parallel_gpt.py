"""A megatron-core GPT at context parallel size 2 against the same GPT at size 1, for every algorithm.

Real megatron-core modules on real gloo ranks: the reference runs the whole sequence in one process; the
context-parallel run splits the batch with megatron-core's ``get_batch_on_this_cp_rank`` (balanced layout),
averages the loss over the group's tokens as Megatron does and sums the gradients over the group (what the
data-parallel-with-context-parallel reduction does).
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed_utils import run_distributed

RELATIVE_TOLERANCE = 1e-5
#: (position embedding, --cp-attention-mask-type, query groups)
VARIANTS = [
    ("learned_absolute", "causal", None),
    ("rope", "causal", 2),
    ("alibi", "causal", None),
    ("learned_absolute", "general", None),
    ("alibi", "general", None),
]


def _document_mask(seq_length: int) -> torch.Tensor:
    """Causal, and a second document from position 6 on that cannot see the first (True = hidden)."""
    hidden = torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), diagonal=1)
    hidden[6:, :6] = True
    return hidden.view(1, 1, seq_length, seq_length)


def _loss_and_gradients(model, batch, group):
    """Megatron's CP loss: masked sum over this rank's tokens / tokens of the whole group; grads summed."""
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    loss_sum = (output.float() * batch["loss_mask"]).sum()
    tokens = batch["loss_mask"].sum()
    if group is not None:
        tokens = tokens.clone()
        torch.distributed.all_reduce(tokens, group=group)
    loss = loss_sum / tokens
    loss.backward()
    loss = loss.detach()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    if group is not None:
        torch.distributed.all_reduce(loss, group=group)
        for grad in grads.values():
            torch.distributed.all_reduce(grad, group=group)
    return loss, grads


def _compare(rank, world_size, algorithm, ulysses_degree, tp):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.utils import get_batch_on_this_cp_rank

    from ascendspeed.features import disable_features, enable_features
    from tests.megatron_utils import (
        SEED, TinyGPT, build_gpt_model, destroy_parallel, full_parameters, initialize_parallel,
        load_full_parameters, make_batch, named_parameters_full, relative_error, shard_like,
    )

    shape = TinyGPT(seq_length=16)
    cp = world_size // tp
    results = {}
    for position_type, mask_type, query_groups in VARIANTS:
        gqa = dict(num_query_groups=query_groups) if query_groups else {}
        settings = dict(context_parallel_size=cp, context_parallel_algo=algorithm,
                        cp_attention_mask_type=mask_type)
        if ulysses_degree:
            settings["ulysses_degree_in_cp"] = ulysses_degree
        if position_type == "alibi":
            settings["position_embedding_type"] = "alibi"
        enable_features(**settings)
        batch = make_batch(shape, seed=3)
        if mask_type == "general":
            batch["attention_mask"] = _document_mask(shape.seq_length)

        initialize_parallel()
        reference = build_gpt_model(shape.config(**gqa), shape, position_embedding_type=position_type)
        full = full_parameters(reference)
        expected_loss, expected = _loss_and_gradients(reference, dict(batch), group=None)
        destroy_parallel()

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        torch.manual_seed(SEED)
        model_parallel_cuda_manual_seed(SEED)
        config = shape.config(context_parallel_size=cp, **gqa)
        model = build_gpt_model(config, shape, position_embedding_type=position_type)
        load_full_parameters([model], full)
        local = get_batch_on_this_cp_rank(dict(batch))
        assert local["tokens"].shape[1] == shape.seq_length // cp
        loss, grads = _loss_and_gradients(model, local, parallel_state.get_context_parallel_group())
        errors = {
            name: relative_error(grads[name], shard_like(expected[name], param, name, config))
            for name, param in named_parameters_full([model])
        }
        destroy_parallel()
        disable_features()

        assert set(errors) == {name for name, _ in reference.named_parameters()}
        results[(position_type, mask_type, query_groups)] = (relative_error(loss, expected_loss), errors)
    return results


@pytest.mark.parametrize("algorithm, world_size, ulysses_degree, tp", [
    ("megatron_cp_algo", 2, None, 1),
    ("ulysses_cp_algo", 2, None, 1),
    ("hybrid_cp_algo", 2, 2, 1),
    ("hybrid_cp_algo", 4, 2, 1),
    ("megatron_cp_algo", 4, None, 2),
])
def test_gpt_context_parallel_matches_single_process(algorithm, world_size, ulysses_degree, tp):
    """cp = world_size / tp; the last two cases: a real hybrid (2 Ulysses pairs in a ring of 2), TP 2 x CP 2."""
    per_rank = run_distributed(_compare, world_size, algorithm, ulysses_degree, tp, timeout=900)
    for rank, results in enumerate(per_rank):
        assert set(results) == set(VARIANTS)
        for variant, (loss_error, grad_errors) in results.items():
            assert loss_error < RELATIVE_TOLERANCE, f"rank {rank} {variant}: loss error {loss_error:.2e}"
            worst = max(grad_errors, key=grad_errors.get)
            assert grad_errors[worst] < RELATIVE_TOLERANCE, (
                f"rank {rank} {variant}: gradient of {worst} off by {grad_errors[worst]:.2e}"
            )
