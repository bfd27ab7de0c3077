"""The fused rotary-embedding operator against a float64 reference, forward and backward, and against
megatron-core's own ``apply_rotary_pos_emb`` (unfused, bshd) with the freqs of its ``RotaryEmbedding``.

Inputs are fresh random draws each run. Tolerances are per element: one rounding of the exact value to
the output dtype, plus a few fp32 ulps of the magnitude of the two terms each result is the sum of.
"""
import textwrap

import pytest
import torch

from tests.helpers.isa import assert_vectorized_and_multi_threaded, check_under_isa

from ascendspeed.ops import rotary_embedding
from ascendspeed.ops.rotary import (
    NPU_KERNELS,
    _composite_backward,
    _composite_forward,
    rotary_embedding_reference,
)
from tests.helpers.distributed import run_distributed

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 2.0**-53}
SUBNORMAL_HALF_ULP = {torch.float32: 2.0**-150, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25, torch.float64: 0.0}
FP32_EPS = 2.0**-23

# (t shape [s, b, h, d], d_rot): full and partial rotation, d_rot not a multiple of any vector width,
# pairs shorter than a vector, one position, many positions past the parallel grain.
CASES = [
    ((1, 1, 1, 2), 2),
    ((3, 2, 4, 8), 8),
    ((5, 1, 3, 10), 6),
    ((4, 3, 2, 34), 34),
    ((2, 2, 2, 70), 66),
    ((7, 2, 3, 128), 128),
    ((6, 1, 2, 96), 64),
    ((65, 2, 8, 64), 64),
    ((3, 1, 2, 256), 2),
]


def draw(shape, dtype, scale=1.0):
    return (torch.randn(shape, dtype=torch.float64) * scale).to(dtype)


