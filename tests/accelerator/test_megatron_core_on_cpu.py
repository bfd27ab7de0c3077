"""megatron-core on the CPU over gloo, checked against single-process references.

Each job is one spawn of real gloo ranks (process start-up dominates on 2 cores), so related checks share a
job and the tests below read its results:

* world size 1: GPTModel forward/backward through megatron's schedule equals a GPT written from scratch;
* 2 ranks, data parallel: megatron DDP + ``get_megatron_optimizer`` + ``get_forward_backward_func``, with
  and without the distributed optimizer, equals one process training on the whole batch; bf16 trains;
* 2 ranks, model parallel: TP 2, PP 2 and PP 2 with virtual pipeline 2 equal the unsharded model, and
  the interleaved pipeline without ascendspeed's gloo tags is shown to be silently wrong.
"""
import pytest
import torch

from tests.helpers.distributed import call, run_distributed, run_distributed_cases

TOLERANCE = 1e-6  # relative error, fp32
STEPS = 3
LR = 1e-2
# Adam divides by sqrt(v) + eps: with the default 1e-8 it turns rounding noise in gradients that are zero
# in exact arithmetic (the key bias: softmax ignores it) into full-size steps, so trajectories that agree
# to 1e-7 in every gradient part by 1e-4 in those parameters. A larger eps keeps such noise negligible
# (2e-7 after 3 steps).
ADAM_EPS = 1e-4


def _world_size_one(rank, world_size):
    from tests.helpers import megatron as mu

    shape = mu.TinyGPT()
    mu.initialize_parallel()
    config = shape.config()
    model = mu.build_gpt_model(config, shape)
    batch = mu.make_batch(shape, batch_size=2 * shape.micro_batch_size)
    full = {name: value.requires_grad_(True) for name, value in mu.full_parameters(model).items()}
    reference_losses = [mu.reference_gpt_loss(full, micro, config) for micro in mu.split_batch(batch, 2)]
    names = list(full)
    reference_grads = torch.autograd.grad(sum(reference_losses) / 2, [full[name] for name in names])
    losses = mu.run_forward_backward([model], batch, shape)
    return {
        "losses": torch.stack(losses),
        "reference_losses": torch.stack(reference_losses).detach(),
        "grad_error": mu.max_relative_error(mu.gradients([model]), dict(zip(names, reference_grads))),
    }


def _reference_training(mu, shape, batches):
    """One process, whole batches, plain torch Adam: initial weights, per-step grads, final weights."""
    mu.initialize_parallel()
    model = mu.build_gpt_model(shape.config(), shape)
    initial = mu.full_parameters(model)
    adam = torch.optim.Adam(model.parameters(), lr=LR, eps=ADAM_EPS)
    grads, losses = [], []
    for batch in batches:
        model.zero_grad()
        losses.append(torch.stack(mu.reference_forward_backward(model, batch, shape)))
        grads.append(mu.gradients([model]))
        adam.step()
    final = mu.full_parameters(model)
    mu.destroy_parallel()
    return initial, grads, losses, final


def _data_parallel_training(mu, shape, batches, initial, reference_grads, use_distributed_optimizer):
    mu.initialize_parallel()
    chunks = mu.build_model_chunks(shape.config(), shape)
    mu.load_full_parameters(chunks, initial)
    ddp = mu.wrap_ddp(chunks, use_distributed_optimizer=use_distributed_optimizer)
    optimizer = mu.make_optimizer(ddp, lr=LR, adam_eps=ADAM_EPS)
    grad_errors, losses = [], []
    for batch, expected in zip(batches, reference_grads):
        ddp[0].zero_grad_buffer()
        optimizer.zero_grad()
        losses.append(torch.stack(mu.run_forward_backward(ddp, mu.data_parallel_slice(batch), shape)))
        if use_distributed_optimizer:
            mu.gather_reduced_gradients(ddp[0])
        grad_errors.append(mu.max_relative_error(mu.gradients(ddp), expected))
        optimizer.step()
    final = {name: param.detach().clone() for name, param in mu.named_parameters_full(ddp)}
    mu.destroy_parallel()
    return {"grad_errors": grad_errors, "losses": losses, "final": final}


