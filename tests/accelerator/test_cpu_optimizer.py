"""torch's fused Adam kernel for megatron-core's torch Adam on CPU ranks (``ascendspeed.accelerator.cpu_optimizer``):
which optimizers get it, the update against float64, and Megatron's optimizers built by ``get_megatron_optimizer``
(fp32, bf16 with fp32 main parameters, the distributed optimizer) running on it."""
import pytest
import torch

from tests.helpers import megatron as mu  # noqa: F401  installs ascendspeed (CPU shims) before megatron is used
from tests.helpers.distributed import run_distributed_cases

from ascendspeed.accelerator.cpu_optimizer import use_fused_adam_on_cpu

SHAPES = [(33, 17), (5,), (64, 128), (1, 1)]
SETTINGS = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def parameters(dtype=torch.float32):
    return [torch.randn(shape, dtype=dtype, requires_grad=True) for shape in SHAPES]


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_torch_defaults_on_cpu_parameters_get_the_fused_kernel(cls):
    optimizer = cls(parameters(), **SETTINGS)
    assert use_fused_adam_on_cpu(optimizer)
    assert all(group["fused"] for group in optimizer.param_groups)


@pytest.mark.parametrize("make", [
    lambda params: torch.optim.AdamW(params, foreach=False),  # an explicit choice stays
    lambda params: torch.optim.AdamW(params, fused=False),
    lambda params: torch.optim.AdamW(params, differentiable=True),
    lambda params: torch.optim.SGD(params, lr=0.1),  # not Adam
], ids=["foreach-chosen", "fused-refused", "differentiable", "sgd"])
def test_other_optimizers_are_left_alone(make):
    optimizer = make(parameters())
    groups = [dict(group) for group in optimizer.param_groups]
    assert not use_fused_adam_on_cpu(optimizer)
    assert [dict(group) for group in optimizer.param_groups] == groups


def test_integer_parameters_are_left_alone():
    optimizer = torch.optim.Adam([torch.zeros(3, dtype=torch.float32), torch.nn.Parameter(torch.zeros(2))])
    optimizer.param_groups[0]["params"].append(torch.zeros(2, dtype=torch.int64))
    assert not use_fused_adam_on_cpu(optimizer)


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_fused_update_matches_float64_and_the_single_tensor_update(cls):
    fused_params, single_params = parameters(), None
    single_params = [p.detach().clone().requires_grad_() for p in fused_params]
    exact_params = [p.detach().double().requires_grad_() for p in fused_params]
    fused, single, exact = (cls(params, **SETTINGS) for params in (fused_params, single_params, exact_params))
    assert use_fused_adam_on_cpu(fused)
    for _ in range(5):
        grads = [torch.randn(shape) for shape in SHAPES]
        for params in (fused_params, single_params, exact_params):
            for param, grad in zip(params, grads):
                param.grad = grad.to(param.dtype)
        for optimizer in (fused, single, exact):
            optimizer.step()
    for fused_param, single_param, exact_param in zip(fused_params, single_params, exact_params):
        assert mu.relative_error(fused_param.detach(), exact_param.detach()) < 1e-6
        assert mu.relative_error(fused_param.detach(), single_param.detach().double()) < 1e-6
    assert all(state["step"].item() == 5 for state in fused.state.values())


def _megatron_optimizer_case(rank, world_size, bf16, distributed):
    mu.initialize_parallel()
    shape = mu.TinyGPT()
    config = shape.config(bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                          pipeline_dtype=torch.bfloat16 if bf16 else torch.float32)
    chunks = mu.build_model_chunks(config, shape)
    ddp = mu.wrap_ddp(chunks, use_distributed_optimizer=distributed)
    optimizer = mu.make_optimizer(ddp, lr=1e-3)
    torch_optimizers = [part.optimizer for part in getattr(optimizer, "chained_optimizers", [optimizer])]
    fused = [group["fused"] for part in torch_optimizers for group in part.param_groups]
    main_dtypes = {param.dtype for part in torch_optimizers for group in part.param_groups for param in group["params"]}
    losses = [torch.stack(mu.train_step(ddp, optimizer, mu.make_batch(shape, seed=step))).mean().item()
              for step in range(3)]
    mu.destroy_parallel()
    return {"fused": fused, "main_dtypes": main_dtypes, "losses": losses}


CASES = [(False, False), (True, False), (False, True), (True, True)]


def test_megatron_optimizers_run_on_the_fused_kernel():
    """fp32, bf16 (fp32 main parameters) and the distributed optimizer, built by ``get_megatron_optimizer`` on a
    CPU rank: every group of the torch Adam inside is fused, and training steps run."""
    for (bf16, distributed), (result,) in zip(CASES, run_distributed_cases(_megatron_optimizer_case, 1, CASES)):
        assert result["fused"] and all(result["fused"]), (bf16, distributed)
        assert result["main_dtypes"] == {torch.float32}
        assert all(torch.isfinite(torch.tensor(result["losses"])))
        assert result["losses"][-1] < result["losses"][0], (bf16, distributed, result["losses"])
