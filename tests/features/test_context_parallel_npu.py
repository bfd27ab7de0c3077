"""The NPU path of ring blocks (torch_npu's fused attention), as far as it can be checked without an NPU.

There is no NPU here. What is checked is ascendspeed's side of the contract: the conversions between our
blockwise (output, log-sum-exp) convention and torch_npu's (output, softmax_max, softmax_sum), the ALiBi
``pse`` and the ``atten_mask`` a block hands the kernel, and the whole ring run through
``FusedAttentionKernels`` with kernels written here from torch_npu's documented formula (scores
``(q k^T + pse) * scale``, masked entries -40000, per-row max and sum repeated 8 times; the gradient from
the given max, sum and ``attention_in``). That the real kernels follow that formula is not checked.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from ascendspeed.features.context_parallel import layout
from ascendspeed.features.context_parallel.block_kernels import (
    NPU_SOFTMAX_STATS_WIDTH,
    BlockwiseKernels,
    FlashBlockKernels,
    FusedAttentionKernels,
    alibi_pse,
    hidden_keys,
    kernels_for,
    lse_from_softmax_stats,
    pse_and_mask,
    softmax_stats_from_lse,
)
from ascendspeed.features.context_parallel.blockwise import ScoreRule, block_forward, block_scores
from ascendspeed.features.context_parallel.ring import ring_attention
from ascendspeed.ops.alibi import alibi_slopes
from tests.features.test_context_parallel_attention import SEQ, make_inputs, reference_attention
from tests.helpers.distributed import run_distributed_cases

MASKED_SCORE = -40000.0  # what torch_npu's documented formula adds to a hidden entry


def _documented_scores(query, key, pse, atten_mask, scale):
    """torch_npu's documented scores: (q k^T + pse) * scale, masked entries lowered by 40000."""
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    scores = query.to(acc) @ key.to(acc).transpose(-1, -2)
    if pse is not None:
        scores = scores + pse.to(acc)
    scores = scores * scale
    if atten_mask is not None:
        scores = scores + atten_mask.to(acc) * MASKED_SCORE
    return scores


def documented_fusion_attention(query, key, value, head_num, input_layout, *, pse=None, atten_mask=None,
                                scale=1.0, keep_prob=1.0, sparse_mode=0):
    """``torch_npu.npu_fusion_attention`` by its documented formula and output shapes (the device keeps the
    softmax statistics in fp32; here float64 inputs keep float64 so the glue is checked to 1e-10)."""
    assert (input_layout, keep_prob, sparse_mode) == ("BNSD", 1.0, 0) and head_num == query.size(1)
    assert all(t.is_contiguous() for t in (query, key, value))
    scores = _documented_scores(query, key, pse, atten_mask, scale)
    softmax_max = scores.amax(dim=-1, keepdim=True)
    softmax_sum = torch.exp(scores - softmax_max).sum(dim=-1, keepdim=True)
    out = (torch.exp(scores - softmax_max) / softmax_sum) @ value.to(scores.dtype)
    stats_shape = (*scores.shape[:-1], NPU_SOFTMAX_STATS_WIDTH)
    return (out.to(query.dtype), softmax_max.expand(stats_shape), softmax_sum.expand(stats_shape),
            query.new_empty(0), 0, 0, 0)


def documented_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, atten_mask=None,
                                     softmax_max=None, softmax_sum=None, attention_in=None, scale_value=1.0,
                                     keep_prob=1.0, sparse_mode=0):
    """``torch_npu.npu_fusion_attention_grad`` by the documented backward: probabilities from the given
    softmax max and sum, ``rowsum(dy * attention_in)`` for the softmax gradient."""
    assert (input_layout, keep_prob, sparse_mode) == ("BNSD", 1.0, 0) and head_num == query.size(1)
    assert softmax_max.shape[-1] == softmax_sum.shape[-1] == NPU_SOFTMAX_STATS_WIDTH
    scores = _documented_scores(query, key, pse, atten_mask, scale_value)
    acc = scores.dtype
    probs = torch.exp(scores - softmax_max[..., :1].to(acc)) / softmax_sum[..., :1].to(acc)
    dy, value, attention_in = dy.to(acc), value.to(acc), attention_in.to(acc)
    grad_value = probs.transpose(-1, -2) @ dy
    grad_scores = probs * (dy @ value.transpose(-1, -2) - (dy * attention_in).sum(-1, keepdim=True))
    grad_query = grad_scores @ key.to(acc) * scale_value
    grad_key = grad_scores.transpose(-1, -2) @ query.to(acc) * scale_value
    return (grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype), query.new_empty(0))


