"""The fused SwiGLU operator against a float64 reference, forward and backward.

Inputs are fresh random draws each run. Tolerances are derived per element from the output dtype:
one rounding of the exact value to the output dtype, plus a few fp32 ulps of the magnitude of the
terms that are summed (the gate derivative s + silu(a) * (1 - s) cancels near a = -1.28, so its
error is relative to the terms, not to the result).
"""
import textwrap

import pytest
import torch

from tests.helpers.isa import check_under_isa

from ascendspeed.ops import swiglu, weighted_swiglu
from ascendspeed.ops.swiglu import (
    NPU_KERNELS,
    _reference_swiglu_backward_kernel,
    _reference_swiglu_kernel,
    _reference_weighted_swiglu_backward_kernel,
    _reference_weighted_swiglu_kernel,
    swiglu_reference,
    weighted_swiglu_reference,
)

pytestmark = pytest.mark.megatron_independent  # one release covers it: .ci/run runs it on the newest only

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 2.0**-53}
SUBNORMAL_HALF_ULP = {torch.float32: 2.0**-150, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25, torch.float64: 0.0}
FP32_EPS = 2.0**-23

# 1-D to 4-D, odd sizes, size 2 along the split, and sizes past the parallel grain (32768 outputs)
# whose thread boundaries fall inside a row.
SHAPES = [
    (2,),
    (30,),
    (1, 2),
    (7, 10),
    (5, 3, 8),
    (3, 2, 34),
    (2, 3, 4, 6),
    (6, 1, 2, 2),
    (3, 2 * 20001),
    (1, 4, 2 * 8195),
]


def reference(x, dim, grad_y=None):
    """Float64 forward (or backward, given grad_y) of the rounded inputs, with the magnitude of the
    terms each result is made of and the absolute slack left by a sigmoid that underflows the
    smallest normal number of the kernel's math type (for a < -87 in fp32, as in torch's own silu)."""
    a, b = torch.chunk(x.double(), 2, dim)
    tiny = torch.finfo(torch.promote_types(x.dtype, torch.float32)).tiny
    s = torch.sigmoid(a)
    silu = a * s
    if grad_y is None:
        y = silu * b
        return y, y.abs(), tiny * (a * b).abs()
    g = grad_y.double()
    da = g * b * (s + silu * (1 - s))
    db = g * silu
    da_terms = (g * b).abs() * (s + silu.abs() * (1 - s))
    slack = tiny * torch.cat(((g * b).abs() * (1 + a.abs()), (g * a).abs()), dim)
    return torch.cat((da, db), dim), torch.cat((da_terms, db.abs()), dim), slack


def assert_matches(actual, expected, magnitude, slack, dtype, what=""):
    assert actual.dtype == dtype and actual.shape == expected.shape
    tolerance = (
        HALF_ULP[dtype] * 1.01 * expected.abs()
        + 64 * FP32_EPS * magnitude
        + 2 * slack
        + SUBNORMAL_HALF_ULP[dtype]
    )
    error = (actual.double() - expected).abs()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    worst = int(torch.argmax(error - tolerance))
    assert (error <= tolerance).all(), (
        f"{what}: |error| {error.flatten()[worst]:.3g} > tolerance {tolerance.flatten()[worst]:.3g} "
        f"at flat index {worst} (expected {expected.flatten()[worst]:.6g})"
    )


def draw(shape, dtype, scale=4.0):
    return (torch.randn(shape) * scale).to(dtype)


def split_dims(shape):
    """Every dimension of even size, once as a positive and once as a negative index."""
    dims = [d for d, size in enumerate(shape) if size % 2 == 0]
    return dims + [d - len(shape) for d in dims]