def _bf16_training(mu, shape, steps=8):
    mu.initialize_parallel()
    config = shape.config(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    ddp = mu.wrap_ddp(mu.build_model_chunks(config, shape), use_distributed_optimizer=True)
    optimizer = mu.make_optimizer(ddp, lr=LR)
    batch = mu.make_batch(shape, batch_size=4 * shape.micro_batch_size, seed=11)
    mean_losses = []
    for _ in range(steps):
        loss = torch.stack(mu.train_step(ddp, optimizer, mu.data_parallel_slice(batch), shape)).mean()
        torch.distributed.all_reduce(loss)
        mean_losses.append(loss.item() / torch.distributed.get_world_size())
    parameters = torch.cat([p.detach().float().flatten() for _, p in mu.named_parameters_full(ddp)])
    dtypes = {str(p.dtype) for _, p in mu.named_parameters_full(ddp)}
    mu.destroy_parallel()
    return {"losses": mean_losses, "parameters": parameters, "dtypes": dtypes}


def _data_parallel(rank, world_size):
    from tests.helpers import megatron as mu

    shape = mu.TinyGPT()
    batches = [mu.make_batch(shape, batch_size=2 * world_size * shape.micro_batch_size, seed=s) for s in range(STEPS)]
    initial, reference_grads, reference_losses, reference_final = _reference_training(mu, shape, batches)
    results = {"reference_losses": reference_losses, "reference_final": reference_final}
    for name, distributed in (("ddp", False), ("distributed_optimizer", True)):
        results[name] = _data_parallel_training(mu, shape, batches, initial, reference_grads, distributed)
    results["bf16"] = _bf16_training(mu, shape)
    return results


def _layout_errors(mu, chunks, reference_grads):
    config = mu.unwrap(chunks[0]).config
    grads = mu.gradients(chunks)
    return {
        name: mu.relative_error(grads[name], mu.shard_like(reference_grads[name], param, name, config))
        for name, param in mu.named_parameters_full(chunks)
    }


def _model_parallel(rank, world_size):
    from tests.helpers import megatron as mu

    from ascendspeed import accelerator
    from ascendspeed.patching import MANAGER

    shape = mu.TinyGPT(num_layers=4)
    batch = mu.make_batch(shape, batch_size=4 * shape.micro_batch_size)
    mu.initialize_parallel()
    reference = mu.build_gpt_model(shape.config(), shape)
    full = mu.full_parameters(reference)
    results = {"reference_losses": torch.stack(mu.reference_forward_backward(reference, batch, shape))}
    reference_grads = mu.gradients([reference])
    mu.destroy_parallel()

    def run(name, sizes, **config_overrides):
        mu.initialize_parallel(**sizes)
        chunks = mu.build_model_chunks(shape.config(**config_overrides), shape)
        mu.load_full_parameters(chunks, full)
        losses = mu.run_forward_backward(chunks, batch, shape)
        results[name] = {"losses": torch.stack(losses) if losses else None,
                         "errors": _layout_errors(mu, chunks, reference_grads)}
        mu.destroy_parallel()

    run("tp2", dict(tp=2))
    run("pp2", dict(pp=2))
    run("pp2_vpp2", dict(pp=2, vpp=2))
    run("pp2_vpp2_overlapped", dict(pp=2, vpp=2), overlap_p2p_comm=True, batch_p2p_comm=False,
        deallocate_pipeline_outputs=True)
    MANAGER.revert(accelerator.GLOO_P2P_FEATURE)
    try:
        run("pp2_vpp2_without_gloo_tags", dict(pp=2, vpp=2))
    finally:
        MANAGER.apply(accelerator.GLOO_P2P_FEATURE, accelerator.gloo_p2p_patches())
    return results


def _threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


def _rebuilt_parallel_state(rank, world_size):
    """Threads and process groups after setting megatron's parallel state up and down 4 times (TP 2, then
    DP 2), with ascendspeed's shims and with Megatron's own destroy_model_parallel."""
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d

    from ascendspeed import accelerator
    from ascendspeed.patching import MANAGER

    def cycles():
        groups, threads = len(distributed_c10d._world.pg_map), _threads()
        for tp in (2, 1, 2, 1):
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
            torch.distributed.barrier(group=parallel_state.get_tensor_model_parallel_group())
            parallel_state.destroy_model_parallel()
        return len(distributed_c10d._world.pg_map) - groups, _threads() - threads

    results = {"ascendspeed": cycles()}
    MANAGER.revert(accelerator.CPU_FEATURE)
    try:
        results["megatron"] = cycles()
    finally:
        MANAGER.apply(accelerator.CPU_FEATURE, accelerator.cpu_patches())
    return results


def _meshed_group_outlives_its_state(rank, world_size):
    """DeviceMeshes over a state's groups (Megatron-FSDP's) still reach them by name under the next state, as on
    NCCL: a mesh kept alive, and a copy of a mesh (a deep-copied state dict's) that outlives its original. The
    state's other groups are destroyed with it."""
    import copy

    from megatron.core import parallel_state
    from torch.distributed import DeviceMesh, distributed_c10d

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    meshed = parallel_state.get_data_parallel_group()
    copied = parallel_state.get_tensor_model_parallel_group()
    other = parallel_state.get_pipeline_model_parallel_group()
    mesh = DeviceMesh.from_group(meshed, "cuda")
    copied_mesh = copy.deepcopy(DeviceMesh.from_group(copied, "cuda"))
    names = meshed.group_name, copied.group_name, other.group_name
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    summed = torch.full((3,), float(rank + 1))
    torch.distributed.all_reduce(summed, group=mesh.get_group())
    own = torch.full((3,), float(rank + 1))
    torch.distributed.all_reduce(own, group=copied_mesh.get_group())
    alive = [name in distributed_c10d._world.pg_names.values() for name in names]
    parallel_state.destroy_model_parallel()
    return summed, own, alive


@pytest.fixture(scope="module")
def world_size_one():
    return run_distributed(_world_size_one, 1)[0]


@pytest.fixture(scope="module")
def two_ranks():
    """The data- and model-parallel runs in one 2-rank job."""
    return run_distributed_cases(call, 2, [(_data_parallel,), (_model_parallel,), (_rebuilt_parallel_state,),
                                           (_meshed_group_outlives_its_state,)])


@pytest.fixture(scope="module")
def data_parallel(two_ranks):
    return two_ranks[0]


@pytest.fixture(scope="module")
def model_parallel(two_ranks):
    return two_ranks[1]


def _relative(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def test_gpt_forward_backward_world_size_one_matches_a_plain_torch_gpt(world_size_one):
    assert _relative(world_size_one["losses"], world_size_one["reference_losses"]) <= TOLERANCE
    assert world_size_one["grad_error"] <= TOLERANCE


@pytest.mark.parametrize("variant", ["ddp", "distributed_optimizer"])
def test_data_parallel_training_matches_one_process(data_parallel, variant):
    for rank, result in enumerate(data_parallel):
        run = result[variant]
        assert max(run["grad_errors"]) <= TOLERANCE, f"rank {rank}: reduced gradients differ from the reference"
        for step, (losses, reference) in enumerate(zip(run["losses"], result["reference_losses"])):
            share = reference.chunk(len(data_parallel))[rank]
            assert _relative(losses, share) <= TOLERANCE, f"rank {rank} step {step}: losses differ"
        worst = max(_relative(run["final"][n], result["reference_final"][n]) for n in run["final"])
        assert worst <= TOLERANCE, f"rank {rank}: parameters after {STEPS} Adam steps differ from the reference"
    first, second = (result[variant]["final"] for result in data_parallel)
    assert all(torch.equal(first[name], second[name]) for name in first), "ranks disagree on the parameters"


def test_bf16_mixed_precision_trains_and_ranks_agree(data_parallel):
    first, second = (result["bf16"] for result in data_parallel)
    assert first["dtypes"] == {"torch.bfloat16"}
    assert first["losses"] == second["losses"]
    assert first["losses"][-1] < 0.9 * first["losses"][0], f"loss did not fall: {first['losses']}"
    assert torch.equal(first["parameters"], second["parameters"])


@pytest.mark.parametrize("layout", ["tp2", "pp2", "pp2_vpp2", "pp2_vpp2_overlapped"])
def test_model_parallel_layout_matches_the_unsharded_model(model_parallel, layout):
    for rank, result in enumerate(model_parallel):
        run = result[layout]
        worst = max(run["errors"].values())
        assert worst <= TOLERANCE, f"rank {rank}: gradient error {worst:.2e} ({max(run['errors'], key=run['errors'].get)})"
        if run["losses"] is not None:
            assert _relative(run["losses"], result["reference_losses"]) <= TOLERANCE
    assert any(result[layout]["losses"] is not None for result in model_parallel), "no stage reported losses"


def test_interleaved_pipeline_without_gloo_tags_is_silently_wrong(model_parallel):
    """The trap the ``accelerator.cpu.gloo_p2p`` feature closes: nothing fails, the numbers are wrong."""
    worst = max(max(result["pp2_vpp2_without_gloo_tags"]["errors"].values()) for result in model_parallel)
    assert worst > 1e-2


def test_a_rebuilt_parallel_state_leaves_no_process_groups_or_threads_behind(two_ranks):
    """Each gloo group runs threads; Megatron's destroy_model_parallel forgets most groups without destroying
    them, so tests (Megatron's too) that rebuild the state ran hundreds of threads per rank."""
    for rank, results in enumerate(two_ranks[2]):
        assert results["ascendspeed"] == (0, 0), f"rank {rank}: (groups, threads) left {results['ascendspeed']}"
        groups, threads = results["megatron"]
        assert groups > 10 and threads > 20, f"rank {rank}: without the shim {results['megatron']}"


def test_a_group_a_device_mesh_names_outlives_its_state_as_on_nccl(two_ranks):
    """Megatron-FSDP's DTensors carry their mesh across model-parallel states, and the mesh finds its groups by
    name: those groups are kept (Megatron's GPT-to-hybrid Megatron-FSDP checkpoint tests load one layout's model
    into another's); the state's other groups still go with it."""
    for rank, (summed, own, (meshed_alive, copied_alive, other_alive)) in enumerate(two_ranks[3]):
        assert torch.equal(summed, torch.full((3,), 3.0)), f"rank {rank}"
        assert torch.equal(own, torch.full((3,), float(rank + 1))), f"rank {rank}"
        assert meshed_alive and copied_alive and not other_alive, f"rank {rank}"
