"""Distributed-optimizer checkpoints on megatron-core's ``torch.optim.Adam`` fallback (no apex, no TE).

Without apex or Transformer Engine (every CPU; an NPU without TE) megatron-core's ``DistributedOptimizer``
runs ``torch.optim.Adam``, whose iteration count ``step`` is a 0-dim tensor in *every parameter's* state,
where the fused optimizers keep one per parameter group. Megatron's checkpoint code for that path (the
branches under ``HAVE_APEX_OR_TE = False`` in ``megatron/core/optimizer/distrib_optimizer.py``) cannot
resume:

* ``state_dict`` collects the one step of all parameter states and asserts there is exactly one. A fresh
  optimizer has no parameter state yet, and Megatron-LM's ``torch_dist`` load calls ``state_dict`` on one
  (``sharded_state_dict(is_loading=True)``): a bare ``AssertionError``. Here the parameters without a step
  count as having taken the others' step (0 before the first), for that call only.
* An optimizer that holds no parameter at all has no step to collect: the expert optimizer of a pipeline
  stage without MoE layers (``--moe-layer-freq`` with dense stages, e.g. DeepSeek's first dense layers under
  PP). Saving failed on that assertion, and the ranks of other stages waited in the checkpoint's collectives
  for good. Its step is its chain's: ``ChainedOptimizer._synchronize_steps`` (called before every save and
  after every load, to align the steps TE's fused Adam keeps per parameter group) leaves torch's per-parameter
  steps alone, so here it also hands the step of the chain's parameters to the parameter groups of its
  optimizers that hold none, and such an optimizer reports the step of its groups. It matters: in the
  ``fully_reshardable`` format the optimizers' parameter groups are common state, written by rank 0 alone and
  loaded by every rank, so the expert optimizers of the MoE stages resume at the step rank 0's empty one
  reports.
* ``load_state_dict`` puts *one* step tensor into every parameter's state; ``torch.optim.Adam`` increments
  each parameter's step in place, so after a resume one step advances the count by the number of
  parameters (wrong bias correction). Each parameter gets its own copy.
* ``_get_main_param_and_optimizer_states`` (every writer of parameter state) returns each tensor of the
  parameter's optimizer state, ``step`` included: megatron-core 0.15's ``torch_dist`` layout
  (``dp_reshardable``) then fails to save, asserting that the 0-dim step has the shard's length (later
  releases skip it there). Every format stores the step in the parameter groups, so it is left out.
* ``_set_main_param_and_optimizer_states`` (every loader of parameter state) copies each tensor of the
  parameter's optimizer state from the checkpoint's, ``step`` included: ``--ckpt-format torch`` has no
  per-parameter step (``KeyError: 'step'``), ``torch_dist``'s ``dp_reshardable`` layout hands back the
  step the state had *before* the load (the count restarts at 0). The step is not parameter state: it
  comes from the parameter groups (``load_state_dict``) and is left alone here. It also copies into the
  main parameter, which for an fp32 parameter is a view of the model's leaf parameter: outside
  ``torch.no_grad()`` (``--ckpt-format torch``'s ``load_parameter_state_from_dp_zero``) autograd refuses
  ("a view of a leaf Variable that requires grad is being used in an in-place operation"). The copy runs
  under ``torch.no_grad()``.

* megatron-core's ``init_state_fn`` for Adam (made with every Adam optimizer, and called to give empty
  parameters their state before a checkpoint is loaded, and by Megatron's own tests before they save) puts
  ``exp_avg`` and ``exp_avg_sq`` into each empty parameter state, which is the whole state of TE's fused
  Adam. torch's Adam treats a non-empty state as one that has taken steps and reads its ``step``: its first
  update and its ``load_state_dict`` of such a state fail with ``KeyError: 'step'``. Wrapped where a
  Megatron optimizer stores it (``MegatronOptimizer.__init__``) over a torch ``Adam`` / ``AdamW``, it also
  gives each state it creates a ``step``: the others' (0 when none has one), one tensor each, where torch
  itself would put it.

* The non-distributed optimizers (``Float16OptimizerWithFloat16Params``, ``FP32Optimizer``) save the step
  of torch's Adam as one ``common_step`` and give it back to every parameter when loading, but only ``if
  step:``: a step of 0 is not saved, and a checkpoint of TE's fused Adam has its step in the parameter
  groups alone. Loading either into torch's Adam failed in torch's own ``load_state_dict`` with ``KeyError:
  'step'``. Their ``load_state_dict`` now first gives each loaded parameter state without a step its
  group's step from the checkpoint (0 where the group has none), where no ``common_step`` does.

* Megatron-FSDP leaves the gradient of a parameter ``None`` on a rank whose shard of it is empty, so torch's Adam,
  which makes a parameter's state at its first update, never makes one there; TE's fused Adam keeps a state for
  every parameter. ``sharded_param_state_fsdp_dtensor`` (``--ckpt-format fsdp_dtensor``) hands each rank's states
  to Megatron-LM's checkpoint code, which runs collectives per state (splitting SwiGLU's ``linear_fc1`` into
  DTensors that check their shards against the other ranks'): ranks with different states waited in those
  collectives for good. For that call each parameter without a state gets the one torch's Adam would make (zeros
  of its shape, the others' step), and a state seeded with moments alone, as for TE's fused Adam (Megatron's
  GPT-to-hybrid checkpoint test seeds them so), gets the others' step: torch's Adam failed on it with
  ``KeyError: 'step'`` in the dummy step of the load.

The patches act only when the installed megatron-core took the fallback (``HAVE_APEX_OR_TE`` is False),
read when they are called (checkpoint code, never per training step), or, for ``init_state_fn``, when the
wrapped optimizer is torch's own Adam; with apex or TE Megatron's code runs unchanged. They are applied on every device (feature ``accelerator.torch_adam``).
"""
from __future__ import annotations

