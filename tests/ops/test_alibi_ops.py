"""ALiBi operators: slopes, the in-place bias kernel, and fused attention against float64 references."""
import math
import textwrap

import pytest
import torch

from ascendspeed.ops.alibi import alibi_attention, alibi_bias_, alibi_slopes, local_alibi_slopes
from tests.helpers.isa import assert_vectorized_and_multi_threaded, check_under_isa

pytestmark = pytest.mark.megatron_independent  # one release covers it: .ci/run runs it on the newest only


def paper_slopes(n):
    """The slope formula of the paper's reference code (github.com/ofirpress/attention_with_linear_biases)."""

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + paper_slopes(2 * closest)[0::2][: n - closest]


def reference_bias(slopes, sq, sk, q_offset, symmetric=False):
    """The full float64 [heads, sq, sk] bias -m * distance between absolute positions."""
    distance = torch.arange(q_offset, q_offset + sq, dtype=torch.float64)[:, None] - torch.arange(sk)
    if symmetric:
        distance = distance.abs()
    return -slopes.double()[:, None, None] * distance


def reference_attention(q, k, v, slopes, *, q_offset, causal=True, masked_out=None, scale=None):
    """softmax(q k^T * scale + bias) v in float64 with the bias materialised."""
    q, k, v = q.double(), k.double(), v.double()
    sq, sk = q.size(-2), k.size(-2)
    scale = q.size(-1) ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale + reference_bias(slopes, sq, sk, q_offset, symmetric=not causal)
    hidden = torch.zeros(sq, sk, dtype=torch.bool)
    if causal:
        hidden = torch.arange(sk) > torch.arange(q_offset, q_offset + sq)[:, None]
    if masked_out is not None:
        hidden = hidden | masked_out
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ v


def local_attention(q, k, v, slopes, *, q_offset, causal=True, masked_out=None):
    """Megatron's local path: baddbmm into a score buffer, in-place ALiBi, mask, fp32 softmax, bmm."""
    b, h, sq, d = q.shape
    sk = k.size(-2)
    buffer = torch.empty(b * h, sq, sk, dtype=q.dtype)
    scores = torch.baddbmm(
        buffer, q.reshape(b * h, sq, d), k.reshape(b * h, sk, d).transpose(1, 2), beta=0.0, alpha=d**-0.5
    ).view(b, h, sq, sk)
    alibi_bias_(scores, slopes, q_offset, symmetric=not causal)
    hidden = torch.zeros(sq, sk, dtype=torch.bool)
    if causal:
        hidden = torch.arange(sk) > torch.arange(q_offset, q_offset + sq)[:, None]
    if masked_out is not None:
        hidden = hidden | masked_out
    probs = torch.softmax(scores.float().masked_fill(hidden, -10000.0), -1).to(q.dtype)
    return probs @ v


def relative_error(actual, expected):
    """Norm of the error over the norm of the expected value (floored for all-zero gradients)."""
    floor = 1e-2 * expected.numel() ** 0.5
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(floor)).item()


def qkv(b, h, sq, sk, d, dtype, requires_grad=False):
    return tuple(
        torch.randn(b, h, s, d).to(dtype).requires_grad_(requires_grad) for s in (sq, sk, sk)
    )


# -- slopes ------------------------------------------------------------------------------------------
def test_slopes_match_the_paper_for_1_to_64_heads():
    for heads in range(1, 65):
        expected = torch.tensor(paper_slopes(heads), dtype=torch.float32)
        actual = alibi_slopes(heads)
        assert actual.dtype == torch.float32 and actual.shape == (heads,)
        assert torch.equal(actual, expected), heads


def test_slopes_reject_zero_heads():
    with pytest.raises(ValueError, match="at least one attention head"):
        alibi_slopes(0)


@pytest.mark.parametrize("heads,tp", [(8, 2), (12, 4), (6, 3), (16, 1)])
def test_tensor_parallel_ranks_take_contiguous_slopes(heads, tp):
    ranks = [local_alibi_slopes(heads, rank, tp) for rank in range(tp)]
    assert torch.equal(torch.cat(ranks), alibi_slopes(heads))
    assert local_alibi_slopes(heads, tp - 1, tp) is ranks[-1], "slopes are cached, not rebuilt"


def test_tensor_parallel_split_must_divide_the_heads():
    with pytest.raises(ValueError, match="do not split"):
        local_alibi_slopes(6, 0, 4)


