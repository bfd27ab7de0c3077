"""megatron-core's fused elementwise functions in the forms that run fastest on a CPU.

``fusions.fused_bias_gelu`` (Megatron's default MLP activation with a bias: ``bias_gelu_fusion``) computes
GeLU's tanh approximation with ``torch.tanh``, compiled by ``megatron.core.jit.jit_fuser``. On a CPU the
compiled ``tanh`` is not vectorised and the pair costs 2.5x torch's exact GeLU. The same function is
``x * sigmoid(2u)`` (``0.5 * (1 + tanh(u)) = sigmoid(2u)``), and its derivative ``s + 2 x s (1 - s) u'``
with ``s = sigmoid(2u)`` (``1 - tanh(u)^2 = 4 s (1 - s)``), with Megatron's constants; the compiler
vectorises ``sigmoid``, and the pair runs in 0.4x the time. The two forms differ by rounding only (both
within 6e-7 of the float64 function in fp32; tests/accelerator/test_cpu_fusions.py). Half-precision inputs
are summed and evaluated in fp32 and rounded once, so the result is within one rounding of the float64
function at every x (Megatron's form rounds ``bias + y`` first, which GeLU's tail amplifies). Each compiled
call still passes the compiled graph's guards and wrappers, which cost about as much as its arithmetic at the
sizes of a small model; on CPU tensors of one dtype both functions run the C++ operators of that form,
``ascendspeed::bias_gelu`` and ``bias_gelu_backward`` (``ascendspeed/ops/bias_gelu.py``,
``bench/bias_gelu.py``), and the compiled form serves anything else.

``fusions.fused_bias_dropout``'s fused bias-dropout-add (``bias_dropout_fusion``, Megatron's default: twice per
transformer layer) is Megatron's own eager function compiled by ``jit_fuser``. On a CPU the compiled call costs
more than the eager one at every size and dropout rate measured (``bench/bias_dropout_add.py``, forward and
backward, one thread, compiled / eager: 1.56x at [128, 8, 128] and 1.26x at [256, 4, 512] without dropout, 2.65x
and 2.77x with dropout 0.1): the compiled graph's guards and wrappers outweigh the one pass saved, and its dropout
draws the mask more slowly than torch's kernel. On CPU tensors both fused functions run Megatron's eager
function: the same arithmetic in the same order, dropout masks drawn by torch from the same CPU generator.

``tensor_parallel.vocab_parallel_cross_entropy`` (the loss of every Megatron language model without TE's
fused cross-entropy) makes eight passes over the fp32 logits and three all-reduces on the tensor-parallel
group, also when that group is one rank: 1.8 ms of a 120 ms step of bench/peer_step.py's small model, where
torch's fused ``cross_entropy`` (log-softmax and gather, one pass each way) takes 0.3 ms. With one
tensor-parallel rank and no label smoothing it is that: the same loss of the fp32 logits, rounded differently
(the log of the sum of exponentials shifted by the maximum in both; within 2 ulp of fp32 in the tests).
"""
from __future__ import annotations

import functools

import torch

from ascendspeed.patching import replace, wrap

#: Megatron's constants: sqrt(2 / pi), GeLU's cubic coefficient, and 3 * 0.044715 * sqrt(2 / pi).
SQRT_2_OVER_PI = 0.79788456
CUBIC = 0.044715
CUBIC_SLOPE = 0.1070322243


