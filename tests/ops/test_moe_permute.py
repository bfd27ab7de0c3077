"""The MoE permutation operators against megatron-core's own unfused ``permute`` / ``unpermute`` /
``sort_chunks_by_idxs`` (``fused=False``, the installed release), bit for bit, forward and backward, and
against a dense float64 formula.

One ``sample_inputs`` feeds every test: fresh random routings each run (top-k per token; with token dropping,
some routes removed; capacity-padded, every expert exactly ``capacity`` tokens), tokens in fp32 / bf16 / fp16
/ fp64, probs in fp32 (Megatron's router dtype) or the tokens' dtype, rows of 1 to 130 features.
"""
import dataclasses
import textwrap

import pytest
import torch

from ascendspeed.ops.moe_permute import permute_tokens, sort_chunks, unpermute_tokens
from tests.helpers.isa import assert_vectorized_and_multi_threaded, check_under_isa

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@dataclasses.dataclass
class Sample:
    tokens: torch.Tensor
    routing_map: torch.Tensor
    probs: torch.Tensor
    kind: str

    @property
    def routed(self) -> int:
        return int(self.routing_map.sum())

    def __repr__(self):
        t, e = self.routing_map.shape
        return f"{self.kind}-T{t}-E{e}-H{self.tokens.size(1)}-{self.tokens.dtype}-probs:{self.probs.dtype}"


