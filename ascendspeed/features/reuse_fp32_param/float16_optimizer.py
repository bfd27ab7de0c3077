"""``--reuse-fp32-param`` for megatron-core's ``Float16OptimizerWithFloat16Params`` (bf16, not distributed).

megatron-core keeps, beside every bf16 parameter, a separate fp32 copy (``main_param``) the inner
optimizer updates, and casts it back into the parameter after each step: 2 + 4 bytes per parameter.
Here the bf16 parameters are re-homed into int32 buffers (``storage.ParameterUnit``, small ones grouped):
a buffer's first half holds the parameters, its second half their remainders, and the whole buffer
viewed as fp32 holds the main weights the inner optimizer updates: 4 bytes per parameter, exactly the
same updates.
"""
from __future__ import annotations

import functools

import torch
from megatron.core import tensor_parallel

from ascendspeed.features.reuse_fp32_param.storage import ParameterUnit, ReuseState, group_parameters, main_layout
from ascendspeed.patching import replace, wrap


def reuse_state(optimizer):
    """The ``ReuseState`` of a megatron optimizer built with the feature on, else None."""
    return getattr(optimizer, "reuse_fp32_param", None)


#: Elements per shared buffer: small parameters are grouped (fewer, larger layout switches); a switch
#: stages 1 byte per element of its buffer (16 MiB here, or 1 byte per element of a larger parameter).
GROUP_ELEMENTS = 1 << 24


def _init(self, optimizer, config, grad_scaler, init_state_fn):
    """Megatron's constructor with the fp32 main weights built as views of the re-homed parameters
    (no fp32 copy is ever allocated)."""
    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

    if not config.bf16:
        raise ValueError("--reuse-fp32-param needs bf16 training (--bf16); this optimizer is not bf16")
    MixedPrecisionOptimizer.__init__(self, optimizer, config, grad_scaler, init_state_fn)
    self.is_stub_optimizer = not optimizer
    if not optimizer:
        return
    self.float16_groups, self.fp32_from_float16_groups, self.fp32_from_fp32_groups = [], [], []
    units, pieces = [], {}
    for param_group in self.optimizer.param_groups:
        trained = [(index, param) for index, param in enumerate(param_group["params"]) if param.requires_grad]
        for _, param in trained:
            if param.dtype not in (torch.bfloat16, torch.float32):
                raise TypeError(f"--reuse-fp32-param: parameters must be bf16 or fp32, got {param.dtype}")
        bf16 = [(index, param) for index, param in trained if param.dtype == torch.bfloat16]
        main_of = {}
        for group in group_parameters([param for _, param in bf16], GROUP_ELEMENTS):
            unit = ParameterUnit(group)
            units.append(unit)
            for param, main_param, (start, end) in zip(group, unit.main_params(), unit.ranges()):
                main_of[id(param)] = main_param
                pieces[main_param] = (unit, start, end)
        for index, param in bf16:
            main_param = main_of[id(param)]
            tensor_parallel.copy_tensor_model_parallel_attributes(main_param, param)
            if hasattr(param, "shared"):
                main_param.shared = param.shared
            param_group["params"][index] = main_param
            param.main_param = main_param
            if param in self.optimizer.state:
                self.optimizer.state[main_param] = self.optimizer.state.pop(param)
        self.float16_groups.append([param for _, param in bf16])
        self.fp32_from_float16_groups.append([main_of[id(param)] for _, param in bf16])
        self.fp32_from_fp32_groups.append([param for _, param in trained if param.dtype == torch.float32])
    self.reuse_fp32_param = ReuseState(units)
    self.reuse_fp32_param_pieces = pieces
    self.main_weight_tensors = self.reuse_fp32_param.storage_tensors


def wrap_step_with_ready_grads(original):
    """``MixedPrecisionOptimizer.step_with_ready_grads``: the inner step runs on the laid-out fp32 main
    weights; the wrapped ``_copy_main_params_to_model_params`` then splits them back (and on an
    exception they are split back too, so the model never keeps the main layout)."""

    @functools.wraps(original)
    def step_with_ready_grads(self):
        state = reuse_state(self)
        if state is None or self.is_stub_optimizer:
            return original(self)
        with main_layout(state):
            return original(self)

    return step_with_ready_grads


def wrap_copy_main_params_to_model_params(original):
    """After the step: encode the main weights back into bf16 weights + remainders (this is the cast
    Megatron does, rounding to nearest even) instead of copying into separate bf16 tensors."""

    @functools.wraps(original)
    def _copy_main_params_to_model_params(self):
        state = reuse_state(self)
        if state is None:
            return original(self)
        state.to_model_layout()

    return _copy_main_params_to_model_params


def wrap_copy_model_params_to_main_params(original):
    """``reload_model_params``: the main weights become the bf16 weights exactly (remainders zero)."""

    @functools.wraps(original)
    def _copy_model_params_to_main_params(self, state_dict=None):
        state = reuse_state(self)
        if state is None:
            return original(self, state_dict)
        if state_dict is not None:
            raise NotImplementedError("--reuse-fp32-param: main weights cannot be initialised from a state dict")
        state.reset_from_model()

    return _copy_model_params_to_main_params


def wrap_state_dict(original):
    """Checkpoints hold plain fp32 main weights (exact copies), so they load with or without the flag."""

    @functools.wraps(original)
    def state_dict(self, is_loading=False):
        result = original(self, is_loading)
        state = reuse_state(self)
        if state is not None and not state.in_main_layout:
            pieces = self.reuse_fp32_param_pieces
            result["fp32_from_fp16_params"] = [
                [_read(pieces[main]).view(main.shape) for main in group] for group in self.fp32_from_float16_groups
            ]
        return result

    return state_dict


def _read(piece):
    unit, start, end = piece
    return unit.read(start, end)


def wrap_load_state_dict(original):
    """Loading writes the saved fp32 main weights while they are laid out, then splits them."""

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        with main_layout(reuse_state(self)):
            return original(self, state_dict)

    return load_state_dict


def patches():
    return [
        replace("megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__", _init,
                expect="(self, optimizer, config, grad_scaler, init_state_fn)",
                name="bf16 parameters re-homed with their fp32 main weights"),
        wrap("megatron.core.optimizer.optimizer:MixedPrecisionOptimizer.step_with_ready_grads",
             wrap_step_with_ready_grads, expect="(self)"),
        wrap("megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params._copy_main_params_to_model_params",
             wrap_copy_main_params_to_model_params, expect="(self)"),
        wrap("megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params._copy_model_params_to_main_params",
             wrap_copy_model_params_to_main_params, expect="(self, state_dict=None)"),
        wrap("megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.state_dict", wrap_state_dict,
             expect="(self, is_loading=False)"),
        wrap("megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.load_state_dict",
             wrap_load_state_dict, expect="(self, state_dict)"),
    ]
