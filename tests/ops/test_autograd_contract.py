"""Every differentiable operator of ascendspeed.ops, past the first derivative (issue 21, round 2).

For each operator: the second derivative (``create_graph=True``) against a float64 reference of the same
math and ``gradgradcheck``; ``torch.func`` reverse-mode transforms (grad, vjp, jacrev, vmap of grad)
against the reference; forward-mode AD refused with an error naming the operator (it used to drop the
tangent silently); the backward operators, called directly, refusing autograd. And the ALiBi slopes'
gradient, degenerate shapes and head dimension 0. Inputs are fresh random draws.
"""
import functools

import pytest
import torch

from ascendspeed.ops import (alibi_attention, alibi_slopes, bias_gelu, rms_norm, rotary_embedding, swiglu,
                             weighted_swiglu)
from ascendspeed.ops.bias_gelu import bias_gelu_reference
from ascendspeed.ops.alibi_flash_attention import alibi_flash_attention
from ascendspeed.ops.rms_norm import rms_norm_reference
from ascendspeed.ops.rotary import rotary_embedding_reference
from ascendspeed.ops.swiglu import swiglu_reference

pytestmark = pytest.mark.megatron_independent  # one release covers it: .ci/run runs it on the newest only

F64 = torch.float64
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 6e-2}


def attention_reference(query, key, value, slopes, scale=None, q_offset=0):
    """Causal ALiBi attention in eager float64 ops, differentiable in every tensor (slopes too)."""
    query, key, value = query.to(F64), key.to(F64), value.to(F64)
    scale = query.size(-1) ** -0.5 if scale is None else scale
    sq, sk = query.size(-2), key.size(-2)
    distance = torch.arange(q_offset, q_offset + sq, dtype=F64)[:, None] - torch.arange(sk, dtype=F64)
    scores = query @ key.transpose(-1, -2) * scale - slopes.to(F64)[:, None, None] * distance
    return torch.softmax(scores.masked_fill(distance < 0, float("-inf")), -1) @ value


FREQS = torch.randn(5, 1, 1, 6)  # rotates 6 of 8 features (the rest passes through)
FREQS_FULL = torch.randn(4, 1, 1, 6, dtype=F64)  # every feature, interleaved pairs, fp64 angles


# (name, operator, reference, make inputs(dtype) -> differentiable tensors, fixed arguments)
def _rms_inputs(shape, dtype):
    return [torch.randn(shape, dtype=F64).to(dtype), (1 + 0.5 * torch.randn(shape[-1], dtype=F64)).to(dtype)]


def _attention_inputs(b, h, sq, sk, d, dtype):
    return [torch.randn(b, h, n, d, dtype=F64).to(dtype) for n in (sq, sk, sk)]


CASES = {
    "rms_norm": [
        (lambda x, w: rms_norm(x, w), lambda x, w: rms_norm_reference(x.to(F64), w.to(F64)),
         functools.partial(_rms_inputs, (3, 9))),
        (lambda x, w: rms_norm(x, w, 1e-2, True), lambda x, w: rms_norm_reference(x.to(F64), w.to(F64), 1e-2, True),
         functools.partial(_rms_inputs, (2, 2, 5))),
    ],
    "swiglu": [
        (lambda x: swiglu(x), lambda x: swiglu_reference(x.to(F64)),
         lambda dtype: [torch.randn(4, 10, dtype=F64).to(dtype)]),
        (lambda x: swiglu(x, 0), lambda x: swiglu_reference(x.to(F64), 0),
         lambda dtype: [torch.randn(6, 3, dtype=F64).to(dtype)]),
    ],
    "weighted_swiglu": [
        (weighted_swiglu, lambda x, w: torch.nn.functional.silu(x.to(F64)[:, :5]) * x.to(F64)[:, 5:] * w.to(F64),
         lambda dtype: [torch.randn(4, 10, dtype=F64).to(dtype), torch.rand(4, 1, dtype=F64).to(dtype)]),
    ],
    "bias_gelu": [
        (bias_gelu, lambda y, b: bias_gelu_reference(y.to(F64), b.to(F64)),
         lambda dtype: [(2 * torch.randn(4, 6, dtype=F64)).to(dtype), torch.randn(6, dtype=F64).to(dtype)]),
    ],
    "rotary_embedding": [
        (lambda t: rotary_embedding(t, FREQS), lambda t: rotary_embedding_reference(t.to(F64), FREQS.to(F64)),
         lambda dtype: [torch.randn(5, 2, 3, 8, dtype=F64).to(dtype)]),
        (lambda t: rotary_embedding(t, FREQS_FULL, True),
         lambda t: rotary_embedding_reference(t.to(F64), FREQS_FULL.to(F64), True),
         lambda dtype: [torch.randn(4, 1, 2, 6, dtype=F64).to(dtype)]),
    ],
    "alibi_flash_attention": [
        (lambda q, k, v: alibi_flash_attention(q, k, v, alibi_slopes(2)),
         lambda q, k, v: attention_reference(q, k, v, alibi_slopes(2)),
         functools.partial(_attention_inputs, 1, 2, 4, 4, 3)),
        (lambda q, k, v: alibi_flash_attention(q, k, v, alibi_slopes(3), scale=0.7, q_offset=3),
         lambda q, k, v: attention_reference(q, k, v, alibi_slopes(3), 0.7, 3),
         functools.partial(_attention_inputs, 2, 3, 2, 5, 2)),
    ],
    "alibi_attention": [
        (lambda q, k, v: alibi_attention(q, k, v, alibi_slopes(2)),
         lambda q, k, v: attention_reference(q, k, v, alibi_slopes(2), q_offset=2),
         functools.partial(_attention_inputs, 1, 2, 3, 5, 2)),
    ],
}