DOCUMENTED_KERNELS = FusedAttentionKernels(documented_fusion_attention, documented_fusion_attention_grad)


def _random(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def test_softmax_stats_and_log_sum_exp_convert_both_ways():
    scores = _random(2, 3, 5, 7, seed=1) * 4
    softmax_max = scores.amax(-1, keepdim=True).expand(2, 3, 5, 8)
    softmax_sum = torch.exp(scores - softmax_max[..., :1]).sum(-1, keepdim=True).expand(2, 3, 5, 8)
    lse = lse_from_softmax_stats(softmax_max, softmax_sum)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=0, atol=1e-12)

    back_max, back_sum = softmax_stats_from_lse(lse.float())  # our lse is fp32 for the kernel's dtypes
    assert back_max.shape == back_sum.shape == (2, 3, 5, NPU_SOFTMAX_STATS_WIDTH)
    assert back_max.dtype == back_sum.dtype == torch.float32  # the kernel's statistics dtype
    torch.testing.assert_close(lse_from_softmax_stats(back_max, back_sum), lse.float(), rtol=0, atol=0)
    # the final probabilities come back from (max = lse, sum = 1)
    exact_max, exact_sum = softmax_stats_from_lse(lse)
    probs = torch.exp(scores - exact_max[..., :1]) / exact_sum[..., :1]
    torch.testing.assert_close(probs, scores.softmax(-1), rtol=0, atol=1e-14)

    no_key = torch.tensor([[float("-inf"), 0.5]])
    max_of_no_key, sum_of_no_key = softmax_stats_from_lse(no_key)
    assert max_of_no_key[0, 0].eq(0).all() and sum_of_no_key.eq(1).all()


@pytest.mark.parametrize("causal, symmetric", [(True, None), (False, None), (True, True)])
def test_alibi_pse_and_mask_give_our_block_scores(causal, symmetric):
    """(q k^T + pse) * scale with the atten_mask equals ``block_scores`` (bias after scaling, -inf hidden)."""
    q, k = _random(2, 4, 6, 8, seed=2), _random(2, 4, 5, 8, seed=3)
    q_pos, k_pos = torch.tensor([0, 1, 2, 9, 10, 11]), torch.tensor([2, 3, 9, 10, 12])
    rule = ScoreRule(scale=0.3, causal=causal, slopes=alibi_slopes(4), symmetric_alibi=symmetric)
    mask = torch.rand(2, 1, 6, 16, generator=torch.Generator().manual_seed(4)) < 0.3
    ours = block_scores(q, k, q_pos, k_pos, rule, mask, needs_causal_mask=causal)
    hidden = hidden_keys(q_pos, k_pos, rule, mask, causal, batch=2, device=q.device)
    pse = alibi_pse(q_pos, k_pos, rule, q.dtype, q.device)
    assert pse.shape == (1, 4, 6, 5) and hidden.shape == (2, 1, 6, 5) and hidden.dtype == torch.bool
    theirs = (q @ k.transpose(-1, -2) + pse) * rule.scale
    visible = ~hidden.expand_as(theirs)
    torch.testing.assert_close(theirs[visible], ours[visible], rtol=0, atol=1e-12)
    assert torch.isneginf(ours[~visible]).all()


def test_hidden_keys_layouts():
    q_pos, k_pos = torch.arange(4), torch.arange(4)
    rule = ScoreRule(scale=1.0)
    assert hidden_keys(q_pos, k_pos, rule, None, False, 2, "cpu") is None
    causal = hidden_keys(q_pos, k_pos, rule, None, True, 2, "cpu")
    assert torch.equal(causal, torch.ones(4, 4, dtype=torch.bool).triu(1))  # SS
    per_head = torch.zeros(1, 3, 4, 8, dtype=torch.bool)
    assert hidden_keys(q_pos, k_pos, rule, per_head, True, 2, "cpu").shape == (2, 3, 4, 4)  # 1NSS -> BNSS
    packed = ScoreRule(scale=1.0, segments=torch.tensor([0, 1, 4]))  # two sequences: [0] and [1, 2, 3]
    assert hidden_keys(q_pos, k_pos, packed, None, True, 2, "cpu").tolist() == [
        [False, True, True, True], [True, False, True, True], [True, False, False, True], [True, False, False, False]]