import contextlib
import functools
import importlib

import torch

from ascendspeed.accelerator.cpu_optimizer import ADAM_CLASSES
from ascendspeed.patching import EXISTS, wrap

DISTRIB_OPTIMIZER = "megatron.core.optimizer.distrib_optimizer"


def uses_torch_adam() -> bool:
    """Whether megatron-core's distributed optimizer fell back to ``torch.optim.Adam`` (no apex, no TE)."""
    return not importlib.import_module(DISTRIB_OPTIMIZER).HAVE_APEX_OR_TE


def _parameters(optimizer):
    return [param for group in optimizer.param_groups for param in group["params"]]


#: The key of the stand-in state of an optimizer without parameters: a key no parameter can have.
_NO_PARAMETER = "ascendspeed: the step of an optimizer without parameters"


def _parameter_steps(optimizer) -> set[float]:
    return {float(s["step"]) for s in optimizer.state.values() if "step" in s}


def _the_others_step(optimizer) -> float:
    """The step the parameter states agree on, 0 when none has one (or they disagree)."""
    steps = _parameter_steps(optimizer)
    return steps.pop() if len(steps) == 1 else 0.0


@contextlib.contextmanager
def _every_parameter_has_a_step(optimizer):
    """Parameters without a ``step`` in their state get the step the others have (0 when none has one)
    until the block ends; their state is then as it was. An optimizer without parameters holds, for as
    long, one stand-in state with the step of its parameter groups (its chain's, 0 if they have none)."""
    state = optimizer.state
    if not _parameters(optimizer):
        group_steps = {float(group["step"]) for group in optimizer.param_groups if "step" in group}
        step = group_steps.pop() if len(group_steps) == 1 else 0.0
        state[_NO_PARAMETER] = {"step": torch.tensor(step, dtype=torch.float32)}
        try:
            yield
        finally:
            del state[_NO_PARAMETER]
        return
    steps = _parameter_steps(optimizer)
    if len(steps) > 1:
        yield  # Megatron's own assertion reports the disagreement
        return
    step = steps.pop() if steps else 0.0
    added, created = [], []
    for param in _parameters(optimizer):
        if param in state and "step" in state[param]:
            continue
        (added if param in state else created).append(param)
        state[param]["step"] = torch.tensor(step, dtype=torch.float32)
    try:
        yield
    finally:
        for param in added:
            del state[param]["step"]
        for param in created:
            del state[param]


@contextlib.contextmanager
def _every_parameter_has_a_state(optimizer):
    """Parameters without a state get, until the block ends, the one torch's Adam makes at a first update: zero
    moments of the parameter's shape and the others' step (0 when none has one). A state with moments but no
    step (seeded as for TE's fused Adam, which keeps its step in the parameter group) gets that step for good:
    torch's Adam cannot update or save it without one."""
    step = _the_others_step(optimizer)
    created = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if optimizer.state.get(param):
                optimizer.state[param].setdefault("step", _step_like_torch(group, param, step))
                continue
            moments = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad") else [])
            state = {"step": _step_like_torch(group, param, step)}
            state.update({name: torch.zeros_like(param, memory_format=torch.preserve_format) for name in moments})
            optimizer.state[param] = state
            created.append(param)
    try:
        yield
    finally:
        for param in created:
            optimizer.state.pop(param, None)


