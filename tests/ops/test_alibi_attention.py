"""ascendspeed::alibi_flash_attention (the CPU flash kernel with ALiBi generated inside) against float64."""
import os
import subprocess
import sys

import pytest
import torch

from ascendspeed.accelerator.cpu_features import cpu_flags
from ascendspeed.ops import alibi_attention, alibi_slopes
from ascendspeed.ops.alibi_flash_attention import alibi_flash_attention

pytestmark = pytest.mark.megatron_independent  # one release covers it: .ci/run runs it on the newest only


def reference(q, k, v, slopes, scale, q_offset):
    """softmax(q k^T * scale - m (q_pos - k_pos)) v in float64, keys after q_pos hidden, and the logsumexp."""
    q, k, v = q.double(), k.double(), v.double()
    sq, sk = q.size(-2), k.size(-2)
    distance = torch.arange(q_offset, q_offset + sq, dtype=torch.float64)[:, None] - torch.arange(sk)
    scores = q @ k.transpose(-1, -2) * scale - slopes.double()[:, None, None] * distance
    scores = scores.masked_fill(distance < 0, float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def relative_error(actual, expected):
    floor = 0.1 * expected.numel() ** 0.5  # unit-scale inputs: rounding of O(1) terms where the result is ~0
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(floor)).item()


def inputs(b, h, sq, sk, d, dtype):
    return [torch.randn(b, h, s, d).to(dtype).requires_grad_() for s in (sq, sk, sk)]


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
CASES = [
    # batch, heads, sq, sk, head_dim, q_offset
    (1, 1, 1, 1, 8, 0),
    (2, 3, 17, 17, 16, 0),
    (1, 4, 128, 128, 64, 0),  # exactly one query block
    (1, 2, 300, 300, 32, 0),  # not a multiple of either block size
    (1, 2, 520, 520, 64, 0),  # more than two key blocks
    (2, 2, 1, 300, 32, 299),  # decoding one token with a KV cache
    (1, 3, 100, 400, 16, 300),  # chunked prefill: the query block at the end of the keys
    (1, 2, 90, 400, 16, 0),  # query block at the start: later keys never seen, their gradient is zero
    (1, 2, 200, 150, 24, 10),  # queries past the last key see every key
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,h,sq,sk,d,q_offset", CASES)
def test_forward_backward_match_float64(dtype, b, h, sq, sk, d, q_offset):
    q, k, v = inputs(b, h, sq, sk, d, dtype)
    slopes = alibi_slopes(h)
    scale = d**-0.5
    out, lse = torch.ops.ascendspeed.alibi_flash_attention(q, k, v, slopes, scale, q_offset)
    grad_out = torch.randn(b, h, sq, d)
    out.backward(grad_out.to(dtype))

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected, expected_lse = reference(*leaves, slopes, scale, q_offset)
    expected.backward(grad_out.double())

    assert out.dtype == dtype and out.shape == (b, h, sq, d)
    assert lse.dtype == torch.float32 and lse.shape == (b, h, sq)
    assert relative_error(out, expected) < TOLERANCE[dtype]
    assert (lse.double() - expected_lse).abs().max() < 1e-4 * max(1.0, expected_lse.abs().max().item())
    for actual, leaf in zip((q, k, v), leaves):
        assert relative_error(actual.grad, leaf.grad) < 2 * TOLERANCE[dtype]


def test_long_sequence_float32_with_every_slope_regime():
    """2048 tokens: the steep heads' distant keys underflow to zero, the gentle heads' do not."""
    q, k, v = inputs(1, 16, 2048, 2048, 64, torch.float32)
    slopes = alibi_slopes(16)
    out = alibi_flash_attention(q, k, v, slopes)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected, _ = reference(*leaves, slopes, 64**-0.5, 0)
    expected.backward(grad_out.double())
    assert relative_error(out, expected) < 1e-5
    for actual, leaf in zip((q, k, v), leaves):
        assert relative_error(actual.grad, leaf.grad) < 2e-5


def test_gradcheck_float64():
    q, k, v = [t.double().detach().requires_grad_() for t in inputs(1, 2, 9, 13, 8, torch.float64)]
    slopes = torch.tensor([0.5, 0.0625])
    assert torch.autograd.gradcheck(lambda q, k, v: alibi_flash_attention(q, k, v, slopes, q_offset=4), (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: alibi_flash_attention(q, k, v, slopes, scale=0.7), (q, k, v))


def test_permuted_megatron_layout_is_read_in_place_and_the_output_keeps_it():
    """[sq, b, h, d] tensors permuted to [b, h, sq, d], as the fused Megatron path passes them."""
    q, k, v = (torch.randn(50, 2, 3, 16).permute(1, 2, 0, 3) for _ in range(3))
    slopes = alibi_slopes(3)
    out = alibi_flash_attention(q, k, v, slopes)
    assert out.stride() == q.stride()
    expected, _ = reference(q, k, v, slopes, 0.25, 0)
    assert relative_error(out, expected) < 1e-5
    strided = [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k, v)]  # head_dim not unit-stride
    assert relative_error(alibi_flash_attention(*strided, slopes), expected) < 1e-5


def test_grouped_query_attention_by_repeating_key_and_value():
    q = torch.randn(1, 8, 70, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 70, 16, requires_grad=True) for _ in range(2))
    slopes = alibi_slopes(8)
    out = alibi_flash_attention(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), slopes)
    out.sum().backward()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected, _ = reference(leaves[0], leaves[1].repeat_interleave(4, 1), leaves[2].repeat_interleave(4, 1), slopes,
                            0.25, 0)
    expected.sum().backward()
    assert relative_error(out, expected) < 1e-5
    for actual, leaf in zip((q, k, v), leaves):
        assert relative_error(actual.grad, leaf.grad) < 2e-5