def test_alibi_pse_stays_finite_in_half_precision():
    rule = ScoreRule(scale=64 ** -0.5, causal=True, slopes=alibi_slopes(2))
    pse = alibi_pse(torch.tensor([40000]), torch.arange(3), rule, torch.float16, "cpu")
    assert pse.dtype == torch.float16 and torch.isfinite(pse).all()
    future = alibi_pse(torch.tensor([0]), torch.tensor([40000]), rule, torch.float16, "cpu")
    assert torch.isfinite(future).all()


def test_hidden_entries_get_no_alibi():
    """Keys after a query get a positive ALiBi term; a finite additive mask must not be outweighed."""
    q = torch.zeros(2, 2, 3, 4)
    rule = ScoreRule(scale=0.5, causal=True, slopes=alibi_slopes(2))
    pse, hidden = pse_and_mask(q, torch.arange(3), torch.arange(3), rule, None, needs_causal_mask=True)
    assert pse.shape == (1, 2, 3, 3) and torch.equal(hidden, torch.ones(3, 3, dtype=torch.bool).triu(1))
    assert pse[..., hidden].eq(0).all() and pse[..., ~hidden].le(0).all()


def test_cpu_tensors_use_the_flash_kernel_and_dropout_the_blockwise_code():
    assert kernels_for(torch.zeros(1, 1, 2, 4)) is FlashBlockKernels
    assert kernels_for(torch.zeros(1, 1, 2, 4, dtype=torch.bfloat16)) is FlashBlockKernels
    assert kernels_for(torch.zeros(1, 1, 2, 4), with_dropout=True) is BlockwiseKernels


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("with_alibi", [False, True])
def test_one_block_through_the_documented_kernel_matches_blockwise(causal, with_alibi):
    q, k, v = (_random(2, 4, 6, 8, seed=seed) for seed in (5, 6, 7))
    q_pos, k_pos = torch.arange(6, 12), torch.arange(6)
    rule = ScoreRule(scale=8 ** -0.5, causal=causal, slopes=alibi_slopes(4) if with_alibi else None)
    expected_out, expected_lse = block_forward(q, k, v, q_pos, k_pos, rule, needs_causal_mask=False)
    out, lse = DOCUMENTED_KERNELS.forward(q, k, v, q_pos, k_pos, rule, needs_causal_mask=False)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=1e-12)


def _ring_through_documented_kernels(rank, world_size, dtype):
    positions = [layout.positions_on_rank(SEQ, r, world_size) for r in range(world_size)]
    errors = {}
    for index, (causal, with_alibi) in enumerate([(True, False), (True, True), (False, False), (False, True)]):
        q, k, v, grad, mask = make_inputs(seed=300 + index)
        mask = None if causal else mask
        slopes = alibi_slopes(q.size(1)) if with_alibi else None
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = reference_attention(*full, causal, slopes, mask)
        expected_grads = torch.autograd.grad(expected, full, grad)

        def share(t):
            return layout.split_for_rank(t, 2, rank, world_size)

        local = [share(t).to(dtype).requires_grad_() for t in (q, k, v)]
        local_mask = None if mask is None else mask[:, :, positions[rank], :]
        out = ring_attention(*local, positions, group=dist.group.WORLD, causal=causal, slopes=slopes,
                             mask=local_mask, kernels=DOCUMENTED_KERNELS)
        grads = torch.autograd.grad(out, local, share(grad).to(dtype))
        errors[(causal, with_alibi)] = max(
            (actual.double() - share(reference)).norm().item() / share(reference).norm().item()
            for actual, reference in zip([out, *grads], [expected, *expected_grads])
        )
    return errors


RING_DTYPES = [(torch.float64, 1e-10), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


@functools.cache
def _ring_errors() -> dict:
    """Every dtype in one 2-rank job: {dtype: per-rank errors}."""
    dtypes = [dtype for dtype, _ in RING_DTYPES]
    return dict(zip(dtypes, run_distributed_cases(_ring_through_documented_kernels, 2, [(d,) for d in dtypes])))


@pytest.mark.parametrize("dtype, tolerance", RING_DTYPES)
def test_ring_through_the_documented_kernels_matches_single_process_attention(dtype, tolerance):
    """cp = 2: diagonal (causal mask), earlier- and later-rank blocks, merged from the kernel's max and sum;
    the backward hands the kernel the final log-sum-exp as (max, sum) and the final output."""
    for rank, errors in enumerate(_ring_errors()[dtype]):
        for case, error in errors.items():
            assert error < tolerance, f"rank {rank} causal, alibi = {case}: relative error {error:.2e}"