def wrap_sharded_param_state_fsdp_dtensor(original):
    """``DistributedOptimizer.sharded_param_state_fsdp_dtensor`` with a state for every parameter on every rank."""

    @functools.wraps(original)
    def sharded_param_state_fsdp_dtensor(self, *args, **kwargs):
        if not uses_torch_adam() or type(self.optimizer) not in ADAM_CLASSES:
            return original(self, *args, **kwargs)
        with _every_parameter_has_a_state(self.optimizer):
            return original(self, *args, **kwargs)

    return sharded_param_state_fsdp_dtensor


def wrap_state_dict(original):
    """``DistributedOptimizer.state_dict`` on an optimizer whose parameters have not all taken a step."""

    @functools.wraps(original)
    def state_dict(self):
        if not uses_torch_adam() or self.optimizer is None:
            return original(self)
        with _every_parameter_has_a_step(self.optimizer):
            return original(self)

    return state_dict


def wrap_synchronize_steps(original):
    """``ChainedOptimizer._synchronize_steps``, then the chain's step (that of its parameters' states) in the
    parameter groups of its torch-Adam optimizers that hold no parameter."""

    @functools.wraps(original)
    def _synchronize_steps(self):
        result = original(self)
        if not uses_torch_adam():
            return result
        inner = [getattr(optimizer, "optimizer", None) for optimizer in self.chained_optimizers]
        inner = [optimizer for optimizer in inner if isinstance(optimizer, torch.optim.Optimizer)]
        steps = set().union(*(_parameter_steps(optimizer) for optimizer in inner))
        if len(steps) == 1:
            step = steps.pop()
            for optimizer in inner:
                if not _parameters(optimizer):
                    for group in optimizer.param_groups:
                        group["step"] = step
        return result

    return _synchronize_steps


def wrap_load_state_dict(original):
    """``DistributedOptimizer.load_state_dict``, then one step tensor per parameter instead of a shared one."""

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        result = original(self, state_dict)
        if uses_torch_adam() and self.optimizer is not None:
            seen = set()
            for parameter_state in self.optimizer.state.values():
                step = parameter_state.get("step")
                if isinstance(step, torch.Tensor):
                    if id(step) in seen:
                        parameter_state["step"] = step.detach().clone()
                    else:
                        seen.add(id(step))
        return result

    return load_state_dict


def wrap_get_main_param_and_optimizer_states(original):
    """``DistributedOptimizer._get_main_param_and_optimizer_states`` without the step (not parameter state)."""

    @functools.wraps(original)
    def _get_main_param_and_optimizer_states(self, model_param):
        tensors = original(self, model_param)
        if uses_torch_adam():
            tensors.pop("step", None)
        return tensors

    return _get_main_param_and_optimizer_states


@contextlib.contextmanager
def _step_set_aside(parameter_state: dict):
    step = parameter_state.pop("step", None)
    try:
        yield
    finally:
        if step is not None:
            parameter_state["step"] = step


def wrap_set_main_param_and_optimizer_states(original):
    """``DistributedOptimizer._set_main_param_and_optimizer_states`` without autograd and without the step."""

    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if not uses_torch_adam() or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        tensors = {key: value for key, value in tensors.items() if key != "step"}
        with torch.no_grad(), _step_set_aside(self.optimizer.state[main_param]):
            return original(self, model_param, tensors)

    return _set_main_param_and_optimizer_states


def _step_like_torch(group: dict, param, value: float) -> torch.Tensor:
    """A ``step`` as torch's Adam makes it for ``param`` of ``group``: fp32 (fp64 under a float64 default), on
    the parameter's device when the group is fused or capturable, else on the CPU."""
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    on_device = group.get("fused") or group.get("capturable")
    return torch.tensor(value, dtype=dtype, device=param.device if on_device else "cpu")


def with_steps_for_torch_adam(init_state_fn):
    """``init_state_fn``, then a ``step`` in every parameter state it created: the others' step, 0 if none."""

    @functools.wraps(init_state_fn)
    def init_state(optimizer, *args, **kwargs):
        if type(optimizer) not in ADAM_CLASSES:
            return init_state_fn(optimizer, *args, **kwargs)
        empty = [(group, param) for group in optimizer.param_groups for param in group["params"]
                 if not optimizer.state.get(param)]
        result = init_state_fn(optimizer, *args, **kwargs)
        step = _the_others_step(optimizer)
        for group, param in empty:
            state = optimizer.state.get(param)
            if state and "step" not in state:
                state["step"] = _step_like_torch(group, param, step)
        return result

    return init_state


