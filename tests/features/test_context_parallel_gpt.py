"""A megatron-core GPT at context parallel size 2 against the same GPT at size 1, for every algorithm.

Real megatron-core modules on real gloo ranks: the reference runs the whole sequence in one process; the
context-parallel run splits the batch with megatron-core's ``get_batch_on_this_cp_rank`` (balanced layout),
averages the loss over the group's tokens as Megatron does and sums the gradients over the group (what the
data-parallel-with-context-parallel reduction does).
"""
from __future__ import annotations

import pytest
import torch

from ascendspeed.training.trainer import batch_on_this_context_parallel_rank
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.slow  # a 2-rank and a 4-rank job of several minutes each on 2 cores

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


def _compare(rank, world_size, cases):
    """Every variant's single-process reference once, then each case's (algorithm, Ulysses degree, tp)
    context-parallel run from the same weights: {(case, variant): (loss error, {name: gradient error})}."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ascendspeed.features import disable_features, enable_features
    from tests.helpers.megatron import (
        SEED, TinyGPT, build_gpt_model, destroy_parallel, full_parameters, initialize_parallel,
        load_full_parameters, make_batch, named_parameters_full, relative_error, shard_like,
    )

    shape = TinyGPT(seq_length=16)
    results = {}
    for position_type, mask_type, query_groups in VARIANTS:
        variant = (position_type, mask_type, query_groups)
        gqa = dict(num_query_groups=query_groups) if query_groups else {}
        batch = make_batch(shape, seed=3)
        if mask_type == "general":
            batch["attention_mask"] = _document_mask(shape.seq_length)
        if position_type == "alibi":
            enable_features(position_embedding_type="alibi")
        initialize_parallel()
        reference = build_gpt_model(shape.config(**gqa), shape, position_embedding_type=position_type)
        full = full_parameters(reference)
        expected_loss, expected = _loss_and_gradients(reference, dict(batch), group=None)
        destroy_parallel()
        disable_features()
        for case in cases:
            algorithm, ulysses_degree, tp = case
            cp = world_size // tp
            settings = dict(context_parallel_size=cp, context_parallel_algo=algorithm,
                            cp_attention_mask_type=mask_type)
            if ulysses_degree:
                settings["ulysses_degree_in_cp"] = ulysses_degree
            if position_type == "alibi":
                settings["position_embedding_type"] = "alibi"
            enable_features(**settings)
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
            torch.manual_seed(SEED)
            model_parallel_cuda_manual_seed(SEED)
            config = shape.config(context_parallel_size=cp, **gqa)
            model = build_gpt_model(config, shape, position_embedding_type=position_type)
            load_full_parameters([model], full)
            local = batch_on_this_context_parallel_rank(dict(batch))
            assert local["tokens"].shape[1] == shape.seq_length // cp
            loss, grads = _loss_and_gradients(model, local, parallel_state.get_context_parallel_group())
            errors = {
                name: relative_error(grads[name], shard_like(expected[name], param, name, config))
                for name, param in named_parameters_full([model])
            }
            destroy_parallel()
            disable_features()
            assert set(errors) == {name for name, _ in reference.named_parameters()}
            results[(case, variant)] = (relative_error(loss, expected_loss), errors)
    return results


#: (algorithm, --ulysses-degree-in-cp, tp) by world size; cp = world size / tp. At 4 ranks: a real hybrid
#: (2 Ulysses pairs in a ring of 2) and TP 2 x CP 2.
CASES = {
    2: [("megatron_cp_algo", None, 1), ("ulysses_cp_algo", None, 1), ("hybrid_cp_algo", 2, 1)],
    4: [("hybrid_cp_algo", 2, 1), ("megatron_cp_algo", None, 2)],
}


def _two_rank_job(rank, world_size):
    """Every 2-rank case of this module in one job: the comparisons and the training run."""
    return {"compare": _compare(rank, world_size, CASES[2]), "train": _train_losses(rank, world_size, True, True)}


@pytest.fixture(scope="module")
def two_rank_results():
    return run_distributed(_two_rank_job, 2, timeout=900)


@pytest.fixture(scope="module")
def four_rank_results():
    return run_distributed(_compare, 4, CASES[4], timeout=900)


@pytest.mark.parametrize("world_size, case", [(size, case) for size, cases in CASES.items() for case in cases],
                         ids=lambda value: value if isinstance(value, int) else "-".join(map(str, value)))
def test_gpt_context_parallel_matches_single_process(request, world_size, case):
    if world_size == 2:
        per_rank = [results["compare"] for results in request.getfixturevalue("two_rank_results")]
    else:
        per_rank = request.getfixturevalue("four_rank_results")
    for rank, results in enumerate(per_rank):
        assert {variant for (done, variant) in results if done == case} == set(VARIANTS)
        for variant in VARIANTS:
            loss_error, grad_errors = results[(case, variant)]
            assert loss_error < RELATIVE_TOLERANCE, f"rank {rank} {variant}: loss error {loss_error:.2e}"
            worst = max(grad_errors, key=grad_errors.get)
            assert grad_errors[worst] < RELATIVE_TOLERANCE, (
                f"rank {rank} {variant}: gradient of {worst} off by {grad_errors[worst]:.2e}"
            )


STEPS = 20


def _train_losses(rank, world_size, use_distributed_optimizer, overlap_grad_reduce):
    """20 Adam steps of the same GPT on the same global batches: data parallel 2 (reference), then ring
    context parallel 2 under megatron DDP (optionally distributed optimizer and overlapped reduction)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ascendspeed.features import disable_features, enable_features
    from tests.helpers.megatron import (
        SEED, TinyGPT, build_gpt_model, destroy_parallel, full_parameters, initialize_parallel,
        load_full_parameters, make_batch, make_optimizer, masked_mean_loss, split_batch, wrap_ddp,
    )

    shape = TinyGPT(seq_length=16)
    global_batch = 4

    def train(ddp, optimizer, cp_split):
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        losses = []
        for _ in range(STEPS):
            batch = make_batch(shape, batch_size=global_batch, seed=100)  # memorised: the loss falls
            if not cp_split:  # data parallel: this rank's samples
                batch = split_batch(batch, parallel_state.get_data_parallel_world_size())[
                    parallel_state.get_data_parallel_rank()]
            micro_batches = split_batch(batch, batch["tokens"].shape[0] // shape.micro_batch_size)

            def forward_step(iterator, model):
                micro = next(iterator)
                if cp_split:
                    micro = batch_on_this_context_parallel_rank(dict(micro))
                output = model(micro["tokens"], micro["position_ids"], micro["attention_mask"],
                               labels=micro["labels"])

                def loss_func(per_token):
                    loss = masked_mean_loss(per_token, micro["loss_mask"])
                    return loss, {"lm loss": loss.detach().clone()}

                return output, loss_func

            for chunk in ddp:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            results = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(micro_batches), model=ddp[0],
                num_microbatches=len(micro_batches), seq_length=shape.seq_length,
                micro_batch_size=shape.micro_batch_size, forward_only=False,
            )
            optimizer.step()
            loss = torch.stack([r["lm loss"] for r in results]).mean()
            torch.distributed.all_reduce(loss, group=group)
            losses.append(loss.item() / group.size())
        return losses

    initialize_parallel()
    reference_model = build_gpt_model(shape.config(), shape)
    full = full_parameters(reference_model)
    ddp = wrap_ddp([reference_model])
    expected = train(ddp, make_optimizer(ddp), cp_split=False)
    destroy_parallel()

    enable_features(context_parallel_size=2)
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    model = build_gpt_model(shape.config(context_parallel_size=2), shape)
    load_full_parameters([model], full)
    ddp = wrap_ddp([model], use_distributed_optimizer=use_distributed_optimizer,
                   overlap_grad_reduce=overlap_grad_reduce, bucket_size=2000 if overlap_grad_reduce else None)
    losses = train(ddp, make_optimizer(ddp), cp_split=True)
    destroy_parallel()
    disable_features()
    return expected, losses


def test_twenty_training_steps_match_data_parallel(two_rank_results):
    """Ring CP 2 under megatron DDP with the distributed optimizer and overlapped reduction."""
    for results in two_rank_results:
        expected, losses = results["train"]
        assert expected[-1] < expected[0]
        assert losses == pytest.approx(expected, rel=1e-4)