def _routing(num_tokens, experts, topk, kind):
    scores = torch.rand(num_tokens, experts)
    if kind == "padded":  # --moe-pad-expert-input-to-capacity: every expert takes its `capacity` best tokens
        capacity = max(1, num_tokens * topk // experts)
        top = scores.topk(capacity, dim=0).indices
        return torch.zeros(num_tokens, experts, dtype=torch.bool).scatter_(0, top, True)
    routing = torch.zeros(num_tokens, experts, dtype=torch.bool).scatter_(1, scores.topk(topk, -1).indices, True)
    if kind == "dropped":  # a capacity factor below 1 without padding: some routes removed
        routing &= torch.rand(num_tokens, experts) > 0.3
    return routing


def sample_inputs(dtypes=DTYPES):
    for dtype in dtypes:
        for probs_dtype in dict.fromkeys([torch.float32, dtype]):
            for (num_tokens, experts, topk, hidden), kind in [
                ((7, 4, 2, 5), "topk"), ((64, 8, 2, 32), "dropped"), ((300, 16, 4, 130), "topk"),
                ((33, 3, 1, 1), "padded"), ((48, 8, 2, 24), "padded"),
            ]:
                tokens = torch.randn(num_tokens, hidden, dtype=torch.float64).to(dtype)
                probs = torch.softmax(torch.randn(num_tokens, experts, dtype=torch.float64), -1).to(probs_dtype)
                yield Sample(tokens, _routing(num_tokens, experts, topk, kind), probs, kind)


def _megatron_permute(sample, tokens, probs, fused=False):
    from megatron.core.transformer.moe.moe_utils import permute

    out = permute(tokens, sample.routing_map, probs=probs, num_out_tokens=sample.routed, fused=fused,
                  drop_and_pad=sample.kind == "padded")
    return out[0], out[1], out[2]


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


@pytest.mark.parametrize("with_probs", [False, True], ids=["tokens", "tokens+probs"])
def test_permute_equals_megatron_bit_for_bit(with_probs):
    for sample in sample_inputs():
        x, x_ref = _leaf(sample.tokens), _leaf(sample.tokens)
        p, p_ref = (_leaf(sample.probs), _leaf(sample.probs)) if with_probs else (None, None)
        permuted, permuted_probs, _ = permute_tokens(x, sample.routing_map, p, sample.routed)
        expected, expected_probs, _ = _megatron_permute(sample, x_ref, p_ref)
        assert torch.equal(permuted, expected), sample
        grad = torch.randn_like(expected)
        loss, loss_ref = (permuted * grad).sum(), (expected * grad).sum()
        if with_probs:
            assert torch.equal(permuted_probs, expected_probs), sample
            grad_probs = torch.randn_like(expected_probs)
            loss, loss_ref = loss + (permuted_probs * grad_probs).sum(), loss_ref + (expected_probs * grad_probs).sum()
        loss.backward()
        loss_ref.backward()
        assert torch.equal(x.grad, x_ref.grad), sample
        if with_probs:
            assert torch.equal(p.grad, p_ref.grad), sample


@pytest.mark.parametrize("with_probs", [False, True], ids=["tokens", "tokens+probs"])
def test_unpermute_equals_megatron_bit_for_bit(with_probs):
    """Expert outputs back to their tokens, with megatron-core's own row map and ours."""
    from megatron.core.transformer.moe.moe_utils import unpermute

    for sample in sample_inputs():
        _, _, row_id_map = permute_tokens(sample.tokens, sample.routing_map, None, sample.routed)
        _, _, sorted_indices = _megatron_permute(sample, sample.tokens, None)
        rows = torch.randn(sample.routed, sample.tokens.size(1), dtype=torch.float64).to(sample.tokens.dtype)
        y, y_ref = _leaf(rows), _leaf(rows)
        p, p_ref = (_leaf(sample.probs), _leaf(sample.probs)) if with_probs else (None, None)
        out = unpermute_tokens(y, row_id_map, sample.tokens.size(0), p)
        expected = unpermute(y_ref, sorted_indices, sample.tokens.shape, probs=p_ref, routing_map=sample.routing_map,
                             drop_and_pad=sample.kind == "padded")
        assert out.dtype == expected.dtype and torch.equal(out, expected), sample
        grad = torch.randn_like(expected)
        (out * grad).sum().backward()
        (expected * grad).sum().backward()
        assert torch.equal(y.grad, y_ref.grad), sample
        if with_probs:
            assert torch.equal(p.grad, p_ref.grad), sample


def test_round_trip_equals_the_float64_formula():
    """unpermute(expert(permute(x)), probs) = sum over routed e of probs[t, e] * expert_e(x[t]), with expert_e
    scaling by e + 1; computed here densely in float64."""
    for sample in sample_inputs([torch.float64]):
        x, p = _leaf(sample.tokens), _leaf(sample.probs)
        permuted, _, row_id_map = permute_tokens(x, sample.routing_map, None, sample.routed)
        scale = (row_id_map // x.size(0) + 1).to(x.dtype).unsqueeze(-1)
        out = unpermute_tokens(permuted * scale, row_id_map, x.size(0), p)
        weights = sample.routing_map.to(x.dtype) * p * torch.arange(1, p.size(1) + 1, dtype=x.dtype)
        expected = weights.sum(-1, keepdim=True) * x
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
        grad = torch.randn_like(out)
        got = torch.autograd.grad((out * grad).sum(), (x, p))
        want = torch.autograd.grad((expected * grad).sum(), (x, p))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_sort_chunks_equals_megatron_bit_for_bit():
    """The alltoall dispatcher's regrouping: chunks of rows (some empty) in a random order, with probs."""
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    for dtype in DTYPES:
        for chunks, hidden in [(1, 3), (4, 16), (12, 33)]:
            split_sizes = torch.randint(0, 6, (chunks,))
            order = torch.randperm(chunks)
            rows = int(split_sizes.sum())
            x, x_ref = _leaf(torch.randn(rows, hidden).to(dtype)), _leaf(torch.randn(rows, hidden).to(dtype))
            x_ref.data.copy_(x.data)
            p, p_ref = _leaf(torch.rand(rows)), None
            p_ref = _leaf(p.detach())
            out, out_probs = sort_chunks(x, split_sizes, order, p)
            expected, expected_probs = sort_chunks_by_idxs(x_ref, split_sizes, order, probs=p_ref)
            assert torch.equal(out, expected) and torch.equal(out_probs, expected_probs)
            grad, grad_probs = torch.randn_like(out), torch.randn_like(out_probs)
            ((out * grad).sum() + (out_probs * grad_probs).sum()).backward()
            ((expected * grad).sum() + (expected_probs * grad_probs).sum()).backward()
            assert torch.equal(x.grad, x_ref.grad) and torch.equal(p.grad, p_ref.grad)


def test_kernels_are_vectorized_and_multi_threaded():
    assert_vectorized_and_multi_threaded(torch.ops.ascendspeed._moe_permute_cpu_kernel(), torch.ops.ascendspeed._swiglu_cpu_kernel())


ISA_CHECK = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from ops import test_moe_permute as t
    isa = torch.ops.ascendspeed._moe_permute_cpu_kernel().split(",")[0]
    if isa != {isa!r}:
        print("unsupported", isa)
        raise SystemExit(0)
    for with_probs in (False, True):
        t.test_permute_equals_megatron_bit_for_bit(with_probs)
        t.test_unpermute_equals_megatron_bit_for_bit(with_probs)
    print("ok", isa)
    """
)


@pytest.mark.parametrize("isa", ["DEFAULT", "AVX2"])
def test_narrower_instruction_sets(isa):
    """The kernels built for older CPUs give Megatron's bits too (torch picks them via ATEN_CPU_CAPABILITY)."""
    check_under_isa(ISA_CHECK, isa)


def test_gradcheck_float64():
    samples = [s for s in sample_inputs([torch.float64]) if s.probs.dtype == torch.float64 and s.tokens.numel() < 2000]
    for sample in samples:
        _, _, row_id_map = permute_tokens(sample.tokens, sample.routing_map, None, sample.routed)
        rows = torch.randn(sample.routed, sample.tokens.size(1), dtype=torch.float64, requires_grad=True)
        x, p = _leaf(sample.tokens), _leaf(sample.probs)
        t = x.size(0)
        assert torch.autograd.gradcheck(lambda y, q: torch.ops.ascendspeed.moe_scatter_add(y, row_id_map, q, t),
                                        (rows, p), fast_mode=True)
        assert torch.autograd.gradcheck(lambda z, q: torch.ops.ascendspeed.moe_gather(z, row_id_map, q), (x, p),
                                        fast_mode=True)


def test_opcheck():
    """torch.library's consistency checks: schema, fake kernels, autograd registration."""
    for sample in list(sample_inputs([torch.float32]))[:3]:
        routed = sample.routed
        torch.library.opcheck(torch.ops.ascendspeed.moe_permute_index.default, (sample.routing_map, routed))
        row_id_map = torch.ops.ascendspeed.moe_permute_index(sample.routing_map, routed)
        x, p = _leaf(sample.tokens), _leaf(sample.probs)
        torch.library.opcheck(torch.ops.ascendspeed.moe_gather.default, (x, row_id_map, None))
        torch.library.opcheck(torch.ops.ascendspeed.moe_gather.default, (x, row_id_map, p))
        rows = torch.randn(routed, x.size(1), requires_grad=True)
        torch.library.opcheck(torch.ops.ascendspeed.moe_scatter_add.default, (rows, row_id_map, p, x.size(0)))
    split_sizes, order = torch.tensor([2, 0, 3]), torch.tensor([2, 0, 1])
    torch.library.opcheck(torch.ops.ascendspeed.moe_sort_chunks.default,
                          (torch.randn(5, 4, requires_grad=True), split_sizes, order))


def test_compiles_without_graph_breaks():
    sample = next(sample_inputs([torch.float32]))

    def layer(tokens, probs, row_id_map):
        permuted = torch.ops.ascendspeed.moe_gather(tokens, row_id_map, None)
        return torch.ops.ascendspeed.moe_scatter_add(permuted * 2, row_id_map, probs, tokens.size(0))

    row_id_map = torch.ops.ascendspeed.moe_permute_index(sample.routing_map, sample.routed)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(sample.tokens, sample.probs, row_id_map),
                               layer(sample.tokens, sample.probs, row_id_map), rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_bad_inputs_name_the_argument(device):
    routing = torch.zeros(4, 3, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match="routing_map must be \\[num_tokens, num_experts\\]"):
        torch.ops.ascendspeed.moe_permute_index(routing[0], 1)
    with pytest.raises(TypeError, match="routing_map must be bool or an integer type"):
        torch.ops.ascendspeed.moe_permute_index(routing.float(), 1)
    rows = torch.zeros(3, dtype=torch.long, device=device)
    with pytest.raises(TypeError, match="x must be float32, float64, bfloat16 or float16, got Long"):
        torch.ops.ascendspeed.moe_gather(torch.zeros(4, 2, dtype=torch.long, device=device), rows)
    with pytest.raises(ValueError, match="probs must be \\[num_tokens, num_experts\\] with num_tokens = 4"):
        torch.ops.ascendspeed.moe_gather(torch.zeros(4, 2, device=device), rows, torch.zeros(5, 3, device=device))
    with pytest.raises(ValueError, match="row_id_map must be the 1-d int64 tensor moe_permute_index returns"):
        torch.ops.ascendspeed.moe_scatter_add(torch.zeros(3, 2, device=device), rows.int(), None, 4)


def test_bad_values_name_the_argument():
    routing = torch.tensor([[True, False], [True, True]])
    with pytest.raises(ValueError, match="num_out_tokens = 4 is more than the 3 \\(token, expert\\) pairs"):
        torch.ops.ascendspeed.moe_permute_index(routing, 4)
    with pytest.raises(IndexError, match="row_id_map\\[1\\] = 9 is not a row of 2 tokens and the experts of probs"):
        torch.ops.ascendspeed.moe_scatter_add(torch.zeros(2, 3), torch.tensor([0, 9]), torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="y must have one row per entry of row_id_map \\(2\\), got 3"):
        torch.ops.ascendspeed.moe_scatter_add(torch.zeros(3, 3), torch.tensor([0, 1]), None, 2)
    with pytest.raises(ValueError, match="split_sizes must add up to x.size\\(0\\) = 5, got 4"):
        torch.ops.ascendspeed.moe_sort_chunks(torch.zeros(5, 2), torch.tensor([2, 2]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="sorted_idxs must be a permutation of 0..1"):
        torch.ops.ascendspeed.moe_sort_chunks(torch.zeros(4, 2), torch.tensor([2, 2]), torch.tensor([1, 1]))
