"""The fused RMSNorm operator against a float64 reference, forward and backward, and against
megatron-core's own RMSNorm (``WrappedTorchNorm``, i.e. ``torch.nn.RMSNorm``).

Inputs are fresh random draws each run. Tolerances are per element: one rounding of the exact value to
the output dtype, plus a few fp32 ulps of the magnitude of the terms each result is made of (the row
sums behind rstd and the weight gradient are accumulated in fp32).
"""
import math
import textwrap

import pytest
import torch

from tests.helpers.isa import assert_vectorized_and_multi_threaded, check_under_isa
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig

from ascendspeed.ops import rms_norm
from ascendspeed.ops.rms_norm import NPU_KERNELS, _composite_backward, _composite_forward, rms_norm_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 2.0**-53}
SUBNORMAL_HALF_ULP = {torch.float32: 2.0**-150, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25, torch.float64: 0.0}
FP32_EPS = 2.0**-23

# 1-D to 4-D, odd row lengths (vector tails), one-element rows, and sizes past the parallel grain.
SHAPES = [(1,), (7,), (3, 5), (4, 33), (2, 3, 64), (5, 1001), (2, 2, 3, 17), (3, 1), (37, 4096)]


def draw(shape, dtype, scale=1.0):
    return (torch.randn(shape, dtype=torch.float64) * scale).to(dtype)


def reference(x, weight, eps, zero_centered_gamma, grad_y):
    """Float64 forward and backward of the rounded inputs, and the magnitudes of the terms summed."""
    x64, g64 = x.double(), grad_y.double()
    gamma = weight.double() + (1 if zero_centered_gamma else 0)
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    y = x64 * rstd * gamma
    gw = g64 * gamma
    correction = rstd**3 * (gw * x64).mean(-1, keepdim=True)
    grad_x = rstd * gw - x64 * correction
    rows = x64.reshape(-1, x.size(-1))
    grad_weight = (g64 * x64 * rstd).reshape(-1, x.size(-1)).sum(0)
    grad_x_terms = (rstd * gw).abs() + (x64 * rstd**3 * (gw * x64).abs().mean(-1, keepdim=True)).abs()
    grad_weight_terms = (g64 * x64 * rstd).abs().reshape(-1, x.size(-1)).sum(0)
    return (y, y.abs()), (grad_x, grad_x_terms), (grad_weight, grad_weight_terms), rows.shape[0]


def assert_matches(actual, expected, magnitude, dtype, what, terms_summed=1):
    assert actual.dtype == dtype and actual.shape == expected.shape, what
    # fp32 sums of `cols` squares (rstd) and of `rows` products (weight gradient): a few ulps per term
    # summed in sequence per vector lane, bounded generously by the square root of the count.
    tolerance = (
        HALF_ULP[dtype] * 1.01 * expected.abs()
        + (32 + 4 * math.sqrt(terms_summed)) * FP32_EPS * magnitude
        + SUBNORMAL_HALF_ULP[dtype]
    )
    error = (actual.double() - expected).abs()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    worst = int(torch.argmax(error - tolerance))
    assert (error <= tolerance).all(), (
        f"{what}: |error| {error.flatten()[worst]:.3g} > tolerance {tolerance.flatten()[worst]:.3g} "
        f"at flat index {worst} (expected {expected.flatten()[worst]:.6g})"
    )


def check_forward_backward(x, weight, eps=1e-5, zero_centered_gamma=False):
    x = x.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    y = rms_norm(x, weight, eps, zero_centered_gamma)
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    (ey, my), (egx, mgx), (egw, mgw), rows = reference(x.detach(), weight.detach(), eps, zero_centered_gamma, grad_y)
    cols = x.size(-1)
    assert_matches(y, ey, my, x.dtype, "forward", cols)
    assert_matches(x.grad, egx, mgx, x.dtype, "grad x", cols)
    assert_matches(weight.grad, egw, mgw, weight.dtype, "grad weight", rows + cols)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_every_shape_and_dtype(shape, dtype):
    for zero_centered_gamma in (False, True):
        check_forward_backward(draw(shape, dtype), draw(shape[-1:], dtype), 1e-5, zero_centered_gamma)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_of_another_dtype_and_eps(dtype):
    """An fp32 weight with reduced-precision x (master weights), eps 0 and 1e-2, tiny and huge inputs."""
    check_forward_backward(draw((6, 40), dtype), draw((40,), torch.float32), 1e-2)
    check_forward_backward(draw((6, 40), dtype, scale=1e-3), draw((40,), dtype), 0.0)
    if dtype != torch.float16:
        check_forward_backward(draw((6, 40), dtype, scale=1e15), draw((40,), dtype), 1e-6)


