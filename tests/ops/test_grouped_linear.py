"""The grouped linear operator against one torch matmul per group on ``torch.split`` pieces (bit for bit, forward
and backward: the same products on the same memory and threads) and against a float64 formula (fp32 / bf16 / fp16).

One ``sample_inputs`` feeds every test: fresh random tokens, weights and biases each run; groups of 1 to 16
experts with random row counts, empty groups included (an expert no token was routed to); with and without
bias; tokens in fp32 / bf16 / fp16 / fp64.
"""
import contextlib
import dataclasses
from typing import Optional

import pytest
import torch

from ascendspeed.ops.grouped_linear import grouped_linear, grouped_linear_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
#: Relative error to the float64 formula: the dtype's rounding of the inputs and the output, sums in float.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float64: 1e-12}


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    weights: list
    biases: Optional[list]
    m_splits: list

    def leaves(self):
        """Fresh leaves requiring grad: x, the weights, the biases (empty without)."""
        copy = [t.detach().clone().requires_grad_(True) for t in [self.x, *self.weights, *(self.biases or [])]]
        groups = len(self.weights)
        return copy[0], copy[1:1 + groups], copy[1 + groups:] or None

    def __repr__(self):
        return (f"groups{len(self.weights)}-rows{self.m_splits}-in{self.x.size(-1)}-out{self.weights[0].size(0)}"
                f"-{'bias' if self.biases else 'nobias'}-{self.x.dtype}")


def sample_inputs(dtypes=DTYPES):
    for dtype in dtypes:
        for groups, rows, in_features, out_features in [(1, 5, 3, 4), (4, 64, 16, 24), (16, 300, 32, 8), (3, 0, 5, 7)]:
            splits = torch.randint(groups, (rows,)).bincount(minlength=groups)
            if groups > 2 and rows:
                splits[1] += splits[0]
                splits[0] = 0  # an expert without tokens
            for bias in (False, True):
                x = torch.randn(rows, in_features, dtype=torch.float64).to(dtype)
                weights = [(torch.randn(out_features, in_features, dtype=torch.float64) * in_features ** -0.5).to(dtype)
                           for _ in range(groups)]
                biases = [torch.randn(out_features, dtype=torch.float64).to(dtype) for _ in range(groups)] if bias \
                    else None
                yield Sample(x, weights, biases, splits.tolist())


def _forward_backward(fn, sample, grad=None):
    x, weights, biases = sample.leaves()
    out = fn(x, weights, sample.m_splits, biases)
    grad = torch.randn_like(out) if grad is None else grad
    out.backward(grad)
    return out.detach(), [t.grad for t in [x, *weights, *(biases or [])]], grad


@contextlib.contextmanager
def _threads_of_each_product(groups: int):
    """The threads each of the kernel's matmuls runs on: one where it divides the groups over the threads (at
    least as many groups as threads), all of them otherwise. A matmul's rounding can depend on its threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if 1 < threads <= groups else threads)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_equals_one_matmul_per_group_bit_for_bit():
    for sample in sample_inputs():
        out, grads, grad = _forward_backward(grouped_linear, sample)
        with _threads_of_each_product(len(sample.weights)):
            expected, expected_grads, _ = _forward_backward(grouped_linear_reference, sample, grad)
        assert torch.equal(out, expected), sample
        for index, (actual, reference) in enumerate(zip(grads, expected_grads)):
            assert torch.equal(actual, reference), f"{sample}: gradient {index}"


def test_equals_the_float64_formula():
    def formula(x, weights, m_splits, biases):
        w = torch.stack(weights).double()
        group = torch.repeat_interleave(torch.arange(len(weights)), torch.tensor(m_splits, dtype=torch.long))
        out = torch.einsum("ti,toi->to", x.double(), w[group])
        return out if biases is None else out + torch.stack(biases).double()[group]

    for sample in sample_inputs():
        out, grads, grad = _forward_backward(grouped_linear, sample)
        expected, expected_grads, _ = _forward_backward(formula, sample, grad.double())
        tolerance = TOLERANCE[sample.x.dtype]
        for actual, reference in zip([out, *grads], [expected, *expected_grads]):
            if reference.numel() == 0:
                continue
            scale = reference.abs().max().clamp_min(1.0)
            assert ((actual.double() - reference).abs().max() / scale).item() <= tolerance, sample


def test_gradcheck_float64():
    for sample in sample_inputs([torch.float64]):
        if sample.x.numel() == 0 or sample.x.size(0) > 100:
            continue
        x, weights, biases = sample.leaves()
        groups = len(weights)

        def fn(x, *params):
            return grouped_linear(x, params[:groups], sample.m_splits, params[groups:] or None)

        assert torch.autograd.gradcheck(fn, (x, *weights, *(biases or [])), fast_mode=True), sample


def test_opcheck():
    """torch.library's consistency checks: schema, fake kernels, autograd registration."""
    for sample in list(sample_inputs([torch.float32]))[:4]:
        x, weights, biases = sample.leaves()
        torch.library.opcheck(torch.ops.ascendspeed.grouped_linear.default, (x, weights, biases or [], sample.m_splits))


def test_compiles_without_graph_breaks():
    sample = list(sample_inputs([torch.float32]))[3]

    def layer(x, weights, biases):
        return grouped_linear(torch.relu(x), weights, sample.m_splits, biases) * 2

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(sample.x, sample.weights, sample.biases),
                               layer(sample.x, sample.weights, sample.biases), rtol=0, atol=0)


def test_leading_dimensions_are_rows():
    x = torch.randn(3, 4, 5)
    weights = [torch.randn(6, 5), torch.randn(6, 5)]
    out = grouped_linear(x, weights, [7, 5])
    assert out.shape == (3, 4, 6)
    assert torch.equal(out.view(12, 6), grouped_linear(x.view(12, 5), weights, [7, 5]))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_bad_inputs_name_the_argument(device):
    def t(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=device)

    op = torch.ops.ascendspeed.grouped_linear
    with pytest.raises(ValueError, match="m_splits must give one row count per group \\(2 groups\\), got 1"):
        op(t(4, 3), [t(5, 3), t(5, 3)], [], [4])
    with pytest.raises(ValueError, match="m_splits sums to 3 rows but x has 4 rows"):
        op(t(4, 3), [t(5, 3), t(5, 3)], [], [1, 2])
    with pytest.raises(ValueError, match="m_splits\\[0\\] = -1 is negative"):
        op(t(4, 3), [t(5, 3), t(5, 3)], [], [-1, 5])
    with pytest.raises(ValueError, match="x has 3 features, the weights take 2"):
        op(t(4, 3), [t(5, 2)], [], [4])
    with pytest.raises(ValueError, match="every group's weight must have weights\\[0\\]'s shape"):
        op(t(4, 3), [t(5, 3), t(6, 3)], [], [2, 2])
    with pytest.raises(TypeError, match="weights\\[1\\] is BFloat16, the input is Float; cast them to one dtype"):
        op(t(4, 3), [t(5, 3), t(5, 3, dtype=torch.bfloat16)], [], [2, 2])
    with pytest.raises(ValueError, match="biases must be empty \\(no bias\\) or one per group \\(2\\), got 1"):
        op(t(4, 3), [t(5, 3), t(5, 3)], [t(5)], [2, 2])
    with pytest.raises(TypeError, match="x must be float32, float64, bfloat16 or float16, got Long"):
        op(t(4, 3, dtype=torch.long), [t(5, 3, dtype=torch.long)], [], [4])
    with pytest.raises(ValueError, match="weights must hold at least one group's weight"):
        op(t(4, 3), [], [], [])