# -- the in-place bias kernel --------------------------------------------------------------------------
KERNEL_CASES = [
    # batch, heads, sq, sk, q_offset (None: sk - sq)
    (2, 3, 5, 37, None),
    (1, 4, 64, 64, None),
    (1, 5, 3, 100, 7),
    (2, 8, 256, 256, None),  # large enough to run on several threads
    (1, 6, 1, 513, None),  # one decoding step against a KV cache
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("batch,heads,sq,sk,q_offset", KERNEL_CASES)
def test_bias_kernel_is_the_fp32_sum_rounded_once(dtype, symmetric, batch, heads, sq, sk, q_offset):
    scores = torch.randn(batch, heads, sq, sk).to(dtype)
    slopes = alibi_slopes(heads)
    offset = sk - sq if q_offset is None else q_offset
    opmath = torch.float64 if dtype == torch.float64 else torch.float32
    expected = (scores.to(opmath) + reference_bias(slopes, sq, sk, offset, symmetric).to(opmath)).to(dtype)

    actual = scores.clone()
    assert alibi_bias_(actual, slopes, q_offset, symmetric=symmetric) is actual
    assert torch.equal(actual, expected)


def test_bias_kernel_is_vectorized_and_multi_threaded():
    assert_vectorized_and_multi_threaded(torch.ops.ascendspeed._alibi_bias_cpu_kernel(), torch.ops.ascendspeed._rms_norm_cpu_kernel())


BIAS_ISA_CHECK = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from ops.test_alibi_ops import KERNEL_CASES, test_bias_kernel_is_the_fp32_sum_rounded_once as check
    isa = torch.ops.ascendspeed._alibi_bias_cpu_kernel().split(",")[0]
    if isa != {isa!r}:
        print("unsupported", isa)
        raise SystemExit(0)
    for dtype in [torch.float32, torch.bfloat16, torch.float16, torch.float64]:
        for symmetric in [False, True]:
            for case in KERNEL_CASES:
                check(dtype, symmetric, *case)
    print("ok", isa)
    """
)


@pytest.mark.parametrize("isa", ["DEFAULT", "AVX2"])
def test_bias_kernel_for_narrower_instruction_sets(isa):
    """The kernels built for older CPUs add the same bits (torch picks them via ATEN_CPU_CAPABILITY)."""
    check_under_isa(BIAS_ISA_CHECK, isa)


def test_bias_kernel_handles_3d_and_strided_scores():
    slopes = alibi_slopes(4)
    scores = torch.randn(4, 16, 24)
    expected = scores.double() + reference_bias(slopes, 16, 24, 8)
    alibi_bias_(scores, slopes)
    torch.testing.assert_close(scores.double(), expected)

    base = torch.randn(2, 4, 24, 16)
    transposed = base.transpose(-1, -2)  # [2, 4, 16, 24] with a strided last dimension
    expected = transposed.double() + reference_bias(slopes, 16, 24, 8)
    alibi_bias_(transposed, slopes)
    torch.testing.assert_close(transposed.double(), expected)


def test_bias_kernel_rejects_bad_arguments():
    scores = torch.zeros(1, 4, 8, 8)
    with pytest.raises(ValueError, match="one slope per head"):
        alibi_bias_(scores, alibi_slopes(3))
    with pytest.raises(TypeError, match="slopes must be float32"):
        alibi_bias_(scores, alibi_slopes(4).double())
    with pytest.raises(ValueError, match=r"\[heads, sq, sk\]"):
        alibi_bias_(torch.zeros(8, 8), alibi_slopes(8))
    with pytest.raises(ValueError, match="where fp32 distances are exact"):
        alibi_bias_(scores, alibi_slopes(4), 1 << 24)


def test_reference_kernel_for_other_devices_matches_the_cpu_kernel():
    from ascendspeed.ops.alibi import _alibi_bias_reference

    scores = torch.randn(2, 4, 9, 21)
    expected = scores.clone()
    alibi_bias_(expected, alibi_slopes(4), 5, symmetric=True)
    _alibi_bias_reference(scores, alibi_slopes(4), 5, True)
    torch.testing.assert_close(scores, expected)


def test_bias_operator_passes_torch_opcheck():
    scores = torch.randn(2, 4, 8, 16, requires_grad=True).clone()
    result = torch.library.opcheck(torch.ops.ascendspeed.alibi_bias_.default, (scores, alibi_slopes(4), 8, False))
    assert set(result.values()) == {"SUCCESS"}, result


# -- autograd ----------------------------------------------------------------------------------------
def test_gradient_through_the_bias_is_the_identity():
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    weight = torch.randn(2, 4, 8, 8)
    scores = x * 3
    alibi_bias_(scores, alibi_slopes(4))
    (scores * weight).sum().backward()
    torch.testing.assert_close(x.grad, 3 * weight)


def test_overwriting_a_tensor_saved_for_backward_is_reported():
    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    saved = x.exp()  # exp saves its output for backward
    alibi_bias_(saved, alibi_slopes(2))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


def test_leaf_and_differentiable_slopes_are_rejected():
    with pytest.raises(RuntimeError, match="leaf tensor"):
        alibi_bias_(torch.zeros(1, 2, 4, 4, requires_grad=True), alibi_slopes(2))
    with pytest.raises(RuntimeError, match="slopes are fixed"):
        alibi_bias_(torch.zeros(1, 2, 4, 4), alibi_slopes(2).requires_grad_())


# -- attention: local (in-place bias) and fused paths against the float64 reference ----------------
ATTENTION_CASES = [
    # batch, heads, sq, sk, q_offset (None: sk - sq, the query block at the end of the keys)
    (2, 4, 1, 1, None),
    (2, 4, 17, 17, None),
    (1, 6, 128, 128, None),
    (1, 12, 300, 300, None),
    (1, 4, 1, 257, None),  # decoding with a KV cache
    (2, 5, 33, 200, None),  # chunked prefill
    (1, 4, 50, 200, 0),  # query block at the start: top-left causal alignment
]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["local", "fused"])
@pytest.mark.parametrize("batch,heads,sq,sk,q_offset", ATTENTION_CASES)
def test_causal_attention_matches_float64_reference(dtype, path, batch, heads, sq, sk, q_offset):
    q, k, v = qkv(batch, heads, sq, sk, 32, dtype, requires_grad=True)
    slopes = alibi_slopes(heads)
    offset = sk - sq if q_offset is None else q_offset
    grad_out = torch.randn(batch, heads, sq, 32)

    if path == "local":
        out = local_attention(q, k, v, slopes, q_offset=offset)
    else:
        out = alibi_attention(q, k, v, slopes, q_offset=q_offset)
    out.backward(grad_out.to(dtype))

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*leaves, slopes, q_offset=offset)
    expected.backward(grad_out.double())

    assert out.dtype == dtype
    assert relative_error(out, expected) < TOLERANCE[dtype]
    for actual, leaf in zip((q, k, v), leaves):
        assert relative_error(actual.grad, leaf.grad) < TOLERANCE[dtype] * 2


@pytest.mark.parametrize("path", ["local", "fused"])
def test_non_causal_attention_uses_the_symmetric_bias_and_a_padding_mask(path):
    q, k, v = qkv(2, 4, 40, 40, 16, torch.float32)
    slopes = alibi_slopes(4)
    padding = torch.zeros(2, 1, 1, 40, dtype=torch.bool)
    padding[0, ..., 31:] = True
    if path == "local":
        out = local_attention(q, k, v, slopes, q_offset=0, causal=False, masked_out=padding)
    else:
        out = alibi_attention(q, k, v, slopes, causal=False, masked_out=padding)
    expected = reference_attention(q, k, v, slopes, q_offset=0, causal=False, masked_out=padding)
    assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_and_local_paths_agree(dtype):
    q, k, v = qkv(2, 8, 192, 192, 32, dtype, requires_grad=True)
    slopes = alibi_slopes(8)
    grad_out = torch.randn(2, 8, 192, 32).to(dtype)
    results = []
    for path in ("local", "fused"):
        for t in (q, k, v):
            t.grad = None
        if path == "local":
            out = local_attention(q, k, v, slopes, q_offset=0)
        else:
            out = alibi_attention(q, k, v, slopes)
        out.backward(grad_out)
        results.append([out.detach().double()] + [t.grad.double() for t in (q, k, v)])
    for local, fused in zip(*results):
        assert relative_error(fused, local) < TOLERANCE[dtype] / 2


def test_bf16_attention_keeps_the_position_signal_at_long_range():
    """At 1024 tokens a bias rounded to bf16 is as wrong as no bias: ours must be far closer than that."""
    q, k, v = qkv(1, 8, 1024, 1024, 64, torch.bfloat16)
    slopes = alibi_slopes(8)
    expected = reference_attention(q, k, v, slopes, q_offset=0)
    no_bias = reference_attention(q, k, v, torch.zeros(8), q_offset=0)
    fused_error = relative_error(alibi_attention(q, k, v, slopes), expected)
    assert fused_error < 0.1 * relative_error(no_bias, expected)
    assert fused_error < 1e-2


def test_fused_attention_with_dropout_runs_and_backpropagates():
    q, k, v = qkv(1, 4, 32, 32, 16, torch.float32, requires_grad=True)
    out = alibi_attention(q, k, v, alibi_slopes(4), dropout_p=0.5)
    out.sum().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in (q, k, v))