def test_operator_defaults_under_autograd():
    """The operator called with eps and zero_centered_gamma left at their defaults differentiates alike."""
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    for args in [(), (1e-5,), (1e-5, False)]:
        y, _ = torch.ops.ascendspeed.rms_norm(x, w, *args)
        grads = torch.autograd.grad(y.sum(), (x, w))
        expected = torch.autograd.grad(rms_norm_reference(x, w).sum(), (x, w))
        for a, b in zip(grads, expected):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(dtype):
    base = draw((6, 40, 10), dtype)
    check_forward_backward(base.transpose(1, 2), draw((40,), dtype))  # normalized dim strided
    check_forward_backward(base[:, ::3, :], draw((10,), dtype))        # rows strided
    check_forward_backward(base, draw((20,), dtype)[::2])              # weight strided


def test_matches_megatron_rmsnorm_in_fp32():
    """megatron-core's torch norm (torch.nn.RMSNorm via WrappedTorchNorm): output and gradients of x and
    weight to 1e-6 relative (of each tensor's largest value), element by element."""
    hidden = 1024
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=8, normalization="RMSNorm", layernorm_epsilon=1e-5
    )
    norm = WrappedTorchNorm(config, hidden, eps=config.layernorm_epsilon)
    assert isinstance(norm, torch.nn.RMSNorm)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden))
    for shape in [(16, 2, hidden), (3, hidden)]:
        x = torch.randn(shape, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        weight = norm.weight.detach().clone().requires_grad_()
        norm.zero_grad()
        ours, theirs = rms_norm(x, weight, config.layernorm_epsilon), norm(x_ref)
        grad = torch.randn_like(theirs)
        ours.backward(grad)
        theirs.backward(grad)
        for a, b in [(ours, theirs), (x.grad, x_ref.grad), (weight.grad, norm.weight.grad)]:
            assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-6
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())


def test_zero_centered_gamma_is_weight_plus_one():
    """Megatron's layernorm_zero_centered_gamma: the stored weight w means a factor of w + 1."""
    x, w = torch.randn(5, 64), torch.randn(64)
    norm = torch.nn.RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(w + 1)
    torch.testing.assert_close(rms_norm(x, w, 1e-5, zero_centered_gamma=True), norm(x), rtol=1e-6, atol=1e-6)


def test_faster_paths_agree_with_the_eager_composition():
    """rms_norm_reference (the benchmark's eager baseline) and the CUDA/NPU-style Python kernels."""
    for dtype in (torch.float32, torch.bfloat16):
        x, w = draw((7, 48), dtype), draw((48,), dtype)
        torch.testing.assert_close(rms_norm(x, w), rms_norm_reference(x, w))
        y, rstd = _composite_forward(x, w, 1e-5, True)
        y_cpu, rstd_cpu = torch.ops.ascendspeed.rms_norm(x, w, 1e-5, True)
        torch.testing.assert_close(y, y_cpu)
        torch.testing.assert_close(rstd, rstd_cpu)
        g = torch.randn_like(x)
        for ours, theirs in zip(
            _composite_backward(g, x, rstd, w, True), torch.ops.ascendspeed.rms_norm_backward(g, x, rstd, w, True)
        ):
            torch.testing.assert_close(ours, theirs, rtol=2e-2 if dtype != torch.float32 else 1e-5, atol=1e-2)