def _exact_sum(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``bias + y`` in fp32 (fp64 for fp64). A bf16 sum rounds x by 2^-9, and GeLU's tail multiplies
    a relative error in x by about x^2: at x = -4, 3 % in the output."""
    compute = torch.float64 if torch.promote_types(bias.dtype, y.dtype) == torch.float64 else torch.float32
    return bias.to(compute) + y.to(compute)


def bias_gelu_sigmoid_form(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(bias + y)`` as ``x * sigmoid(2u)``, computed in fp32 and rounded once."""
    x = _exact_sum(bias, y)
    out = x * torch.sigmoid(2.0 * SQRT_2_OVER_PI * x * (1 + CUBIC * x * x))
    return out.to(torch.promote_types(bias.dtype, y.dtype))


def bias_gelu_back_sigmoid_form(g: torch.Tensor, bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of ``gelu_tanh(bias + y)`` times ``g``, from ``s = sigmoid(2u)``, computed in fp32 and
    rounded once."""
    x = _exact_sum(bias, y)
    s = torch.sigmoid(2.0 * SQRT_2_OVER_PI * x * (1 + CUBIC * x * x))
    grad = (s + 2.0 * x * s * (1 - s) * (SQRT_2_OVER_PI + CUBIC_SLOPE * x * x)) * g.to(x.dtype)
    return grad.to(torch.promote_types(g.dtype, y.dtype))


_OPERATOR_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _operator_applies(bias: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether the C++ bias-GeLU operators take these arguments: CPU tensors of one dtype they support, the bias
    a vector as long as the last dimension of the others."""
    return (bias.device.type == "cpu" and bias.dtype in _OPERATOR_DTYPES and bias.dim() == 1
            and all(t.device.type == "cpu" and t.dtype == bias.dtype and t.dim() > 0 and t.size(-1) == bias.numel()
                    for t in tensors))


@functools.lru_cache(maxsize=None)
def _operators_built() -> bool:
    """Whether ascendspeed's C++ operators load (a build without them, ``ASCENDSPEED_BUILD_C=0``, keeps the
    compiled form); importing ``ascendspeed.ops.bias_gelu`` registers the operators' autograd and kernels."""
    try:
        import ascendspeed.ops.bias_gelu  # noqa: F401
    except RuntimeError:
        return False
    return True


def bias_gelu_on_cpu_operator(compiled):
    """Megatron's ``bias_gelu(bias, y)``: ``ascendspeed::bias_gelu`` where it applies, else ``compiled``."""

    def bias_gelu(bias, y):
        if _operator_applies(bias, y) and _operators_built():
            return torch.ops.ascendspeed.bias_gelu(y, bias)
        return compiled(bias, y)

    return bias_gelu


def bias_gelu_back_on_cpu_operator(compiled):
    """Megatron's ``bias_gelu_back(g, bias, y)``: ``ascendspeed::bias_gelu_backward`` where it applies, else
    ``compiled``."""

    def bias_gelu_back(g, bias, y):
        if _operator_applies(bias, g, y) and _operators_built():
            return torch.ops.ascendspeed.bias_gelu_backward(g, y, bias)
        return compiled(g, bias, y)

    return bias_gelu_back


def _fused_on_first_call(function):
    """``function`` under Megatron's compile policy (``megatron.core.jit.jit_fuser``, read when first called:
    the shims are made before megatron-core is imported)."""
    fused = None

    @functools.wraps(function)
    def call(*args):
        nonlocal fused
        if fused is None:
            from megatron.core.jit import jit_fuser

            fused = jit_fuser(function)
        return fused(*args)

    return call


def wrap_vocab_parallel_cross_entropy(original):
    """Megatron's vocab-parallel cross-entropy; with one tensor-parallel rank and no label smoothing (whose
    Megatron form differs from torch's), torch's fused cross-entropy of the same fp32 logits. megatron-core
    0.19 added ``tp_group`` (the group of the model-parallel state before)."""

    @functools.wraps(original)
    def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, **group):
        if label_smoothing == 0.0:
            from megatron.core import parallel_state

            tp_group = group.get("tp_group") or parallel_state.get_tensor_model_parallel_group()
            if tp_group.size() == 1:
                logits = vocab_parallel_logits.float()
                losses = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), target.reshape(-1),
                                                           reduction="none")
                return losses.view_as(target)
        return original(vocab_parallel_logits, target, label_smoothing, **group)

    return vocab_parallel_cross_entropy


def wrap_bias_dropout_add_eager_on_cpu(original, *, training: bool):
    """Megatron's fused bias-dropout-add (``original``, compiled) for CPU tensors replaced by the eager function
    it compiles, ``_bias_dropout_add_func`` (looked up when called, so a patched one is honoured)."""
    from megatron.core.fusions import fused_bias_dropout

    @functools.wraps(original)
    def bias_dropout_add(x_with_bias, residual, prob):
        if residual.device.type == "cpu":
            return fused_bias_dropout._bias_dropout_add_func(x_with_bias, residual, prob, training)
        return original(x_with_bias, residual, prob)

    return bias_dropout_add


CROSS_ENTROPY = "cpu fusions: wrap vocab_parallel_cross_entropy, torch's cross-entropy on one tensor-parallel rank"


def patches():
    return [
        wrap("megatron.core.tensor_parallel.cross_entropy:vocab_parallel_cross_entropy",
             wrap_vocab_parallel_cross_entropy, expect="(vocab_parallel_logits, target, label_smoothing=0.0)",
             megatron="<0.19", name=CROSS_ENTROPY),
        wrap("megatron.core.tensor_parallel.cross_entropy:vocab_parallel_cross_entropy",
             wrap_vocab_parallel_cross_entropy,
             expect="(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None)",
             megatron=">=0.19", name=CROSS_ENTROPY),
        wrap("megatron.core.fusions.fused_bias_dropout:bias_dropout_add_fused_train",
             functools.partial(wrap_bias_dropout_add_eager_on_cpu, training=True),
             expect="(x_with_bias, residual, prob)",
             name="cpu fusions: bias-dropout-add (training) eager on CPU tensors"),
        wrap("megatron.core.fusions.fused_bias_dropout:bias_dropout_add_fused_inference",
             functools.partial(wrap_bias_dropout_add_eager_on_cpu, training=False),
             expect="(x_with_bias, residual, prob)",
             name="cpu fusions: bias-dropout-add (inference) eager on CPU tensors"),
        replace("megatron.core.fusions.fused_bias_gelu:bias_gelu",
                bias_gelu_on_cpu_operator(_fused_on_first_call(bias_gelu_sigmoid_form)), expect="(bias, y)",
                name="cpu fusions: bias-GeLU (tanh form) as x * sigmoid(2u), on the C++ operator"),
        replace("megatron.core.fusions.fused_bias_gelu:bias_gelu_back",
                bias_gelu_back_on_cpu_operator(_fused_on_first_call(bias_gelu_back_sigmoid_form)),
                expect="(g, bias, y)", name="cpu fusions: its gradient from the same sigmoid, on the C++ operator"),
    ]
