"""megatron-core's non-distributed optimizers over torch's Adam (no apex, no Transformer Engine): states made by
Megatron's ``init_state_fn`` take steps and checkpoint, and checkpoints without per-parameter steps load
(``ascendspeed/accelerator/torch_adam_checkpoints.py``). Real megatron-core optimizers on a gloo rank.

Before the fixes, Megatron's own tests/unit_tests/dist_checkpointing/test_layer_wise_optimizer.py failed 250 of
283 cases at 8 ranks with ``KeyError: 'step'``: its optimizers are seeded by ``init_state_fn``, saved at step 0
(which Megatron leaves out of the checkpoint) and loaded into torch's Adam.
"""
import torch

from tests.helpers import megatron as mu  # noqa: F401  installs ascendspeed (CPU shims) before megatron is used
from tests.helpers.distributed import run_distributed_cases


def _torch_parts(optimizer):
    return [part for part in getattr(optimizer, "chained_optimizers", [optimizer])]


def _steps(optimizer):
    return [float(state["step"]) for part in _torch_parts(optimizer) for state in part.optimizer.state.values()]


def _step_tensor_ids(optimizer):
    return {id(state["step"]) for part in _torch_parts(optimizer) for state in part.optimizer.state.values()}


def _case(rank, world_size, bf16, directory):
    from megatron.core import dist_checkpointing

    mu.initialize_parallel()
    shape = mu.TinyGPT()
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = shape.config(bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype)

    def build():
        ddp = mu.wrap_ddp(mu.build_model_chunks(config, shape))
        return ddp, mu.make_optimizer(ddp, lr=1e-3)

    result = {}
    ddp_a, optimizer_a = build()
    kinds = {type(part).__name__ for part in _torch_parts(optimizer_a)}
    for part in _torch_parts(optimizer_a):  # as Megatron's checkpoint tests seed their optimizers
        part.init_state_fn(part.optimizer)
    result["seeded_steps"] = _steps(optimizer_a)

    dist_checkpointing.save(optimizer_a.sharded_state_dict(ddp_a[0].sharded_state_dict()), directory)
    ddp_b, optimizer_b = build()
    loading = optimizer_b.sharded_state_dict(ddp_b[0].sharded_state_dict(), is_loading=True)
    optimizer_b.load_state_dict(dist_checkpointing.load(loading, directory))
    result["loaded_steps"] = _steps(optimizer_b)
    mu.train_step(ddp_b, optimizer_b, mu.make_batch(shape, seed=1))
    result["stepped"] = _steps(optimizer_b)
    result["distinct_step_tensors"] = len(_step_tensor_ids(optimizer_b)) == len(result["stepped"])

    # A checkpoint of TE's fused Adam: the step in the parameter groups, none per parameter.
    part = _torch_parts(optimizer_b)[0]
    saved = part.state_dict()
    torch_state = saved["optimizer"] if "optimizer" in saved else saved
    for state in torch_state["state"].values():
        del state["step"]
    for group in torch_state["param_groups"]:
        group["step"] = 7
    part.load_state_dict(saved)
    result["group_steps"] = [float(state["step"]) for state in part.optimizer.state.values()]
    result["kinds"] = kinds
    mu.destroy_parallel()
    return result


def test_seeded_states_step_save_at_step_zero_and_load(tmp_path):
    cases = [(bf16, str(tmp_path / f"bf16_{bf16}")) for bf16 in (False, True)]
    for _, directory in cases:
        (tmp_path / directory).mkdir()
    for (bf16, _), (result,) in zip(cases, run_distributed_cases(_case, 1, cases)):
        expected = {"Float16OptimizerWithFloat16Params"} if bf16 else {"FP32Optimizer"}
        assert result["kinds"] == expected
        assert result["seeded_steps"] and set(result["seeded_steps"]) == {0.0}, result
        assert set(result["loaded_steps"]) == {0.0}, result
        assert set(result["stepped"]) == {1.0} and result["distinct_step_tensors"], result
        assert result["group_steps"] and set(result["group_steps"]) == {7.0}, result
