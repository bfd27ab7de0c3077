"""megatron-core's norm recompute (``CheckpointWithoutOutput``) under the activation account.

Two things the plan's "norms" option needs of megatron-core's ``CheckpointWithoutOutput``:

* **The account sees the freed outputs.** ``discard_output_and_register_recompute`` frees (resizes to zero) the
  norm's output, which the next linear saved; the saved-tensor account counted it when it was saved and would
  keep counting it. The wrap tells every recording account which storages it freed.
* **Gradients stay exact under saved-tensor hooks (megatron-core 0.15).** 0.15's recompute runs the norm on
  ``ctx.saved_tensors`` and its backward reads the input gradients from ``ctx.saved_tensors`` again, relying on
  both reads returning the same tensor objects. Without hooks they do; under any saved-tensor hooks (the
  account's, torch's offloading ones) each read of a saved leaf builds a new tensor that records no gradient,
  and the backward returns None for the norm's input: its gradient is lost (losses moved by 4e-4 after one
  profiling step). The wraps recompute from leaves detached from the saved inputs, remember them, and return
  their gradients, as megatron-core 0.16 and newer do themselves (``ctx.inputs``).
"""
from __future__ import annotations

import functools

import torch

from ascendspeed.patching import Patch, wrap
from ascendspeed.training.activations import stop_counting, storage_key


def wrap_discard_output(original):
    """``CheckpointWithoutOutput.discard_output_and_register_recompute``: the accounts stop counting what it
    freed (nothing is freed while a CUDA graph warms up, so the storages are checked after)."""

    @functools.wraps(original)
    def discard_output_and_register_recompute(self, hook_tensor):
        outputs = [output for output in (self.outputs or ()) if isinstance(output, torch.Tensor)]
        keys = [storage_key(output) for output in outputs]
        original(self, hook_tensor)
        stop_counting([key for key, output in zip(keys, outputs)
                       if key is not None and output.untyped_storage().nbytes() == 0])

    return discard_output_and_register_recompute


def _detached_leaf(value):
    if not isinstance(value, torch.Tensor):
        return value
    leaf = value.detach()
    leaf.requires_grad_(value.requires_grad)
    return leaf


def wrap_recompute_0_15(original):
    """0.15's ``CheckpointWithoutOutput._recompute``: the norm is recomputed from leaves of its own (detached
    from the saved inputs, which under saved-tensor hooks record no gradient), remembered on the autograd
    context."""

    @functools.wraps(original)
    def _recompute(self, grad):
        ctx, run_function = self.ctx, self.run_function
        if ctx is not None and run_function is not None:
            def remembering(*inputs):
                inputs = tuple(_detached_leaf(inp) for inp in inputs)
                ctx.ascendspeed_recomputed_from = inputs
                return run_function(*inputs)

            self.run_function = remembering
        return original(self, grad)

    return _recompute


def wrap_backward_0_15(original):
    """0.15's ``CheckpointWithoutOutputFunction.backward``: the gradients of the inputs the recompute ran on."""

    @functools.wraps(original)
    def backward(ctx, *grads):
        inputs = getattr(ctx, "ascendspeed_recomputed_from", None)
        if inputs is None:
            return original(ctx, *grads)
        torch.autograd.backward(ctx.outputs, grads)
        ctx.outputs = ctx.ascendspeed_recomputed_from = None
        return (None, None) + tuple(inp.grad if isinstance(inp, torch.Tensor) else inp for inp in inputs)

    return backward


def patches() -> list[Patch]:
    return [
        wrap("megatron.core.tensor_parallel.random:CheckpointWithoutOutput.discard_output_and_register_recompute",
             wrap_discard_output, expect="(self, hook_tensor)",
             name="adaptive recompute: wrap CheckpointWithoutOutput.discard_output_and_register_recompute, "
                  "the activation account stops counting the norm outputs it frees"),
        wrap("megatron.core.tensor_parallel.random:CheckpointWithoutOutput._recompute", wrap_recompute_0_15,
             expect="(self, _)", megatron="<0.16",
             name="adaptive recompute: wrap CheckpointWithoutOutput._recompute, remember the recomputed inputs"),
        wrap("megatron.core.tensor_parallel.random:CheckpointWithoutOutputFunction.backward", wrap_backward_0_15,
             expect="(ctx, *args)", megatron="<0.16",
             name="adaptive recompute: wrap CheckpointWithoutOutputFunction.backward, the gradients of the "
                  "recomputed inputs under saved-tensor hooks"),
    ]