def draw_freqs(seq, d_rot, dtype=torch.float32, paired=False):
    """Random angles up to a few thousand radians (long sequences); paired = Megatron's layout, where
    both features of a pair share their angle."""
    if paired:
        half = torch.rand(seq, d_rot // 2, dtype=torch.float64) * 4000
        return torch.cat((half, half), -1).reshape(seq, 1, 1, d_rot).to(dtype)
    return (torch.rand(seq, 1, 1, d_rot, dtype=torch.float64) * 4000).to(dtype)


def _pairs(x, interleaved, d_rot):
    if interleaved:
        return x[..., 0:d_rot:2], x[..., 1:d_rot:2]
    return x[..., : d_rot // 2], x[..., d_rot // 2 : d_rot]


def _join(a, b, interleaved):
    return torch.stack((a, b), -1).flatten(-2) if interleaved else torch.cat((a, b), -1)


def reference(t, freqs, interleaved, transpose=False):
    """Float64 result of the rounded inputs (the backward is the transpose), the magnitude of its terms
    (out_a = t_a cos f_a - t_b sin f_a, out_b = t_b cos f_b + t_a sin f_b), and |t_a| + |t_b| per
    rotated feature (how far an error in the angle moves the result)."""
    d_rot = freqs.size(-1)
    t64, f64 = t.double(), freqs.double()
    ta, tb = _pairs(t64, interleaved, d_rot)
    fa, fb = _pairs(f64, interleaved, d_rot)
    if transpose:
        out_a = ta * torch.cos(fa) + tb * torch.sin(fb)
        out_b = tb * torch.cos(fb) - ta * torch.sin(fa)
        mag_a = (ta * torch.cos(fa)).abs() + (tb * torch.sin(fb)).abs()
        mag_b = (tb * torch.cos(fb)).abs() + (ta * torch.sin(fa)).abs()
    else:
        out_a = ta * torch.cos(fa) - tb * torch.sin(fa)
        out_b = tb * torch.cos(fb) + ta * torch.sin(fb)
        mag_a = (ta * torch.cos(fa)).abs() + (tb * torch.sin(fa)).abs()
        mag_b = (tb * torch.cos(fb)).abs() + (ta * torch.sin(fb)).abs()
    rest = t64[..., d_rot:]
    out = torch.cat((_join(out_a, out_b, interleaved), rest), -1)
    magnitude = torch.cat((_join(mag_a, mag_b, interleaved), rest.abs()), -1)
    pair = ta.abs() + tb.abs()
    angle_sensitivity = torch.cat((_join(pair, pair, interleaved), torch.zeros_like(rest)), -1)
    return out, magnitude, angle_sensitivity


def assert_matches(actual, expected, magnitude, angle_sensitivity, dtype, what, freqs):
    assert actual.dtype == dtype and actual.shape == expected.shape, what
    # The kernel works on the angles in the math type of t (fp32 unless t is fp64): float64 angles
    # for a reduced-precision t are rounded to fp32 first, an error of up to |f| * half an fp32 ulp.
    angle_rounding = 0.0
    if freqs.dtype == torch.float64 and dtype != torch.float64:
        angle_rounding = float(freqs.abs().max()) * HALF_ULP[torch.float32]
    tolerance = (
        HALF_ULP[dtype] * 1.01 * expected.abs()
        + 16 * FP32_EPS * magnitude
        + angle_rounding * angle_sensitivity
        + SUBNORMAL_HALF_ULP[dtype]
    )
    error = (actual.double() - expected).abs()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    worst = int(torch.argmax(error - tolerance))
    assert (error <= tolerance).all(), (
        f"{what}: |error| {error.flatten()[worst]:.3g} > tolerance {tolerance.flatten()[worst]:.3g} "
        f"at flat index {worst} (expected {expected.flatten()[worst]:.6g})"
    )


def check_forward_backward(t, freqs, interleaved):
    t = t.detach().requires_grad_()
    out = rotary_embedding(t, freqs, interleaved)
    assert out.is_contiguous()
    grad = torch.randn_like(out)
    out.backward(grad)
    assert_matches(out, *reference(t.detach(), freqs, interleaved), t.dtype, "forward", freqs)
    assert_matches(t.grad, *reference(grad, freqs, interleaved, transpose=True), t.dtype, "backward", freqs)
    assert torch.ops.ascendspeed.rotary_embedding_backward(t.detach(), freqs, interleaved).is_contiguous()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape, d_rot", CASES)
def test_every_shape_and_dtype(shape, d_rot, dtype, interleaved):
    freqs_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    check_forward_backward(draw(shape, dtype), draw_freqs(shape[0], d_rot, freqs_dtype), interleaved)


@pytest.mark.parametrize("freqs_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_freqs_of_any_float_dtype(freqs_dtype):
    for dtype in (torch.float32, torch.bfloat16):
        check_forward_backward(draw((4, 2, 3, 40), dtype), draw_freqs(4, 40, freqs_dtype) / 100, False)


@pytest.mark.parametrize("interleaved", [False, True])
def test_paired_angles_backward_is_rotation_by_minus_theta(interleaved):
    freqs = draw_freqs(9, 32, paired=not interleaved)
    if interleaved:
        freqs = freqs[..., : 16].repeat_interleave(2, -1)
    g = draw((9, 2, 3, 32), torch.float64)
    torch.testing.assert_close(
        torch.ops.ascendspeed.rotary_embedding_backward(g, freqs, interleaved),
        rotary_embedding(g, -freqs, interleaved),
    )


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(dtype, interleaved):
    """Megatron's query and key are strided views of the QKV projection; also a strided feature dim."""
    qkv = draw((6, 2, 4, 3 * 40), dtype)
    query = qkv[..., 40:80]
    assert not query.is_contiguous()
    check_forward_backward(query, draw_freqs(6, 32), interleaved)
    check_forward_backward(draw((6, 2, 40, 4), dtype).transpose(2, 3), draw_freqs(6, 40), interleaved)
    check_forward_backward(draw((2, 6, 4, 40), dtype).transpose(0, 1), draw_freqs(6, 40), interleaved)
    check_forward_backward(draw((6, 2, 4, 80), dtype)[..., ::2], draw_freqs(6, 40), interleaved)
    check_forward_backward(draw((6, 2, 4, 40), dtype), draw_freqs(6, 80)[..., ::2], interleaved)


def _megatron_equality(rank, world_size):
    """In a real (one-process, gloo) Megatron parallel state: megatron-core's RotaryEmbedding makes the
    freqs, its unfused apply_rotary_pos_emb rotates; ours must agree to 1e-6 relative in fp32."""
    from tests.helpers.megatron import initialize_parallel
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_config import TransformerConfig

    initialize_parallel()
    worst = {}
    for interleaved in (False, True):
        for rotary_percent in (1.0, 0.5):
            config = TransformerConfig(
                num_layers=1, hidden_size=256, num_attention_heads=4, apply_rope_fusion=False,
                rotary_interleaved=interleaved,
            )
            rope = RotaryEmbedding(config.kv_channels, rotary_percent, rotary_interleaved=interleaved,
                                   use_cpu_initialization=True)
            freqs = rope(48)
            t = torch.randn(48, 2, 4, config.kv_channels, requires_grad=True)
            t_ref = t.detach().clone().requires_grad_()
            ours, theirs = rotary_embedding(t, freqs, interleaved), apply_rotary_pos_emb(t_ref, freqs, config)
            grad = torch.randn_like(theirs)
            ours.backward(grad)
            theirs.backward(grad)
            for name, a, b in (("out", ours, theirs), ("grad", t.grad, t_ref.grad)):
                key = f"{name} interleaved={interleaved} rotary_percent={rotary_percent}"
                worst[key] = ((a - b).abs().max() / b.abs().max()).item()
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())
    return worst


def test_matches_megatron_apply_rotary_pos_emb_in_fp32():
    (worst,) = run_distributed(_megatron_equality, 1)
    for key, error in worst.items():
        assert error <= 1e-6, f"{key}: max |ours - megatron| / max |megatron| = {error:.3g}"


def test_faster_paths_agree_with_the_eager_composition():
    """rotary_embedding_reference (the benchmark's eager baseline) and the CUDA/NPU-style Python kernels."""
    for interleaved in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            t, freqs = draw((5, 2, 3, 24), dtype), draw_freqs(5, 16) / 100
            expected = rotary_embedding(t, freqs, interleaved)
            torch.testing.assert_close(rotary_embedding_reference(t, freqs, interleaved), expected)
            torch.testing.assert_close(_composite_forward(t, freqs, interleaved), expected)
            torch.testing.assert_close(
                _composite_backward(t, freqs, interleaved),
                torch.ops.ascendspeed.rotary_embedding_backward(t, freqs, interleaved),
            )


def test_many_threads_split_positions_correctly():
    threads = torch.get_num_threads()
    torch.set_num_threads(5)
    try:
        check_forward_backward(draw((37, 3, 5, 64), torch.float32), draw_freqs(37, 48), False)
        check_forward_backward(draw((41, 1, 7, 128), torch.bfloat16), draw_freqs(41, 128), True)
    finally:
        torch.set_num_threads(threads)


def test_outputs_big_enough_for_huge_pages():
    check_forward_backward(draw((512, 1, 32, 128), torch.float32), draw_freqs(512, 128, paired=True), False)


@pytest.mark.parametrize("interleaved", [False, True])
def test_gradcheck_float64(interleaved):
    t = torch.randn(3, 2, 2, 10, dtype=torch.float64, requires_grad=True)
    freqs = torch.randn(3, 1, 1, 6, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: rotary_embedding(x, freqs, interleaved), (t,))
    assert torch.autograd.gradgradcheck(lambda x: rotary_embedding(x, freqs, interleaved), (t,))


def test_saves_only_freqs_for_backward():
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    t = torch.randn(8, 2, 4, 16, requires_grad=True)
    freqs = torch.randn(8, 1, 1, 16)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = rotary_embedding(t, freqs)
    assert len(saved) == 1 and saved[0].data_ptr() == freqs.data_ptr()
    out.sum().backward()


def test_freqs_requiring_grad_is_an_error():
    with pytest.raises(ValueError, match=r"freqs requires grad.*pass freqs.detach\(\)"):
        rotary_embedding(torch.randn(2, 1, 1, 4, requires_grad=True), torch.randn(2, 1, 1, 4, requires_grad=True))


def test_torch_compile_fullgraph():
    def block(x, w, freqs):
        q = (x @ w).view(x.size(0), x.size(1), 2, 8)
        return rotary_embedding(q, freqs, False).sum(dim=0)

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    args = (torch.randn(5, 3, 12), torch.randn(12, 16), torch.randn(5, 1, 1, 8))
    torch.compile(block, fullgraph=True, backend=capture)(*args)
    op = torch.ops.ascendspeed.rotary_embedding
    assert any(n.target in (op, op.default) for n in graphs[0].graph.nodes)
    compiled = torch.compile(block, fullgraph=True)
    x1, w1 = (a.clone().requires_grad_() for a in args[:2])
    x2, w2 = (a.clone().requires_grad_() for a in args[:2])
    out, expected = compiled(x1, w1, args[2]), block(x2, w2, args[2])
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(w1.grad, w2.grad)


def test_opcheck():
    t = torch.randn(4, 2, 3, 10, requires_grad=True)
    freqs = torch.randn(4, 1, 1, 8)
    for interleaved in (False, True):
        torch.library.opcheck(torch.ops.ascendspeed.rotary_embedding.default, (t, freqs, interleaved))
        torch.library.opcheck(
            torch.ops.ascendspeed.rotary_embedding_backward.default, (t.detach().bfloat16(), freqs, interleaved)
        )


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_bad_inputs_name_the_argument(device):
    t = torch.randn(4, 2, 3, 8, device=device)
    freqs = torch.randn(4, 1, 1, 8, device=device)
    with pytest.raises(ValueError, match=r"rotary_embedding: t must be 4-D \[seq, batch, heads, head_dim\]"):
        rotary_embedding(torch.randn(4, 6, 8, device=device), freqs)
    with pytest.raises(TypeError, match="t must be float32, bfloat16, float16 or float64, got .*Long"):
        rotary_embedding(torch.ones(4, 2, 3, 8, dtype=torch.long, device=device), freqs)
    with pytest.raises(TypeError, match="freqs must be float32, bfloat16, float16 or float64, got .*Int"):
        rotary_embedding(t, torch.ones(4, 1, 1, 8, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"freqs must have shape \[seq, 1, 1, d_rot\] with seq = t.size\(0\) = 4"):
        rotary_embedding(t, torch.randn(5, 1, 1, 8, device=device))
    with pytest.raises(ValueError, match=r"freqs must have shape \[seq, 1, 1, d_rot\]"):
        rotary_embedding(t, torch.randn(4, 2, 1, 8, device=device))
    with pytest.raises(ValueError, match=r"freqs.size\(-1\) \(the rotated features, d_rot\) must be even.*got 5"):
        rotary_embedding(t, torch.randn(4, 1, 1, 5, device=device))
    with pytest.raises(ValueError, match=r"at most t.size\(-1\) = 8, got 10"):
        rotary_embedding(t, torch.randn(4, 1, 1, 10, device=device))
    with pytest.raises(ValueError, match=r"rotary_embedding_backward: grad_out must be 4-D"):
        torch.ops.ascendspeed.rotary_embedding_backward(torch.randn(4, 8, device=device), freqs)


def test_freqs_on_another_device_is_named():
    with pytest.raises(RuntimeError, match="freqs must be on the device of t"):
        rotary_embedding(torch.randn(4, 2, 3, 8), torch.randn(4, 1, 1, 8, device="meta"))


def test_meta_tensors_give_shapes():
    out = rotary_embedding(
        torch.empty(3, 2, 4, 8, device="meta", dtype=torch.bfloat16, requires_grad=True),
        torch.empty(3, 1, 1, 4, device="meta"),
    )
    assert out.shape == (3, 2, 4, 8) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    out.sum().backward()


def test_empty_inputs():
    t = torch.randn(0, 2, 3, 8, requires_grad=True)
    rotary_embedding(t, torch.randn(0, 1, 1, 8)).sum().backward()
    assert t.grad.shape == t.shape
    t = torch.randn(4, 0, 3, 8, requires_grad=True)
    rotary_embedding(t, torch.randn(4, 1, 1, 8)).sum().backward()
    assert t.grad.shape == t.shape


def test_device_kernels_registered():
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    for op in ("ascendspeed::rotary_embedding", "ascendspeed::rotary_embedding_backward"):
        assert has_kernel(op, "CPU") and has_kernel(op, "Meta") and has_kernel(op, "CUDA")
        assert has_kernel(op, "PrivateUse1") == NPU_KERNELS


def test_kernels_are_vectorized_and_multi_threaded():
    assert_vectorized_and_multi_threaded(torch.ops.ascendspeed._rotary_embedding_cpu_kernel(), torch.ops.ascendspeed._swiglu_cpu_kernel())


ISA_CHECK = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from ops.test_rotary import DTYPES, check_forward_backward, draw, draw_freqs
    isa = torch.ops.ascendspeed._rotary_embedding_cpu_kernel().split(",")[0]
    if isa != {isa!r}:
        print("unsupported", isa)
        raise SystemExit(0)
    for dtype in DTYPES + [torch.float64]:
        for interleaved in (False, True):
            for shape, d_rot in [((3, 2, 3, 70), 66), ((5, 1, 2, 128), 128), ((2, 2, 2, 10), 4)]:
                freqs = draw_freqs(shape[0], d_rot, torch.float64 if dtype == torch.float64 else torch.float32)
                check_forward_backward(draw(shape, dtype), freqs, interleaved)
    print("ok", isa)
    """
)


@pytest.mark.parametrize("isa", ["DEFAULT", "AVX2"])
def test_narrower_instruction_sets(isa):
    """The kernels built for older CPUs are correct too (torch picks them via ATEN_CPU_CAPABILITY)."""
    check_under_isa(ISA_CHECK, isa)
