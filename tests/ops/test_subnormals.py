"""Flush-to-zero of subnormal numbers on every intra-op thread, and around a backward pass."""
import pytest
import torch

from ascendspeed.ops.subnormals import flush_subnormals_in_backward, flushing_subnormals

pytestmark = pytest.mark.megatron_independent  # one release covers it: .ci/run runs it on the newest only

TINY = torch.finfo(torch.float32).tiny  # the smallest normal fp32 number, 1.2e-38


def states():
    """The mode of the calling thread, then of each thread of torch's intra-op pool."""
    return list(torch.ops.ascendspeed._flush_subnormals_states())


def count_subnormals(t: torch.Tensor) -> int:
    t = t.float()
    return int(((t != 0) & (t.abs() < TINY)).sum())


def alibi_like_scores(rows=64, keys=2048):
    """Scores whose softmax has many subnormal probabilities, as ALiBi gives distant keys."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows, keys, generator=generator) - 0.06 * torch.arange(keys, 0, -1, dtype=torch.float32)


@pytest.fixture
def threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(previous)
    torch.ops.ascendspeed.set_flush_subnormals(False)


def test_mode_is_set_on_every_thread_and_reported_back(threads):
    torch.ops.ascendspeed.set_flush_subnormals(False)
    assert states() == [False] * 4
    assert torch.ops.ascendspeed.set_flush_subnormals(True) is False
    assert states() == [True] * 4
    assert torch.ops.ascendspeed.set_flush_subnormals(False) is True
    assert states() == [False] * 4


def test_softmax_inside_the_block_has_no_subnormals(threads):
    scores = alibi_like_scores()
    plain = torch.softmax(scores, dim=-1)
    assert count_subnormals(plain) > 1000, "the test data must produce subnormal probabilities"
    with flushing_subnormals(scores.device):
        assert states() == [True] * 4
        flushed = torch.softmax(scores, dim=-1)
    assert states() == [False] * 4
    assert count_subnormals(flushed) == 0
    assert torch.equal(flushed[plain >= TINY], plain[plain >= TINY])
    assert (flushed[plain < TINY] == 0).all()


def test_an_outer_mode_is_restored(threads):
    torch.ops.ascendspeed.set_flush_subnormals(True)
    with flushing_subnormals(torch.device("cpu")):
        pass
    assert states() == [True] * 4


def test_backward_between_output_and_input_is_flushed_and_the_mode_restored(threads):
    scores = alibi_like_scores().requires_grad_()
    grad_out = torch.randn(scores.shape, generator=torch.Generator().manual_seed(1))

    expected_probs = torch.softmax(scores.detach().double(), dim=-1)
    expected_grad = expected_probs * (grad_out.double() - (grad_out.double() * expected_probs).sum(-1, keepdim=True))
    plain_grad, = torch.autograd.grad(torch.softmax(scores, dim=-1), scores, grad_out)
    assert count_subnormals(plain_grad) > 100, "the test data must produce subnormal gradients"

    biased = scores * 1.0  # the "input" of the flushed region, as ALiBi's biased scores are
    with flushing_subnormals(scores.device):
        probs = torch.softmax(biased, dim=-1)
    flush_subnormals_in_backward(probs, biased)
    seen = []
    probs.register_hook(lambda grad: seen.append(states()))  # runs after the switch: hooks run in order
    grad, = torch.autograd.grad(probs, scores, grad_out)

    assert seen == [[True] * 4]
    assert states() == [False] * 4
    assert count_subnormals(grad) == 0
    # Flushing changes each gradient entry by less than the smallest normal number.
    assert (grad.double() - expected_grad).abs().max() <= (plain_grad.double() - expected_grad).abs().max() + TINY


def test_other_devices_and_tensors_without_grad_are_left_alone(threads):
    meta = torch.empty(3, device="meta")
    with flushing_subnormals(meta.device):
        assert states() == [False] * 4
    flush_subnormals_in_backward(torch.ones(3), torch.ones(3))  # nothing requires grad: no hooks to add
    assert states() == [False] * 4