ALL_CASES = [
    pytest.param(*case, id=f"{name}-{i}")
    for name, cases in CASES.items()
    for i, case in enumerate(cases)
]


def second_derivatives(function, inputs, grad_out, direction):
    """The first gradients of ``sum(function(*inputs) * grad_out)`` (built with create_graph), and the
    gradients of ``sum(first * direction)`` with respect to every input and to ``grad_out``."""
    inputs = [t.detach().requires_grad_() for t in inputs]
    grad_out = grad_out.detach().requires_grad_()
    out = function(*inputs)
    first = torch.autograd.grad(out, inputs, grad_out.to(out.dtype), create_graph=True)
    objective = sum((g.to(F64) * d).sum() for g, d in zip(first, direction))
    second = torch.autograd.grad(objective, [*inputs, grad_out], allow_unused=True)
    return [g.detach() for g in first], [torch.zeros_like(t) if g is None else g for g, t in zip(second, [*inputs, grad_out])]


def assert_close(actual, expected, dtype, what):
    tolerance = TOLERANCE[dtype] * (1 + expected.abs().max())
    error = (actual.to(F64) - expected).abs().max()
    assert error <= tolerance, f"{what}: max |error| {error:.3g} > {tolerance:.3g}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op, reference, make", ALL_CASES)
def test_second_derivative_matches_the_float64_reference(op, reference, make, dtype):
    inputs = make(dtype)
    with torch.no_grad():
        shape = op(*inputs).shape
    grad_out = torch.randn(shape, dtype=F64).to(dtype).to(F64)  # as the operator receives it
    direction = [torch.randn(t.shape, dtype=F64) for t in inputs]
    first, second = second_derivatives(op, inputs, grad_out, direction)
    expected_first, expected_second = second_derivatives(reference, [t.to(F64) for t in inputs], grad_out, direction)
    for i, (a, e) in enumerate(zip(first, expected_first)):
        assert_close(a, e, dtype, f"first derivative {i}")
    assert any(e.abs().max() > 0 for e in expected_second)
    for i, (a, e) in enumerate(zip(second, expected_second)):
        assert_close(a, e, dtype, f"second derivative {i}")


@pytest.mark.parametrize("op, reference, make", ALL_CASES)
def test_gradgradcheck(op, reference, make):
    inputs = [t.requires_grad_() for t in make(torch.float64)]
    assert torch.autograd.gradgradcheck(op, inputs, fast_mode=True)