def check_forward_backward(x, dim, grad_y=None):
    dtype = x.dtype
    leaf = x.detach().requires_grad_()
    y = swiglu(leaf, dim)
    expected, magnitude, slack = reference(x, dim)
    assert_matches(y, expected, magnitude, slack, dtype, f"forward {tuple(x.shape)} dim={dim}")
    if grad_y is None:
        grad_y = draw(y.shape, dtype, 1.0)
    y.backward(grad_y)
    expected, magnitude, slack = reference(x, dim, grad_y)
    assert_matches(leaf.grad, expected, magnitude, slack, dtype, f"backward {tuple(x.shape)} dim={dim}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_shape_dim_and_dtype(shape, dtype):
    for dim in split_dims(shape):
        check_forward_backward(draw(shape, dtype), dim)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
def test_large_magnitudes_stay_finite(dtype):
    """|x| up to 30 everywhere; fp32/fp64 also at 1e4, where exp(-a) overflows to inf."""
    x = torch.empty(64, 2 * 257).uniform_(-30, 30)
    x[0, :8] = torch.tensor([30.0, -30.0, 20.0, -20.0, 0.0, -0.0, 1e-3, -1.2785])
    if dtype in (torch.float32, torch.float64):
        x[1, :6] = torch.tensor([1e4, -1e4, 88.8, -88.8, 104.0, -104.0])
    check_forward_backward(x.to(dtype), -1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs(dtype):
    base = draw((6, 8, 10), dtype)
    cases = {
        "transposed": base.transpose(0, 2),  # dense: read in memory order, not copied
        "permuted": base.permute(1, 2, 0),
        "channels_last": draw((2, 6, 4, 8), dtype).to(memory_format=torch.channels_last),
        "strided slice": draw((6, 16), dtype)[:, ::2],  # not dense: copied once
        "expanded": draw((1, 8), dtype).expand(5, 8),
        "offset view": base.reshape(-1)[8:].view(59, 8),
    }
    for name, x in cases.items():
        for dim in split_dims(x.shape):
            y_shape = list(x.shape)
            y_shape[dim] //= 2
            grad_y = draw(y_shape[::-1], dtype, 1.0).permute(*reversed(range(len(y_shape))))
            check_forward_backward(x, dim, grad_y)


def test_dense_inputs_keep_their_memory_order():
    """A transposed or channels-last input is not copied: the outputs follow its memory order."""
    x = draw((2, 6, 4, 8), torch.float32).to(memory_format=torch.channels_last).requires_grad_()
    y = swiglu(x, 1)
    assert y.is_contiguous(memory_format=torch.channels_last)
    y.backward(torch.randn_like(y))
    assert x.grad.is_contiguous(memory_format=torch.channels_last)
    t = draw((10, 4), torch.float32).t()
    assert swiglu(t, 1).stride() == (1, 4)


def test_python_kernels_match_the_cpu_kernel():
    """The CUDA/NPU path (reference composition in the memory order of x) agrees in values and layout."""
    for x, dim in [(draw((5, 8), torch.bfloat16), -1), (draw((6, 4, 8), torch.float32).transpose(0, 2), 2)]:
        y = _reference_swiglu_kernel(x, dim)
        expected, magnitude, slack = reference(x, dim)
        assert_matches(y, expected, magnitude, slack, x.dtype, "reference kernel forward")
        assert y.stride() == swiglu(x, dim).stride()
        grad_y = torch.randn_like(y)
        dx = _reference_swiglu_backward_kernel(grad_y, x, dim)
        expected, magnitude, slack = reference(x, dim, grad_y)
        assert_matches(dx, expected, magnitude, slack, x.dtype, "reference kernel backward")
        assert dx.stride() == torch.ops.ascendspeed.swiglu_backward(grad_y, x, dim).stride()


def test_matches_megatron_composition_in_fp32():
    x = torch.randn(4, 3, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    torch.testing.assert_close(swiglu(x), swiglu_reference(x_ref), rtol=1e-6, atol=1e-7)
    grad = torch.randn(4, 3, 32)
    swiglu(x).backward(grad)
    swiglu_reference(x_ref).backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)


def test_many_threads_split_rows_correctly():
    threads = torch.get_num_threads()
    torch.set_num_threads(5)
    try:
        check_forward_backward(draw((7, 2 * 30011), torch.float32), -1)
        check_forward_backward(draw((3, 2, 30011), torch.bfloat16), 1)
    finally:
        torch.set_num_threads(threads)


def test_outputs_big_enough_for_huge_pages():
    """Outputs of 32 MiB and more are advised onto huge pages before the kernel first touches them."""
    x = torch.randn(2, 2 * (2**22 + 8), requires_grad=True)
    y = swiglu(x)
    assert y.untyped_storage().nbytes() >= 32 << 20
    grad = torch.randn_like(y)
    y.backward(grad)
    expected = x.detach().clone().requires_grad_()
    reference_y = swiglu_reference(expected)
    reference_y.backward(grad)
    torch.testing.assert_close(y, reference_y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, expected.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape, dim", [((3, 8), 1), ((4, 3, 2), 0), ((2, 6, 3), -2), ((6,), 0)])
def test_gradcheck_float64(shape, dim):
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: swiglu(t, dim), (x,))
    assert torch.autograd.gradgradcheck(lambda t: swiglu(t, dim), (x,))


def test_saves_only_its_input_for_backward():
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    x = torch.randn(8, 16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = swiglu(x)
    assert len(saved) == 1
    assert saved[0].data_ptr() == x.data_ptr() and saved[0].shape == x.shape
    y.sum().backward()


def test_torch_compile_fullgraph():
    def block(x, w):
        return (swiglu(x @ w, -1) * 2).sum(dim=0)

    compiled = torch.compile(block, fullgraph=True)
    for x in (torch.randn(5, 12), torch.randn(12, 5).t()):
        w = torch.randn(12, 8)
        x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
        x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
        out, expected = compiled(x1, w1), block(x2, w2)
        torch.testing.assert_close(out, expected)
        grad = torch.randn_like(out)
        out.backward(grad)
        expected.backward(grad)
        torch.testing.assert_close(x1.grad, x2.grad)
        torch.testing.assert_close(w1.grad, w2.grad)


def test_opcheck():
    """torch.library's own consistency checks: schema, fake kernel strides, autograd registration."""
    for args in [(torch.randn(4, 6, requires_grad=True), -1), (torch.randn(4, 6, 8).transpose(0, 2), 0)]:
        torch.library.opcheck(torch.ops.ascendspeed.swiglu.default, args)
    x, g = torch.randn(4, 6), torch.randn(4, 3)
    torch.library.opcheck(torch.ops.ascendspeed.swiglu_backward.default, (g, x, -1))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_bad_inputs_name_the_argument(device):
    with pytest.raises(ValueError, match=r"x.size\(dim\) must be even.*x.size\(1\) = 5"):
        swiglu(torch.randn(4, 5, device=device), 1)
    with pytest.raises(TypeError, match="x must be float32, bfloat16, float16 or float64, got .*(Long|int64)"):
        swiglu(torch.ones(4, 6, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match="x must be float32"):
        swiglu(torch.ones(4, 6, dtype=torch.complex64, device=device))
    with pytest.raises(IndexError, match=r"dim=2 is out of range for x with 2 dimension"):
        swiglu(torch.randn(4, 6, device=device), 2)
    with pytest.raises(IndexError, match=r"dim=-3 is out of range"):
        swiglu(torch.randn(4, 6, device=device), -3)
    with pytest.raises(ValueError, match="x must have at least one dimension, got a 0-d tensor"):
        swiglu(torch.tensor(1.0, device=device))
    x = torch.randn(4, 6, device=device)
    with pytest.raises(ValueError, match="grad_y must have the shape of swiglu"):
        torch.ops.ascendspeed.swiglu_backward(torch.randn(4, 6, device=device), x, -1)
    with pytest.raises(TypeError, match="grad_y must have the dtype of x"):
        torch.ops.ascendspeed.swiglu_backward(torch.randn(4, 3, dtype=torch.float64, device=device), x, -1)


def test_meta_tensors_give_shapes():
    y = swiglu(torch.empty(3, 8, 5, device="meta"), 1)
    assert y.shape == (3, 4, 5) and y.device.type == "meta"


@pytest.mark.parametrize("shape, dim", [((0, 4), 1), ((4, 0), 0), ((0,), 0), ((2, 0, 6), -1)])
def test_empty_inputs(shape, dim):
    x = torch.randn(shape, requires_grad=True)
    y = swiglu(x, dim)
    expected_shape = list(shape)
    expected_shape[dim] //= 2
    assert list(y.shape) == expected_shape and y.numel() == 0
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_device_kernels_registered():
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    for op in ("ascendspeed::swiglu", "ascendspeed::swiglu_backward", "ascendspeed::weighted_swiglu",
               "ascendspeed::weighted_swiglu_backward"):
        assert has_kernel(op, "CPU") and has_kernel(op, "CUDA")
        assert has_kernel(op, "PrivateUse1") == NPU_KERNELS


def test_kernels_are_multi_threaded():
    """at::parallel_for only uses torch's OpenMP threads if ascendspeed._C is compiled with -fopenmp."""
    kernel = torch.ops.ascendspeed._swiglu_cpu_kernel()
    assert "multi-threaded" in kernel, f"{kernel}: add -fopenmp to the extension's compile and link flags"


# -- weighted_swiglu: the experts' SwiGLU scaled by routing probabilities -----------------------------------
# (x shape, weights dtype or None for the dtype of x); rows past the parallel grain, long and short rows.
WEIGHTED_SHAPES = [
    ((1, 2), None),
    ((7, 10), torch.float32),
    ((5, 3, 8), None),
    ((64, 2 * 257), torch.float32),
    ((3, 2 * 20001), torch.float32),
    ((4000, 2 * 24), torch.float32),
    ((9, 2 * 33), torch.float64),
]


def weighted_reference(x, weights, grad_y=None):
    """Float64 forward, or backward given grad_y, as in ``reference``; the backward also returns the
    weights' gradient and the sum of the magnitudes of its terms."""
    a, b = torch.chunk(x.double(), 2, -1)
    w = weights.double()
    tiny = torch.finfo(torch.promote_types(x.dtype, torch.float32)).tiny
    s = torch.sigmoid(a)
    silu = a * s
    if grad_y is None:
        y = silu * b * w
        return y, y.abs(), tiny * (a * b * w).abs()
    g = grad_y.double()
    gw = g * w
    grad_x = torch.cat((gw * b * (s + silu * (1 - s)), gw * silu), -1)
    magnitude = torch.cat(((gw * b).abs() * (s + silu.abs() * (1 - s)), (gw * silu).abs()), -1)
    slack = tiny * torch.cat(((gw * b).abs() * (1 + a.abs()), (gw * a).abs()), -1)
    terms = g * silu * b
    return (grad_x, magnitude, slack), (terms.sum(-1, keepdim=True), terms.abs().sum(-1, keepdim=True))


def check_weighted(x, weights, grad_y=None):
    leaf, w = x.detach().requires_grad_(), weights.detach().requires_grad_()
    y = weighted_swiglu(leaf, w)
    expected, magnitude, slack = weighted_reference(x, weights)
    what = f"{tuple(x.shape)} {x.dtype} weights {weights.dtype}"
    assert_matches(y, expected, magnitude, slack, x.dtype, f"weighted forward {what}")
    if grad_y is None:
        grad_y = draw(y.shape, x.dtype, 1.0)
    y.backward(grad_y)
    (expected, magnitude, slack), (grad_w, terms) = weighted_reference(x, weights, grad_y)
    assert_matches(leaf.grad, expected, magnitude, slack, x.dtype, f"weighted backward x {what}")
    # one rounding to the dtype of weights, plus an fp32 sum of len terms
    tolerance = HALF_ULP[weights.dtype] * 1.01 * grad_w.abs() + (x.shape[-1] + 64) * FP32_EPS * terms + 1e-30
    assert w.grad.dtype == weights.dtype and w.grad.shape == weights.shape
    error = (w.grad.double() - grad_w).abs()
    assert (error <= tolerance).all(), f"weighted backward weights {what}: {(error - tolerance).max():.3g} over"


def draw_weights(x_shape, dtype):
    return torch.rand(*x_shape[:-1], 1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("shape, weights_dtype", WEIGHTED_SHAPES, ids=str)
def test_weighted_matches_the_float64_reference(shape, weights_dtype, dtype):
    if weights_dtype is torch.float64 and dtype is not torch.float64:
        weights_dtype = torch.float32
    check_weighted(draw(shape, dtype), draw_weights(shape, weights_dtype or dtype))


def test_weighted_non_contiguous_inputs_and_large_magnitudes():
    x = draw((8, 2 * 40), torch.bfloat16)[:, ::2]  # not dense: copied once
    check_weighted(x, draw_weights(x.shape, torch.float32))
    x = torch.empty(6, 2 * 129).uniform_(-30, 30)
    x[0, :4] = torch.tensor([1e4, -1e4, 88.8, -104.0])
    weights = torch.rand(1, 6).t()  # a transposed column
    check_weighted(x, weights, draw((6, 129), torch.float32, 1.0).t().contiguous().t())


def test_weighted_rows_split_over_many_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(5)
    try:
        for shape in [(7, 2 * 30011), (3001, 2 * 16)]:
            check_weighted(draw(shape, torch.float32), draw_weights(shape, torch.float32))
    finally:
        torch.set_num_threads(threads)


def test_weighted_gradient_of_the_weights_does_not_depend_on_the_thread_count():
    x, weights = draw((257, 2 * 300), torch.bfloat16), draw_weights((257, 2 * 300), torch.float32)
    grad_y = draw((257, 300), torch.bfloat16, 1.0)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            results.append(torch.ops.ascendspeed.weighted_swiglu_backward(grad_y, x, weights))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_weighted_equals_swiglu_times_weights_in_fp32():
    """Megatron's composition (``swiglu(x) * weights``) in fp32, where rounding order barely matters."""
    x = torch.randn(40, 64, requires_grad=True)
    w = torch.rand(40, 1, requires_grad=True)
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y, expected = weighted_swiglu(x, w), swiglu_reference(x_ref) * w_ref
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-7)
    grad = torch.randn_like(y)
    y.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-5)


def test_weighted_python_kernels_match_the_cpu_kernel():
    """The CUDA / NPU path (the composition) agrees with the float64 reference and the C++ kernel."""
    x, weights = draw((9, 12), torch.bfloat16), draw_weights((9, 12), torch.float32)
    y = _reference_weighted_swiglu_kernel(x, weights)
    expected, magnitude, slack = weighted_reference(x, weights)
    assert_matches(y, expected, magnitude, slack, x.dtype, "reference kernel forward")
    grad_y = draw(y.shape, x.dtype, 1.0)
    grad_x, grad_w = _reference_weighted_swiglu_backward_kernel(grad_y, x, weights)
    (expected, magnitude, slack), (expected_w, terms) = weighted_reference(x, weights, grad_y)
    assert_matches(grad_x, expected, magnitude, slack, x.dtype, "reference kernel backward")
    torch.testing.assert_close(grad_w.double(), expected_w, rtol=1e-5, atol=1e-6)
    cpu_x, cpu_w = torch.ops.ascendspeed.weighted_swiglu_backward(grad_y, x, weights)
    assert cpu_x.shape == grad_x.shape and cpu_w.shape == grad_w.shape and cpu_w.dtype == grad_w.dtype


def test_weighted_gradcheck_and_gradgradcheck_float64():
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.rand(5, 1, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(weighted_swiglu, (x, w))
    assert torch.autograd.gradgradcheck(weighted_swiglu, (x, w))


def test_weighted_opcheck():
    x, w = torch.randn(6, 8, requires_grad=True), torch.rand(6, 1, requires_grad=True)
    torch.library.opcheck(torch.ops.ascendspeed.weighted_swiglu.default, (x, w))
    torch.library.opcheck(torch.ops.ascendspeed.weighted_swiglu.default,
                          (torch.randn(2, 3, 8, dtype=torch.bfloat16), torch.rand(2, 3, 1)))
    g = torch.randn(6, 4)
    torch.library.opcheck(torch.ops.ascendspeed.weighted_swiglu_backward.default, (g, x.detach(), w.detach()))


def test_weighted_torch_compile_fullgraph():
    def expert(x, w1, p):
        return weighted_swiglu(x @ w1, p).sum(dim=0)

    compiled = torch.compile(expert, fullgraph=True)
    x, w1, p = torch.randn(7, 12), torch.randn(12, 8), torch.rand(7, 1)
    leaves = [[t.clone().requires_grad_() for t in (x, w1, p)] for _ in range(2)]
    out, expected = compiled(*leaves[0]), expert(*leaves[1])
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    for got, want in zip(*leaves):
        torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_weighted_bad_inputs_name_the_argument(device):
    x = torch.randn(4, 6, device=device)
    with pytest.raises(ValueError, match=r"weights must have shape x.shape\[:-1\] \+ \(1,\) = \[4, 1\].*got \[4\]"):
        weighted_swiglu(x, torch.rand(4, device=device))
    with pytest.raises(ValueError, match=r"weights must have shape .*got \[2, 1\]"):
        weighted_swiglu(x, torch.rand(2, 1, device=device))
    with pytest.raises(TypeError, match="weights must be float32, bfloat16, float16 or float64, got .*(Long|int64)"):
        weighted_swiglu(x, torch.ones(4, 1, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match=r"x.size\(dim\) must be even"):
        weighted_swiglu(torch.randn(4, 5, device=device), torch.rand(4, 1, device=device))
    with pytest.raises(ValueError, match="x must have at least one dimension"):
        weighted_swiglu(torch.tensor(1.0, device=device), torch.rand(1, device=device))
    with pytest.raises(ValueError, match="grad_y must have the shape of swiglu"):
        torch.ops.ascendspeed.weighted_swiglu_backward(torch.randn(4, 6, device=device), x,
                                                       torch.rand(4, 1, device=device))
    if device == "cpu":
        with pytest.raises(ValueError, match="weights must be on the device of x"):
            weighted_swiglu(x, torch.rand(4, 1, device="meta"))


@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (2, 0, 4)])
def test_weighted_empty_inputs(shape):
    x = torch.randn(shape, requires_grad=True)
    w = torch.rand(*shape[:-1], 1, requires_grad=True)
    y = weighted_swiglu(x, w)
    assert y.shape == (*shape[:-1], shape[-1] // 2)
    y.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape and not w.grad.abs().sum()


ISA_CHECK = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from ops.test_swiglu import DTYPES, check_forward_backward, check_weighted, draw, draw_weights
    isa = torch.ops.ascendspeed._swiglu_cpu_kernel().split(",")[0]
    if isa != {isa!r}:
        print("unsupported", isa)
        raise SystemExit(0)
    for dtype in DTYPES + [torch.float64]:
        for shape, dim in [((3, 2 * 1001), -1), ((5, 6, 7), 1), ((4, 6, 40), 0)]:
            check_forward_backward(draw(shape, dtype), dim)
        for shape in [(3, 2 * 1001), (5, 6, 38)]:
            check_weighted(draw(shape, dtype), draw_weights(shape, torch.float64 if dtype is torch.float64
                                                            else torch.float32))
    print("ok", isa)
    """
)


@pytest.mark.parametrize("isa", ["DEFAULT", "AVX2"])
def test_narrower_instruction_sets(isa):
    """The kernels built for older CPUs are correct too (torch picks them via ATEN_CPU_CAPABILITY)."""
    check_under_isa(ISA_CHECK, isa)
