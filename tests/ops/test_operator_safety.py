"""The operators called directly with what torch's own operators refuse: overlapping in-place targets,
views of leaves, out-of-range or mistyped scalars, tensors on different devices (issue 12 items 12, 14,
15), and the one-registration-style contract: the argument checks live in C++ and also guard the Meta
kernels that FakeTensor and torch.compile use.
"""
import pytest
import torch

from ascendspeed.ops.alibi import _alibi_bias_reference, alibi_bias_, alibi_slopes
from ascendspeed.ops.swiglu import _reference_swiglu_backward_kernel, swiglu

pytestmark = pytest.mark.megatron_independent  # one release covers it: .ci/run runs it on the newest only

has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key


def test_every_operator_has_a_cpp_meta_kernel_and_no_python_fake():
    for op in ("ascendspeed::swiglu", "ascendspeed::swiglu_backward", "ascendspeed::alibi_bias_"):
        assert has_kernel(op, "CPU") and has_kernel(op, "Meta") and has_kernel(op, "CUDA"), op
        assert not torch._library.simple_registry.singleton.find(op).fake_impl.kernel, f"{op}: Python fake kernel"


# -- swiglu ------------------------------------------------------------------------------------------------
def test_swiglu_backward_refuses_grad_on_another_device():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match=r"grad_y must be on the device of x \(cpu\), got meta"):
        torch.ops.ascendspeed.swiglu_backward(torch.randn(4, 3, device="meta"), x, -1)
    with pytest.raises(ValueError, match=r"grad_y must be on the device of x \(meta\), got cpu"):
        torch.ops.ascendspeed.swiglu_backward(torch.randn(4, 3), torch.randn(4, 6, device="meta"), -1)


def test_swiglu_python_kernels_check_through_the_meta_kernel():
    with pytest.raises(ValueError, match="grad_y must have the shape of swiglu"):
        _reference_swiglu_backward_kernel(torch.randn(4, 6), torch.randn(4, 6), -1)
    with pytest.raises(IndexError, match="dim=2 is out of range"):
        _reference_swiglu_backward_kernel(torch.randn(4, 3), torch.randn(4, 6), 2)


def test_swiglu_compiles_with_dynamic_shapes():
    compiled = torch.compile(lambda x: swiglu(x, -1) * 2, fullgraph=True, dynamic=True)
    for rows, width in ((3, 8), (5, 12), (7, 2)):
        x = torch.randn(rows, width, requires_grad=True)
        expected = torch.nn.functional.silu(x[:, : width // 2]) * x[:, width // 2:] * 2
        torch.testing.assert_close(compiled(x), expected)
        grad = torch.randn(rows, width // 2)
        (actual_grad,) = torch.autograd.grad(compiled(x), x, grad)
        (expected_grad,) = torch.autograd.grad(expected, x, grad)
        torch.testing.assert_close(actual_grad, expected_grad)


# -- alibi_bias_ ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("expanded", [
    lambda: torch.zeros(1, 4, 8, 8).expand(3, 4, 8, 8),   # over batch
    lambda: torch.zeros(2, 1, 8, 8).expand(2, 4, 8, 8),   # over heads
    lambda: torch.zeros(4, 1, 8).expand(4, 8, 8),        # over query rows
], ids=["batch", "heads", "rows"])
def test_alibi_bias_refuses_overlapping_scores_like_add_(expanded):
    scores = expanded()
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        scores.add_(1.0)  # torch's own in-place rule
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        alibi_bias_(scores, alibi_slopes(4))
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        _alibi_bias_reference(scores, alibi_slopes(4), 0, False)  # the CUDA kernel, through the Meta check
    assert not scores.any()


def test_alibi_bias_refuses_a_view_of_a_leaf_that_requires_grad():
    leaf = torch.zeros(2, 4, 8, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="a view of a leaf"):
        leaf[0].add_(1.0)  # torch's own rule
    with pytest.raises(RuntimeError, match="view of a leaf tensor that requires grad"):
        alibi_bias_(leaf[0], alibi_slopes(4))
    assert not leaf.detach().any()
    with torch.no_grad():  # as for add_, allowed where autograd is off
        alibi_bias_(leaf[0], alibi_slopes(4))
    assert leaf.detach()[0].any()


@pytest.mark.parametrize("q_offset", [-2**63, 2**63 - 1, 2**24, -2**24, 2**24 - 8])
def test_alibi_bias_refuses_positions_beyond_exact_fp32(q_offset):
    scores = torch.zeros(1, 4, 8, 8)
    with pytest.raises(ValueError, match=f"q_offset={q_offset}, sq=8, sk=8"):
        alibi_bias_(scores, alibi_slopes(4), q_offset)
    assert not scores.any()
    alibi_bias_(scores, alibi_slopes(4), 2**24 - 9)  # the last exact query block


@pytest.mark.parametrize("q_offset", [2.0, 2.5, True, "2"])
def test_alibi_bias_refuses_a_q_offset_that_is_not_an_int(q_offset):
    with pytest.raises(TypeError, match="alibi_bias_: q_offset must be an int, got"):
        alibi_bias_(torch.zeros(1, 4, 8, 8), alibi_slopes(4), q_offset)


def test_alibi_bias_refuses_slopes_on_another_device():
    with pytest.raises(ValueError, match=r"slopes must be on the device of scores \(cpu\), got meta"):
        alibi_bias_(torch.zeros(1, 4, 8, 8), alibi_slopes(4).to("meta"))
    with pytest.raises(ValueError, match=r"slopes must be on the device of scores \(meta\), got cpu"):
        alibi_bias_(torch.zeros(1, 4, 8, 8, device="meta"), alibi_slopes(4))


def test_alibi_bias_checks_meta_tensors_and_integer_scores():
    with pytest.raises(ValueError, match="one slope per head"):
        alibi_bias_(torch.zeros(1, 4, 8, 8, device="meta"), alibi_slopes(3).to("meta"))
    alibi_bias_(torch.zeros(1, 4, 8, 8, device="meta"), alibi_slopes(4).to("meta"))
    with pytest.raises(TypeError, match="scores must be float32, bfloat16, float16 or float64, got Long"):
        alibi_bias_(torch.zeros(1, 4, 8, 8, dtype=torch.long), alibi_slopes(4))


def test_alibi_bias_compiles_in_a_full_graph():
    slopes = alibi_slopes(4)

    def attention_probs(q, k):
        scores = q @ k.transpose(-1, -2) * q.size(-1) ** -0.5
        alibi_bias_(scores, slopes)
        return torch.softmax(scores, -1)

    compiled = torch.compile(attention_probs, fullgraph=True)
    q, k = torch.randn(2, 4, 8, 16, requires_grad=True), torch.randn(2, 4, 8, 16)
    torch.testing.assert_close(compiled(q, k), attention_probs(q, k))
    grad = torch.randn(2, 4, 8, 8)
    (actual,) = torch.autograd.grad(compiled(q, k), q, grad)
    (expected,) = torch.autograd.grad(attention_probs(q, k), q, grad)
    torch.testing.assert_close(actual, expected)


# -- alibi_slopes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_heads", [True, 2.5, 4.0, "4", None])
def test_alibi_slopes_refuses_a_head_count_that_is_not_an_int(num_heads):
    with pytest.raises(TypeError, match="alibi_slopes: num_heads must be an int, got"):
        alibi_slopes(num_heads)


def test_alibi_slopes_takes_integer_like_counts():
    assert torch.equal(alibi_slopes(torch.tensor(4)), alibi_slopes(4))