@pytest.mark.parametrize("op, reference, make", ALL_CASES)
def test_torch_func_reverse_mode_matches_the_reference(op, reference, make):
    inputs = make(torch.float64)
    weights = torch.randn(op(*inputs).shape, dtype=F64)

    def loss(function):
        return lambda *xs: (function(*xs) * weights).sum()

    argnums = tuple(range(len(inputs)))
    for got, want in zip(torch.func.grad(loss(op), argnums)(*inputs), torch.func.grad(loss(reference), argnums)(*inputs)):
        assert_close(got, want, F64, "torch.func.grad")
    _, vjp = torch.func.vjp(op, *inputs)
    _, vjp_reference = torch.func.vjp(reference, *inputs)
    for got, want in zip(vjp(weights), vjp_reference(weights)):
        assert_close(got, want, F64, "torch.func.vjp")
    assert_close(torch.func.jacrev(op)(*inputs), torch.func.jacrev(reference)(*inputs), F64, "torch.func.jacrev")
    hessian = torch.func.jacrev(torch.func.jacrev(loss(op)))(*inputs)
    assert_close(hessian, torch.func.jacrev(torch.func.jacrev(loss(reference)))(*inputs), F64, "jacrev(jacrev)")
    batch = [torch.stack([t, 2 * t]) for t in inputs]
    per_sample = torch.vmap(torch.func.grad(loss(op)))(*batch)
    assert_close(per_sample, torch.vmap(torch.func.grad(loss(reference)))(*batch), F64, "vmap(grad)")


@pytest.mark.parametrize("op, reference, make", ALL_CASES)
def test_forward_mode_ad_is_refused_naming_the_operator(op, reference, make):
    inputs = make(torch.float64)
    tangents = [torch.ones_like(t) for t in inputs]
    with pytest.raises(RuntimeError, match=r"ascendspeed::\w+ has no forward-mode derivative"):
        torch.func.jvp(op, tuple(inputs), tuple(tangents))
    with pytest.raises(RuntimeError, match="no forward-mode derivative"):
        torch.func.hessian(lambda *xs: op(*xs).sum())(*inputs)
    with torch.autograd.forward_ad.dual_level():
        duals = [torch.autograd.forward_ad.make_dual(t, d) for t, d in zip(inputs, tangents)]
        with pytest.raises(RuntimeError, match="no forward-mode derivative"):
            op(*duals)


def test_backward_operators_refuse_autograd_naming_themselves():
    x, weight = torch.randn(3, 8), torch.randn(8)
    _, rstd = torch.ops.ascendspeed.rms_norm(x, weight, 1e-5, False)
    grad_y = torch.randn(3, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="ascendspeed::rms_norm_backward does not support autograd"):
        torch.ops.ascendspeed.rms_norm_backward(grad_y, x, rstd, weight, False)
    q = torch.randn(1, 2, 4, 8)
    out, lse = torch.ops.ascendspeed.alibi_flash_attention(q, q, q, alibi_slopes(2), 0.5, 0)
    with pytest.raises(RuntimeError, match="ascendspeed::alibi_flash_attention_backward does not support autograd"):
        torch.ops.ascendspeed.alibi_flash_attention_backward(
            out.clone().requires_grad_(), q, q, q, out, lse, alibi_slopes(2), 0.5, 0
        )
    with pytest.raises(RuntimeError, match="ascendspeed::bias_gelu_backward does not support autograd"):
        torch.ops.ascendspeed.bias_gelu_backward(grad_y, x, weight)
    with torch.no_grad():
        torch.ops.ascendspeed.rms_norm_backward(grad_y, x, rstd, weight, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape, q_offset", [((1, 2, 5, 5, 8), 0), ((2, 3, 3, 7, 4), 4), ((1, 5, 1, 9, 16), 8)])
def test_slopes_that_require_grad_get_the_reference_gradient(shape, q_offset, dtype):
    b, h, sq, sk, d = shape
    q, k, v = (t.requires_grad_() for t in _attention_inputs(b, h, sq, sk, d, dtype))
    slopes = (alibi_slopes(h) * (1 + torch.rand(h))).requires_grad_()
    grad_out = torch.randn(b, h, sq, d, dtype=F64).to(dtype).to(F64)  # as the operator receives it
    out = alibi_flash_attention(q, k, v, slopes, q_offset=q_offset)
    out.backward(grad_out.to(dtype))
    leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v, slopes)]
    attention_reference(*leaves, q_offset=q_offset).backward(grad_out)
    for name, got, want in zip(("query", "key", "value", "slopes"), (q, k, v, slopes), leaves):
        assert got.grad is not None and got.grad.dtype == got.dtype, name
        assert_close(got.grad, want.grad, got.dtype, f"grad {name}")
    assert slopes.grad.abs().max() > 0