def test_many_threads_split_rows_correctly():
    threads = torch.get_num_threads()
    torch.set_num_threads(5)
    try:
        check_forward_backward(draw((203, 301), torch.float32), draw((301,), torch.float32))
        check_forward_backward(draw((3, 97, 129), torch.bfloat16), draw((129,), torch.bfloat16))
    finally:
        torch.set_num_threads(threads)


def test_outputs_big_enough_for_huge_pages():
    """Outputs of 32 MiB and more are advised onto huge pages before the kernel first touches them."""
    check_forward_backward(draw((2049, 4096), torch.float32), draw((4096,), torch.float32))


@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_gradcheck_float64(zero_centered_gamma):
    x = torch.randn(3, 4, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-3, zero_centered_gamma), (x, w))


def test_saves_only_x_rstd_and_weight_for_backward():
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    x = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = rms_norm(x, w)
    assert sorted(tuple(t.shape) for t in saved) == [(8,), (8, 16), (16,)]
    assert {t.data_ptr() for t in saved if t.dim() == 2} == {x.data_ptr()}
    rstd = next(t for t in saved if t.shape == (8,))
    assert rstd.dtype == torch.float32
    y.sum().backward()


def test_torch_compile_fullgraph():
    def block(x, w, norm_weight):
        return rms_norm(x @ w, norm_weight, 1e-6).sum(dim=0)

    compiled = torch.compile(block, fullgraph=True)
    graphs = []

    def count_ops(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch.compile(block, fullgraph=True, backend=count_ops)(torch.randn(5, 12), torch.randn(12, 8), torch.randn(8))
    op = torch.ops.ascendspeed.rms_norm
    assert any(n.target in (op, op.default) for n in graphs[0].graph.nodes)
    for x in (torch.randn(5, 12), torch.randn(12, 5).t()):
        w, nw = torch.randn(12, 8), torch.randn(8)
        args1 = [t.clone().requires_grad_() for t in (x, w, nw)]
        args2 = [t.clone().requires_grad_() for t in (x, w, nw)]
        out, expected = compiled(*args1), block(*args2)
        torch.testing.assert_close(out, expected)
        grad = torch.randn_like(out)
        out.backward(grad)
        expected.backward(grad)
        for a, b in zip(args1, args2):
            torch.testing.assert_close(a.grad, b.grad)


def test_opcheck():
    """torch.library's own consistency checks: schema, Meta kernel, autograd registration."""
    x, w = torch.randn(4, 6, requires_grad=True), torch.randn(6, requires_grad=True)
    torch.library.opcheck(torch.ops.ascendspeed.rms_norm.default, (x, w, 1e-5, False))
    torch.library.opcheck(torch.ops.ascendspeed.rms_norm.default, (x.detach().bfloat16(), w.detach(), 1e-5, True))
    _, rstd = torch.ops.ascendspeed.rms_norm(x.detach(), w.detach())
    g = torch.randn(4, 6)
    torch.library.opcheck(torch.ops.ascendspeed.rms_norm_backward.default, (g, x.detach(), rstd, w.detach(), True))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_bad_inputs_name_the_argument(device):
    x, w = torch.randn(4, 6, device=device), torch.randn(6, device=device)
    with pytest.raises(ValueError, match=r"weight must be 1-D with x.size\(-1\) = 6 elements, got shape \[5\]"):
        rms_norm(x, torch.randn(5, device=device))
    with pytest.raises(ValueError, match=r"weight must be 1-D"):
        rms_norm(x, torch.randn(1, 6, device=device))
    with pytest.raises(TypeError, match="x must be float32, bfloat16, float16 or float64, got .*(Long|int64)"):
        rms_norm(torch.ones(4, 6, dtype=torch.long, device=device), w)
    with pytest.raises(TypeError, match="weight must be float32, bfloat16, float16 or float64, got .*Int"):
        rms_norm(x, torch.ones(6, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="x must have a non-empty last dimension"):
        rms_norm(torch.tensor(1.0, device=device), w)
    with pytest.raises(ValueError, match="x must have a non-empty last dimension"):
        rms_norm(torch.randn(4, 0, device=device), torch.randn(0, device=device))
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        rms_norm(x, w, -1e-5)
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        rms_norm(x, w, float("nan"))
    _, rstd = torch.ops.ascendspeed.rms_norm(x, w)
    backward = torch.ops.ascendspeed.rms_norm_backward
    with pytest.raises(ValueError, match="rms_norm_backward: grad_y must have the shape of x"):
        backward(torch.randn(4, 5, device=device), x, rstd, w)
    with pytest.raises(TypeError, match="rms_norm_backward: grad_y must have the dtype of x"):
        backward(x.double(), x, rstd, w)
    with pytest.raises(ValueError, match="rms_norm_backward: rstd must have the shape of x without its last"):
        backward(x, x, rstd[:2], w)
    with pytest.raises(TypeError, match="rms_norm_backward: rstd must be Float for x of dtype BFloat16"):
        backward(x.bfloat16(), x.bfloat16(), rstd.double(), w)


def test_weight_on_another_device_is_named():
    with pytest.raises(RuntimeError, match="weight must be on the device of x"):
        rms_norm(torch.randn(4, 6), torch.randn(6, device="meta"))


def test_meta_tensors_give_shapes():
    y, rstd = torch.ops.ascendspeed.rms_norm(
        torch.empty(3, 8, 5, device="meta", dtype=torch.bfloat16), torch.empty(5, device="meta")
    )
    assert y.shape == (3, 8, 5) and y.dtype == torch.bfloat16 and y.device.type == "meta"
    assert rstd.shape == (3, 8) and rstd.dtype == torch.float32
    y = rms_norm(torch.empty(3, 8, 5, device="meta", requires_grad=True), torch.empty(5, device="meta"))
    assert y.shape == (3, 8, 5)


def test_empty_rows():
    x = torch.randn(0, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    rms_norm(x, w).sum().backward()
    assert x.grad.shape == (0, 4) and torch.equal(w.grad, torch.zeros(4))


def test_device_kernels_registered():
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    for op in ("ascendspeed::rms_norm", "ascendspeed::rms_norm_backward"):
        assert has_kernel(op, "CPU") and has_kernel(op, "Meta") and has_kernel(op, "CUDA")
        assert has_kernel(op, "PrivateUse1") == NPU_KERNELS


def test_kernels_are_vectorized_and_multi_threaded():
    assert_vectorized_and_multi_threaded(torch.ops.ascendspeed._rms_norm_cpu_kernel(), torch.ops.ascendspeed._swiglu_cpu_kernel())


ISA_CHECK = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from ops.test_rms_norm import DTYPES, check_forward_backward, draw
    isa = torch.ops.ascendspeed._rms_norm_cpu_kernel().split(",")[0]
    if isa != {isa!r}:
        print("unsupported", isa)
        raise SystemExit(0)
    for dtype in DTYPES + [torch.float64]:
        for shape in [(3, 1001), (5, 6, 7), (40, 64)]:
            check_forward_backward(draw(shape, dtype), draw(shape[-1:], dtype), 1e-5, True)
    print("ok", isa)
    """
)


@pytest.mark.parametrize("isa", ["DEFAULT", "AVX2"])
def test_narrower_instruction_sets(isa):
    """The kernels built for older CPUs are correct too (torch picks them via ATEN_CPU_CAPABILITY)."""
    check_under_isa(ISA_CHECK, isa)


def test_bf16_outputs_round_like_torch_bit_for_bit_also_when_subnormal():
    """bf16 outputs are the fp32 results rounded to nearest even as torch rounds them, bit for bit, also where
    they are subnormal (a hardware rounding instruction such as AVX512_BF16's would flush those to zero)."""
    x = draw((64, 300), torch.bfloat16)
    # per column from 1 down to 1e-41: normal, near FLT_MIN and subnormal outputs, mixed within vectors
    weight = torch.logspace(0, -41, 300, dtype=torch.float64).to(torch.bfloat16)
    y, rstd = torch.ops.ascendspeed.rms_norm(x, weight, 1e-5, False)
    expected = ((x.float() * rstd.reshape(-1, 1)) * weight.float()).to(torch.bfloat16)
    assert (expected.float().abs() < torch.finfo(torch.float32).tiny).any()
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))