def wrap_megatron_optimizer_init(original):
    """Megatron's constructor, then its ``init_state_fn`` made to leave states torch's Adam can step."""

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "init_state_fn", None) is not None:
            self.init_state_fn = with_steps_for_torch_adam(self.init_state_fn)

    return __init__


def _steps_from_groups(optimizer_state_dict: dict) -> None:
    """Each parameter state of a torch optimizer state dict that has no ``step`` takes its group's (0 when
    the group has none), unless Megatron's own ``common_step`` is there to give it one."""
    states = optimizer_state_dict.get("state", {})
    if "common_step" in states:
        return
    for group in optimizer_state_dict.get("param_groups", []):
        step = float(group.get("step") or 0.0)
        for key in group["params"]:
            state = states.get(key)
            if state and "step" not in state:
                state["step"] = torch.tensor(step, dtype=torch.float32)


def wrap_load_state_dict_filling_steps(optimizer_state_dict_of):
    """A non-distributed Megatron optimizer's ``load_state_dict`` that first fills in the steps torch's Adam
    needs; ``optimizer_state_dict_of(state_dict)`` finds the torch optimizer's part of the checkpoint."""

    def wrap_it(original):
        @functools.wraps(original)
        def load_state_dict(self, state_dict):
            if type(getattr(self, "optimizer", None)) in ADAM_CLASSES:
                optimizer_state_dict = optimizer_state_dict_of(state_dict)
                if isinstance(optimizer_state_dict, dict):
                    _steps_from_groups(optimizer_state_dict)
            return original(self, state_dict)

        return load_state_dict

    return wrap_it


def patches():
    return [
        wrap("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.state_dict", wrap_state_dict,
             expect="(self)",
             name="torch adam checkpoints: wrap state_dict, parameters without a step yet count the others' step"),
        wrap("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.sharded_param_state_fsdp_dtensor",
             wrap_sharded_param_state_fsdp_dtensor, expect="(self, is_loading=False)",
             name="torch adam checkpoints: wrap sharded_param_state_fsdp_dtensor, a state for every parameter"),
        wrap("megatron.core.optimizer.optimizer:ChainedOptimizer._synchronize_steps", wrap_synchronize_steps,
             expect="(self)",
             name="torch adam checkpoints: wrap _synchronize_steps, optimizers without parameters take the chain's step"),
        wrap("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_state_dict", wrap_load_state_dict,
             expect="(self, state_dict)",
             name="torch adam checkpoints: wrap load_state_dict, one step tensor per parameter, not a shared one"),
        wrap("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._get_main_param_and_optimizer_states",
             wrap_get_main_param_and_optimizer_states, expect="(self, model_param)",
             name="torch adam checkpoints: wrap _get_main_param_and_optimizer_states, the step is no parameter state"),
        wrap("megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._set_main_param_and_optimizer_states",
             wrap_set_main_param_and_optimizer_states, expect="(self, model_param, tensors)",
             name="torch adam checkpoints: wrap _set_main_param_and_optimizer_states, no autograd, step left alone"),
        wrap("megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.load_state_dict",
             wrap_load_state_dict_filling_steps(
                 lambda state_dict: state_dict.get("optimizer", state_dict.get("optimizer_state_dict"))),
             expect="(self, state_dict)",
             name="torch adam checkpoints: wrap Float16OptimizerWithFloat16Params.load_state_dict, states without "
                  "a step take their group's"),
        wrap("megatron.core.optimizer.optimizer:FP32Optimizer.load_state_dict",
             wrap_load_state_dict_filling_steps(lambda state_dict: state_dict), expect="(self, state_dict)",
             name="torch adam checkpoints: wrap FP32Optimizer.load_state_dict, states without a step take their "
                  "group's"),
        # Every argument passes through and the optimizer's attribute is read after Megatron's constructor, so
        # its signature (a lambda default, whose repr changes per process) need not be pinned.
        wrap("megatron.core.optimizer.optimizer:MegatronOptimizer.__init__", wrap_megatron_optimizer_init,
             expect=EXISTS, name="torch adam checkpoints: wrap MegatronOptimizer.__init__, init_state_fn gives torch "
                                 "Adam's new states a step"),
    ]