def test_slopes_gradient_through_alibi_attention_agrees_on_both_paths():
    """The flash path (causal) and the materialised path (a mask) give the slopes the same gradient."""
    q, k, v = _attention_inputs(1, 2, 4, 4, 8, torch.float32)
    grads = []
    for masked_out in (None, torch.zeros(4, 4, dtype=torch.bool)):
        slopes = alibi_slopes(2).requires_grad_()
        alibi_attention(q, k, v, slopes, masked_out=masked_out).sum().backward()
        grads.append(slopes.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_gradgradcheck_with_slopes():
    q, k, v = (t.requires_grad_() for t in _attention_inputs(1, 2, 3, 4, 4, F64))
    slopes = alibi_slopes(2)
    assert torch.autograd.gradgradcheck(lambda q, k, v: alibi_flash_attention(q, k, v, slopes, q_offset=1), (q, k, v),
                                         fast_mode=True)
    assert torch.autograd.gradcheck(
        lambda s: alibi_flash_attention(q.detach(), k.detach(), v.detach(), s.float(), q_offset=1),
        (alibi_slopes(2).double().requires_grad_(),), eps=1e-3, atol=1e-3,
    )


@pytest.mark.parametrize("function", [alibi_flash_attention, alibi_attention])
def test_head_dim_zero_is_a_value_error_naming_query(function):
    q = torch.randn(1, 2, 4, 0)
    with pytest.raises(ValueError, match=r"query has head_dim 0 \(query.size\(-1\)"):
        function(q, q, q, alibi_slopes(2))


@pytest.mark.parametrize("function", [alibi_flash_attention, alibi_attention])
@pytest.mark.parametrize("q_offset", [2.5, 2.0, True, "2"])
def test_q_offset_must_be_an_int(function, q_offset):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match="q_offset must be an int"):
        function(q, q, q, alibi_slopes(2), q_offset=q_offset)


EMPTY = [
    ("rms_norm batch 0", lambda: [torch.randn(0, 8), torch.randn(8)], lambda x, w: rms_norm(x, w)),
    ("rms_norm rows 0", lambda: [torch.randn(2, 0, 8), torch.randn(8)], lambda x, w: rms_norm(x, w)),
    ("swiglu rows 0", lambda: [torch.randn(0, 8)], swiglu),
    ("bias_gelu rows 0", lambda: [torch.randn(0, 8), torch.randn(8)], bias_gelu),
    ("weighted_swiglu rows 0", lambda: [torch.randn(0, 8), torch.rand(0, 1)], weighted_swiglu),
    ("rotary seq 0", lambda: [torch.randn(0, 2, 3, 8)], lambda t: rotary_embedding(t, torch.randn(0, 1, 1, 8))),
    ("rotary heads 0", lambda: [torch.randn(4, 2, 0, 8)], lambda t: rotary_embedding(t, torch.randn(4, 1, 1, 8))),
    ("attention batch 0", lambda: _attention_inputs(0, 2, 3, 3, 8, torch.float32),
     lambda q, k, v: alibi_flash_attention(q, k, v, alibi_slopes(2))),
    ("attention heads 0", lambda: _attention_inputs(1, 0, 3, 3, 8, torch.float32),
     lambda q, k, v: alibi_flash_attention(q, k, v, torch.empty(0))),
    ("attention queries 0", lambda: _attention_inputs(1, 2, 0, 3, 8, torch.float32),
     lambda q, k, v: alibi_flash_attention(q, k, v, alibi_slopes(2), q_offset=3)),
]


@pytest.mark.parametrize("what, make, op", EMPTY, ids=[case[0] for case in EMPTY])
def test_empty_inputs_give_empty_results_and_gradients_to_second_order(what, make, op):
    inputs = [t.requires_grad_() for t in make()]
    out = op(*inputs)
    assert out.numel() == 0
    first = torch.autograd.grad(out, inputs, torch.ones_like(out), create_graph=True, allow_unused=True)
    for g, t in zip(first, inputs):
        assert g is None or (g.shape == t.shape and not g.abs().sum())