def test_empty_query_block_and_empty_batch():
    q, k, v = inputs(1, 4, 0, 0, 8, torch.float32)
    out = alibi_flash_attention(q, k, v, alibi_slopes(4))
    out.sum().backward()
    assert out.shape == (1, 4, 0, 8) and q.grad.shape == q.shape
    q, k, v = inputs(1, 4, 0, 5, 8, torch.float32)
    alibi_flash_attention(q, k, v, alibi_slopes(4), q_offset=5).sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k))
    q, k, v = inputs(0, 4, 6, 6, 8, torch.float32)
    assert alibi_flash_attention(q, k, v, alibi_slopes(4)).shape == (0, 4, 6, 8)


def test_public_alibi_attention_handles_empty_sequences_in_every_case():
    """issue 12, item 13: [1, 4, 0, 8] used to kill the process with SIGFPE."""
    code = (
        "import torch\n"
        "from ascendspeed.ops import alibi_attention, alibi_slopes\n"
        "x = torch.randn(1, 4, 0, 8)\n"
        "for kwargs in ({}, {'causal': False}, {'dropout_p': 0.1}, {'q_offset': 0}):\n"
        "    assert alibi_attention(x, x, x, alibi_slopes(4), **kwargs).shape == (1, 4, 0, 8)\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    with pytest.raises(ValueError, match="sk=0"):
        alibi_attention(torch.randn(1, 4, 3, 8), torch.randn(1, 4, 0, 8), torch.randn(1, 4, 0, 8), alibi_slopes(4))


# Every route of the block matmuls (ASCENDSPEED_ALIBI_GEMM, block_gemm.h) in one subprocess per route:
# bf16 dot products where the CPU has them (with AVX512-BF16 conversions, and with the portable ones of
# the AVX2 kernels), MKL with bf16 widened to fp32, and the at::addmm fallback of builds without MKL.
GEMM_ROUTES = {
    "auto": {},
    "auto-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "mkl": {"ASCENDSPEED_ALIBI_GEMM": "mkl"},
    "aten": {"ASCENDSPEED_ALIBI_GEMM": "aten"},
}
ROUTE_CASES = [(2, 3, 17, 17, 15, 0), (1, 2, 300, 300, 32, 0), (1, 2, 520, 520, 64, 0), (2, 2, 1, 300, 32, 299),
               (1, 3, 100, 400, 16, 300), (1, 2, 90, 400, 16, 0), (1, 2, 200, 150, 24, 10)]
ROUTE_RUN = """
import sys, torch
from ascendspeed.ops import alibi_slopes
import ascendspeed.ops.alibi_flash_attention  # the operators' autograd
inputs, path = torch.load(sys.argv[1]), sys.argv[2]
results = []
for q, k, v, grad_out, q_offset in inputs:
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = torch.ops.ascendspeed.alibi_flash_attention(q, k, v, alibi_slopes(q.size(1)), q.size(-1) ** -0.5, q_offset)
    out.backward(grad_out)
    results.append([out.detach(), lse, q.grad, k.grad, v.grad])
torch.save([torch.ops.ascendspeed._alibi_flash_attention_cpu_kernel(), results], path)
"""


@pytest.fixture(scope="module")
def gemm_routes(tmp_path_factory):
    """Outputs and gradients of ROUTE_CASES in fp32 and bf16 from each route, on the same inputs."""
    directory = tmp_path_factory.mktemp("alibi_gemm_routes")
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for b, h, sq, sk, d, q_offset in ROUTE_CASES:
            q, k, v = (t.detach() for t in inputs(b, h, sq, sk, d, dtype))
            cases.append((q, k, v, torch.randn(b, h, sq, d).to(dtype), q_offset))
    torch.save(cases, directory / "inputs.pt")
    results = {}
    for route, env in GEMM_ROUTES.items():
        path = directory / f"{route}.pt"
        subprocess.run([sys.executable, "-c", ROUTE_RUN, str(directory / "inputs.pt"), str(path)], check=True,
                       env={**os.environ, **env}, timeout=600)
        results[route] = torch.load(path)
    return cases, results


@pytest.mark.parametrize("route", GEMM_ROUTES)
def test_every_gemm_route_matches_float64(gemm_routes, route):
    cases, results = gemm_routes
    kernel, outputs = results[route]
    for (q, k, v, grad_out, q_offset), (out, lse, grad_q, grad_k, grad_v) in zip(cases, outputs):
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        expected, expected_lse = reference(*leaves, alibi_slopes(q.size(1)), q.size(-1) ** -0.5, q_offset)
        expected.backward(grad_out.double())
        tolerance = TOLERANCE[q.dtype]
        assert relative_error(out, expected) < tolerance, (route, kernel, q.shape)
        assert (lse.double() - expected_lse).abs().max() < 1e-4 * max(1.0, expected_lse.abs().max().item())
        for actual, leaf in zip((grad_q, grad_k, grad_v), leaves):
            assert relative_error(actual, leaf.grad) < 2 * tolerance, (route, kernel, q.shape)


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads the CPU's flags from /proc/cpuinfo")
def test_gemm_routes_are_what_they_say_and_agree(gemm_routes):
    """The default route multiplies bf16 as bf16 exactly on CPUs with bf16 dot-product instructions
    (packed by oneDNN with AMX, interleaved by the kernel with AVX512-BF16 alone), converting with
    AVX512-BF16 where the CPU has it; MKL and at::addmm agree to rounding in fp32, and bf16 products
    agree with the widened route well below bf16's resolution."""
    cases, results = gemm_routes
    kernel, flags = results["auto"][0], cpu_flags()
    assert ("bf16 dot products" in kernel) == bool(flags & {"avx512_bf16", "amx_bf16"}), kernel
    if "bf16 dot products" in kernel:
        assert ("AVX512-BF16 conversions" in kernel) == ("avx512_bf16" in flags), kernel
        assert ("packed by oneDNN" in kernel) == ("amx_bf16" in flags), kernel
    else:
        assert "fp32 (MKL sgemm)" in kernel, kernel
    assert "fp32 (MKL sgemm)" in results["mkl"][0] and "fp32 (at::addmm)" in results["aten"][0]
    for case, mkl, aten, auto in zip(cases, results["mkl"][1], results["aten"][1], results["auto"][1]):
        if case[0].dtype == torch.float32:
            for widened, fallback in zip(mkl, aten):
                torch.testing.assert_close(fallback, widened, rtol=1e-5, atol=1e-6)
        else:
            for widened, products in zip(mkl, auto):
                assert relative_error(products, widened.double()) < 4e-3


def test_bad_arguments_name_the_argument_and_the_fix():
    q = torch.randn(1, 4, 8, 16)
    slopes = alibi_slopes(4)
    op = torch.ops.ascendspeed.alibi_flash_attention
    with pytest.raises(ValueError, match="query must be"):
        op(q[0], q[0], q[0], slopes, 0.25, 0)
    with pytest.raises(TypeError, match="key must have query's dtype"):
        op(q, q.double(), q, slopes, 0.25, 0)
    with pytest.raises(ValueError, match="repeat_interleave"):
        op(q, q[:, :2], q[:, :2], slopes, 0.25, 0)
    with pytest.raises(ValueError, match="same sequence length"):
        op(q, q, q[:, :, :5], slopes, 0.25, 0)
    with pytest.raises(ValueError, match="head_dim"):
        op(q, q[..., :8], q, slopes, 0.25, 0)
    with pytest.raises(ValueError, match="one slope per head"):
        op(q, q, q, alibi_slopes(3), 0.25, 0)
    with pytest.raises(TypeError, match="slopes must be float32"):
        op(q, q, q, slopes.double(), 0.25, 0)
    with pytest.raises(ValueError, match="q_offset"):
        op(q, q, q, slopes, 0.25, -1)
    with pytest.raises(ValueError, match="2\\^24"):
        op(q, q, q, slopes, 0.25, 1 << 24)
    with pytest.raises(ValueError, match="scale must be finite"):
        op(q, q, q, slopes, float("nan"), 0)
    with pytest.raises(TypeError, match="float32, bfloat16, float16 or float64"):
        op(q.int(), q.int(), q.int(), slopes, 0.25, 0)
    out, lse = op(q, q, q, slopes, 0.25, 0)
    with pytest.raises(ValueError, match="logsumexp must be"):
        torch.ops.ascendspeed.alibi_flash_attention_backward(out, q, q, q, out, lse[:, :2], slopes, 0.25, 0)
    with pytest.raises(TypeError, match="logsumexp must be"):
        torch.ops.ascendspeed.alibi_flash_attention_backward(out, q, q, q, out, lse.double(), slopes, 0.25, 0)


def test_meta_tensors_check_arguments_and_give_shapes():
    q = torch.empty(2, 4, 10, 16, device="meta")
    out, lse = torch.ops.ascendspeed.alibi_flash_attention(q, q, q, alibi_slopes(4).to("meta"), 0.25, 0)
    assert out.shape == q.shape and out.device.type == "meta" and lse.shape == (2, 4, 10)
    assert lse.dtype == torch.float32
    with pytest.raises(ValueError, match="one slope per head"):
        torch.ops.ascendspeed.alibi_flash_attention(q, q, q, alibi_slopes(3).to("meta"), 0.25, 0)
    grads = torch.ops.ascendspeed.alibi_flash_attention_backward(q, q, q, q, out, lse, alibi_slopes(4).to("meta"),
                                                                0.25, 0)
    assert all(g.shape == q.shape for g in grads)


def test_opcheck():
    q, k, v = inputs(1, 2, 20, 20, 8, torch.float32)
    torch.library.opcheck(torch.ops.ascendspeed.alibi_flash_attention.default, (q, k, v, alibi_slopes(2), 0.3, 0))
    out, lse = torch.ops.ascendspeed.alibi_flash_attention(q, k, v, alibi_slopes(2), 0.3, 0)
    torch.library.opcheck(
        torch.ops.ascendspeed.alibi_flash_attention_backward.default,
        (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, alibi_slopes(2), 0.3, 0),
    )


def test_compile_fullgraph_keeps_the_operator():
    q, k, v = inputs(1, 2, 40, 40, 16, torch.float32)
    slopes = alibi_slopes(2)
    seen = []

    def backend(graph_module, example_inputs):
        seen.extend(str(node.target) for node in graph_module.graph.nodes)
        return graph_module.forward

    compiled = torch.compile(lambda q, k, v: alibi_flash_attention(q, k, v, slopes), fullgraph=True, backend=backend)
    out = compiled(q, k, v)
    assert any("alibi_flash_attention" in target for target in seen)
    torch.testing.assert_close(out, alibi_flash_attention(q, k, v, slopes))
