"""Autograd registration of ascendspeed's operators, with torch.func support.

``torch.library.register_autograd`` installs an Autograd kernel that calls ``autograd.Function.apply``.
Under a torch.func transform ``apply`` reroutes to functorch's ``custom_function_call``, which cannot
run from inside the dispatcher's Autograd key (and needs a ``setup_context`` staticmethod the generated
Function lacks), so ``torch.func.grad`` / ``vjp`` / ``jacrev`` over such an operator fail.

:func:`register_autograd` takes the same ``backward`` and ``setup_context`` functions and installs an
Autograd kernel that applies its Function the way torch's own (C++) autograd kernels work: the autograd
node is recorded on whatever tensors reach the Autograd key, which under ``torch.func.grad`` are that
transform's wrappers, so grad, vjp, jacrev, hessian and their compositions with vmap work as for
``torch.sin``. :func:`refuse_autograd` is the Autograd kernel of an operator without a derivative: it
raises instead of torch's warning and a silently missing gradient.

An operator with ``Tensor[]`` arguments (``grouped_linear``'s weights) is applied with its arguments
flattened, so each tensor of a list is an input of the autograd node; ``setup_context`` and ``backward`` see
the arguments as the schema has them (a list of gradients for a list), and ``ctx.input_needs_grad`` says which
inputs need a gradient in that same shape.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.utils._pytree as pytree
from torch.autograd import forward_ad
from torch._functorch.utils import enable_single_level_autograd_function

_LIBRARY = torch.library.Library("ascendspeed", "IMPL")


def _operator(name: str) -> torch._ops.OpOverload:
    return getattr(torch.ops.ascendspeed, name).default


def _with_defaults(op: torch._ops.OpOverload, args: tuple) -> tuple:
    """``args`` with the trailing arguments the caller left out filled in with the schema's defaults."""
    missing = op._schema.arguments[len(args):]
    return (*args, *(argument.default_value for argument in missing))


def _tensors(args):
    """The tensors of ``args``, those inside ``Tensor[]`` arguments included."""
    return (a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor))


def _requires_grad(args) -> bool:
    return any(a.requires_grad for a in _tensors(args))


def _has_tangent(args) -> bool:
    """Whether a forward-mode AD tangent (``torch.func.jvp``, ``jacfwd``, ``forward_ad``) rides on an input."""
    if forward_ad._current_level < 0:
        return False
    return any(forward_ad.unpack_dual(a).tangent is not None for a in _tensors(args))


def _refuse_forward_mode(name: str, args) -> None:
    if _has_tangent(args):
        raise RuntimeError(
            f"ascendspeed::{name} has no forward-mode derivative (torch.func.jvp, jacfwd, hessian, "
            "torch.autograd.forward_ad); without this error its tangent would silently be dropped. "
            "Use reverse mode: torch.func.grad, vjp, jacrev, or torch.autograd.grad"
        )


def _below_autograd(op, args):
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def register_autograd(name: str, backward: Callable, setup_context: Callable) -> type[torch.autograd.Function]:
    """Register ``backward`` / ``setup_context`` (``torch.library.register_autograd``'s contract: inputs
    with defaults filled in) as the Autograd kernel of ``ascendspeed::<name>``; returns the Function."""
    op = _operator(name)

    def forward(*args):
        # Function.apply switches forward-mode AD off around forward; on again, an input's tangent one
        # transform level down (hessian = jacfwd(jacrev)) reaches that level's kernel and is refused.
        with forward_ad._set_fwd_grad_enabled(True):
            return _below_autograd(op, args)

    flattened = any(isinstance(a.type, torch.ListType) and a.type.getElementType().isSubtypeOf(torch.TensorType.get())
                    for a in op._schema.arguments)
    if flattened:
        forward, setup_context, backward = _flattening(forward, setup_context, backward)

    function = type(
        f"GeneratedBackwardFor_ascendspeed_{name}_default",  # torch's name: grad_fn names stay as they were
        (torch.autograd.Function,),
        {
            "forward": staticmethod(forward),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward),
            "__doc__": f"Autograd of ascendspeed::{name}.",
        },
    )

    def autograd_kernel(*args):
        args = _with_defaults(op, args)
        _refuse_forward_mode(name, args)
        if torch.is_grad_enabled() and _requires_grad(args):
            if flattened:
                leaves, spec = pytree.tree_flatten(args)
                return _record(function, (spec, *leaves))
            return _record(function, args)
        return _below_autograd(op, args)

    _LIBRARY.impl(name, autograd_kernel, "Autograd")
    return function


def _flattening(forward: Callable, setup_context: Callable, backward: Callable):
    """``forward`` / ``setup_context`` / ``backward`` taking ``(spec, *leaves)``, the flattened arguments of an
    operator with ``Tensor[]`` arguments, around the ones written for the arguments as the schema has them."""

    def flat_forward(spec, *leaves):
        return forward(*pytree.tree_unflatten(list(leaves), spec))

    def flat_setup_context(ctx, inputs, output):
        spec, *leaves = inputs
        ctx.arguments_spec = spec
        setup_context(ctx, pytree.tree_unflatten(leaves, spec), output)

    def flat_backward(ctx, *grad_outputs):
        spec = ctx.arguments_spec
        ctx.input_needs_grad = pytree.tree_unflatten(list(ctx.needs_input_grad[1:]), spec)
        grads = backward(ctx, *grad_outputs)
        return (None, *(g for argument, grad in zip(spec.children(), grads) for g in _leaf_grads(argument, grad)))

    return flat_forward, flat_setup_context, flat_backward


def _leaf_grads(argument: pytree.TreeSpec, grad) -> list:
    """One gradient per leaf of an argument (its ``TreeSpec``) from ``grad``: None, one tensor, or a list."""
    leaves = argument.num_leaves
    if grad is None:
        return [None] * leaves
    if isinstance(grad, (list, tuple)):
        if len(grad) != leaves:
            raise RuntimeError(f"backward returned {len(grad)} gradients for a list of {leaves} inputs")
        return list(grad)
    return [grad]


def _record(function: type[torch.autograd.Function], args: tuple):
    """``function.apply`` without its detour through functorch: the C++ ``_FunctionBase.apply``, allowed
    (as functorch allows its own single-level Functions) to record on the current transform's tensors."""
    with enable_single_level_autograd_function():
        return super(torch.autograd.Function, function).apply(*args)


def refuse_autograd(name: str, why: str) -> None:
    """Make differentiating ``ascendspeed::<name>`` an error naming the operator and ``why``."""
    op = _operator(name)

    def autograd_kernel(*args):
        if (torch.is_grad_enabled() and _requires_grad(args)) or _has_tangent(args):
            raise RuntimeError(f"ascendspeed::{name} does not support autograd: {why}")
        return _below_autograd(op, args)

    _LIBRARY.impl(name, autograd_kernel, "Autograd")
