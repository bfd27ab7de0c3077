"""Context-parallel attention (ring, Ulysses, hybrid) against single-process attention, float64, real gloo ranks.

Every rank builds the same full q, k, v, computes the single-process reference on the whole sequence, then
runs the algorithm on its balanced share and compares its share of the output and of dq, dk, dv.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from ascendspeed.features.context_parallel import layout
from ascendspeed.features.context_parallel.block_kernels import BlockwiseKernels, FlashBlockKernels, causal_sub_blocks
from ascendspeed.features.context_parallel.blockwise import ScoreRule, block_forward, merge_block_
from ascendspeed.features.context_parallel.dropout import PositionalDropout
from ascendspeed.features.context_parallel.hybrid import build_hybrid_groups, hybrid_attention
from ascendspeed.features.context_parallel.ring import plan_block, ring_attention
from ascendspeed.features.context_parallel.ulysses import local_core_attention, ulysses_attention
from ascendspeed.ops.alibi import alibi_slopes
from tests.helpers.distributed import run_distributed, run_distributed_cases

BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 16, 8
TOLERANCE = 1e-10
DROPOUT = 0.3
#: (mask, position embedding, attention dropout probability); "packed": causal within each sequence of a pack,
#: "bidirectional pack": every sequence of a pack attends to itself whole
MASKS = ("causal", "general", "packed", "bidirectional pack")
CASES = [(mask, position, 0.0) for mask in MASKS for position in ("none", "alibi", "rope")]
CASES += [("causal", "none", DROPOUT), ("causal", "alibi", DROPOUT), ("general", "rope", DROPOUT),
          ("packed", "rope", DROPOUT), ("bidirectional pack", "alibi", DROPOUT)]
#: per context-parallel size, a pack's sequence bounds over the SEQ tokens (each a multiple of 2 x cp, one empty)
PACKS = {2: torch.tensor([0, 4, 12, 12, 16]), 4: torch.tensor([0, 8, 8, 16])}


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of [b, h, s, d] at absolute ``positions`` (rotate-half form)."""
    half = x.size(-1) // 2
    inverse_frequency = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = positions.to(torch.float64)[:, None] * inverse_frequency[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def reference_attention(q, k, v, causal, slopes, mask, dropout=None, segments=None):
    """softmax(q k^T / sqrt(d) + alibi, masked) v over the whole sequence, plain float64 autograd; with
    ``dropout`` the probabilities are multiplied by its mask over the whole sequence; with ``segments`` (the
    bounds of a pack's sequences) a key of another sequence is hidden."""
    seq = q.size(2)
    scores = q @ k.transpose(-1, -2) / q.size(-1) ** 0.5
    distance = (torch.arange(seq)[:, None] - torch.arange(seq)[None, :]).to(q.dtype)
    if slopes is not None:
        scores = scores - slopes.to(q.dtype)[:, None, None] * (distance if causal else distance.abs())
    hidden = distance < 0 if causal else torch.zeros(seq, seq, dtype=torch.bool)
    if mask is not None:
        hidden = hidden | mask
    if segments is not None:
        sequence = torch.bucketize(torch.arange(seq), segments[1:], right=True)
        hidden = hidden | (sequence[:, None] != sequence[None, :])
    probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
    if dropout is not None:
        positions = torch.arange(seq)
        probs = probs * dropout.keep_scale(q.size(0), positions, positions, q.dtype, q.device)
    return probs @ v


def make_inputs(seed: int):
    generator = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, dtype=torch.float64, generator=generator)
                     for _ in range(4))
    # A general mask: random, each query sees at least itself (a row hiding every key has no softmax).
    mask = torch.rand(BATCH, 1, SEQ, SEQ, generator=generator) < 0.4
    mask &= ~torch.eye(SEQ, dtype=torch.bool)
    return q, k, v, grad, mask


def _attention_errors(rank, world_size, algorithm, ulysses_degree):
    group = dist.group.WORLD
    pack = PACKS[world_size]
    hybrid_groups = build_hybrid_groups(list(range(world_size)), ulysses_degree) if algorithm == "hybrid" else None
    errors = {}
    for case_index, (mask_type, position_type, dropout_p) in enumerate(CASES):
        q, k, v, grad, mask = make_inputs(seed=100 + case_index)
        causal = mask_type in ("causal", "packed")
        mask = mask if mask_type == "general" else None
        segments = pack if mask_type in ("packed", "bidirectional pack") else None
        if segments is None:
            positions = [layout.positions_on_rank(SEQ, r, world_size) for r in range(world_size)]
            rope_positions = torch.arange(SEQ)
        else:
            positions = [layout.packed_positions_on_rank(segments, r, world_size) for r in range(world_size)]
            rope_positions = torch.arange(SEQ) - segments[layout.segment_ids(torch.arange(SEQ), segments)]
        mine = positions[rank]

        def share(t):
            return t.index_select(2, mine)

        slopes = alibi_slopes(HEADS) if position_type == "alibi" else None
        dropout = PositionalDropout.for_heads(dropout_p, seed=7919 * case_index, heads=HEADS) if dropout_p else None

        full = [t.clone().requires_grad_() for t in (q, k, v)]
        fq, fk, fv = full
        if position_type == "rope":
            fq, fk = rope(fq, rope_positions), rope(fk, rope_positions)
        expected_out = reference_attention(fq, fk, fv, causal, slopes, mask, dropout, segments)
        expected_grads = torch.autograd.grad(expected_out, full, grad)

        local = [share(t).requires_grad_() for t in (q, k, v)]
        lq, lk, lv = local
        if position_type == "rope":
            lq, lk = rope(lq, rope_positions[mine]), rope(lk, rope_positions[mine])
        local_mask = None if mask is None else mask[:, :, mine, :]
        if algorithm == "ring":
            out = ring_attention(lq, lk, lv, positions, group=group, causal=causal, slopes=slopes, mask=local_mask,
                                 dropout=dropout, segments=segments)
        elif algorithm == "ulysses":
            out = ulysses_attention(lq, lk, lv, positions, group=group,
                                    core=local_core_attention(causal, segments=segments), slopes=slopes,
                                    mask=local_mask, dropout=dropout)
        else:
            out = hybrid_attention(lq, lk, lv, positions, hybrid_groups, causal=causal, slopes=slopes,
                                   mask=local_mask, dropout=dropout, segments=segments)
        grads = torch.autograd.grad(out, local, share(grad))
        errors[(mask_type, position_type, dropout_p)] = max(
            [(out - share(expected_out)).abs().max().item()]
            + [(g - share(e)).abs().max().item() for g, e in zip(grads, expected_grads)]
        )
    return errors


ALGORITHMS = [("ring", 2, 1), ("ring", 4, 1), ("ulysses", 2, 2), ("ulysses", 4, 4), ("hybrid", 2, 2), ("hybrid", 4, 2)]


@functools.cache
def _attention_errors_at(world_size: int) -> dict:
    """Every algorithm of one world size in one job: {(algorithm, ulysses degree): per-rank errors}."""
    cases = [(algorithm, degree) for algorithm, size, degree in ALGORITHMS if size == world_size]
    return dict(zip(cases, run_distributed_cases(_attention_errors, world_size, cases)))


@pytest.mark.parametrize("algorithm, world_size, ulysses_degree", ALGORITHMS)
def test_matches_single_process_attention(algorithm, world_size, ulysses_degree):
    per_rank = _attention_errors_at(world_size)[(algorithm, ulysses_degree)]
    for rank, errors in enumerate(per_rank):
        assert set(errors) == set(CASES)
        for case, error in errors.items():
            assert error < TOLERANCE, f"rank {rank} {case}: max error {error:.3e}"


def test_balanced_layout_round_trip_and_positions():
    x = torch.arange(24).view(1, 24)
    pieces = [layout.split_for_rank(x, 1, r, 3) for r in range(3)]
    assert pieces[0].tolist() == [[0, 1, 2, 3, 20, 21, 22, 23]]
    assert torch.equal(layout.merge_from_ranks(pieces, 1), x)
    for r in range(3):
        assert torch.equal(layout.positions_on_rank(24, r, 3), pieces[r][0])
    with pytest.raises(ValueError, match="2 x cp = 6"):
        layout.positions_on_rank(16, 0, 3)


def test_packed_layout_splits_every_sequence():
    """TE's THD layout: every sequence of the pack cut into 2 x cp chunks, rank r holding chunks r and 2cp-1-r."""
    bounds = torch.tensor([0, 4, 12, 12, 16])
    assert layout.packed_positions_on_rank(bounds, 0, 2).tolist() == [0, 3, 4, 5, 10, 11, 12, 15]
    assert layout.packed_positions_on_rank(bounds, 1, 2).tolist() == [1, 2, 6, 7, 8, 9, 13, 14]
    assert layout.segment_ids(torch.arange(16), bounds).tolist() == [0] * 4 + [1] * 8 + [3] * 4
    with pytest.raises(ValueError, match="a packed sequence of 4 tokens .* pad it to a multiple of 6"):
        layout.packed_positions_on_rank(bounds, 0, 3)


def test_causal_block_plan_balances_work():
    """Blocks from earlier ranks: all queries x first key chunk; from later ranks: second query chunk x all keys."""
    cp, seq = 4, 32
    positions = [layout.positions_on_rank(seq, r, cp) for r in range(cp)]
    for me in range(cp):
        work = 0
        for source in range(cp):
            plan = plan_block(positions[me], positions[source], causal=True)
            rows = range(8)[plan.rows]
            cols = range(8)[plan.cols]
            work += len(rows) * len(cols)
            if source < me:
                assert (len(rows), len(cols), plan.causal_mask) == (8, 4, False)
            elif source > me:
                assert (len(rows), len(cols), plan.causal_mask) == (4, 8, False)
            else:
                assert plan.causal_mask
        assert work == 8 * 8 + (cp - 1) * 32


def test_merge_in_any_order_is_exact():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, generator=generator) for _ in range(3))
    rule = ScoreRule(scale=0.5, causal=False)
    full, full_lse = block_forward(q, k, v, torch.arange(5), torch.arange(5), rule)
    out = torch.zeros_like(full)
    lse = torch.full_like(full_lse, float("-inf"))
    for cols in (slice(3, 5), slice(0, 1), slice(1, 3)):
        merge_block_(out, lse, *block_forward(q, k[:, :, cols], v[:, :, cols], torch.arange(5),
                                               torch.arange(5)[cols], rule))
    torch.testing.assert_close(out, full, rtol=0, atol=1e-14)
    torch.testing.assert_close(lse, full_lse, rtol=0, atol=1e-14)


def _ring_telemetry(rank, world_size):
    from ascendspeed.features.context_parallel import RingTelemetry

    positions = [layout.positions_on_rank(SEQ, r, world_size) for r in range(world_size)]
    q, k, v, grad, _ = make_inputs(seed=7)
    local = [layout.split_for_rank(t, 2, rank, world_size).requires_grad_() for t in (q, k, v)]
    telemetry = RingTelemetry()
    timed = ring_attention(*local, positions, group=dist.group.WORLD, telemetry=telemetry)
    timed_grads = torch.autograd.grad(timed, local, layout.split_for_rank(grad, 2, rank, world_size))
    plain = ring_attention(*local, positions, group=dist.group.WORLD)
    plain_grads = torch.autograd.grad(plain, local, layout.split_for_rank(grad, 2, rank, world_size))
    assert torch.equal(timed, plain) and all(torch.equal(a, b) for a, b in zip(timed_grads, plain_grads))
    return telemetry.summary()


def test_ring_telemetry_counts_every_hop():
    cp = 2
    for summary in run_distributed(_ring_telemetry, cp):
        # forward: cp - 1 key/value hops; backward: cp - 1 key/value hops and cp dK/dV hops (one extra home)
        assert summary["hops"] == 3 * cp - 2
        hop_bytes = 2 * BATCH * HEADS * (SEQ // cp) * HEAD_DIM * 8
        assert summary["sent_MB"] * 2**20 == pytest.approx((3 * cp - 2) * hop_bytes)
        assert summary["compute_s"] > 0 and summary["communication_s"] > 0
        assert summary["exposed_s"] <= summary["communication_s"] + 1e-3
        assert 0.0 <= summary["hidden_fraction"] <= 1.0


def test_ring_telemetry_windows_add_up():
    """``take`` closes a window (the trainer's logging interval); windows sum to the run's totals."""
    from ascendspeed.features.context_parallel import RingOverlap, RingTelemetry

    telemetry = RingTelemetry()
    telemetry.record_hop(0.0, 2.0, exposed=0.5)
    telemetry.record_hop(1.0, 3.0, exposed=0.25)  # overlaps the first: 3 s in flight, not 4
    telemetry.sent_bytes, telemetry.compute_s = 2**20, 4.0
    first = telemetry.take()
    assert first == RingOverlap(hops=2, sent_bytes=2**20, compute_s=4.0, communication_s=3.0, exposed_s=0.75)
    assert first.hidden_fraction == pytest.approx(0.75)
    assert telemetry.take() == RingOverlap()
    telemetry.record_hop(10.0, 11.0, exposed=1.0)
    total = first + telemetry.take()
    assert (total.hops, total.communication_s, total.exposed_s) == (3, 4.0, 1.75)
    assert total.summary()["hidden_fraction"] == pytest.approx(1 - 1.75 / 4.0)
    assert RingOverlap().hidden_fraction == 0.0


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("causal", [True, False])
def test_low_precision_inputs_accumulate_in_fp32(dtype, tolerance, causal):
    """One process, odd sizes: fp32 and bf16 inputs against the float64 reference (relative norm error)."""
    generator = torch.Generator().manual_seed(5)
    q, k, v, grad = (torch.randn(3, 2, 22, 12, dtype=torch.float64, generator=generator) for _ in range(4))
    slopes = alibi_slopes(2)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*full, causal, slopes, None)
    expected_grads = torch.autograd.grad(expected, full, grad)
    low = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*low, [torch.arange(22)], causal=causal, slopes=slopes)
    grads = torch.autograd.grad(out, low, grad.to(dtype))
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    for actual, reference in zip([out, *grads], [expected, *expected_grads]):
        error = (actual.double() - reference).norm() / reference.norm()
        assert error < tolerance


@pytest.mark.parametrize("pack", [None, torch.tensor([0, 8, 8, 32, 48]), torch.tensor([0, 24, 48])],
                         ids=["one sequence", "pack with an empty sequence", "pack of two"])
def test_causal_sub_blocks_cover_exactly_the_visible_pairs(pack):
    """Cut where positions jump and where a pack's sequences end, trimmed to what is visible: every (query, key)
    pair with key <= query of the same sequence exactly once, each piece expressible by the flash kernel (query
    row i at q_offset + i, keys from 0)."""
    same = (lambda q, k: torch.ones(q.numel(), k.numel(), dtype=torch.bool)) if pack is None else (
        lambda q, k: layout.segment_ids(q, pack)[:, None] == layout.segment_ids(k, pack)[None, :])
    for cp in (1, 2, 4):
        positions = [layout.positions_on_rank(48, r, cp) if pack is None else layout.packed_positions_on_rank(pack, r, cp)
                     for r in range(cp)]
        for q_pos in positions:
            for k_pos in positions:
                pieces = torch.zeros(q_pos.numel(), k_pos.numel(), dtype=torch.int64)
                seen = torch.zeros_like(pieces)
                for rows, cols, q_offset in causal_sub_blocks(q_pos, k_pos, pack):
                    assert q_offset >= 0
                    q_run, k_run = q_pos[rows], k_pos[cols]
                    assert torch.equal(q_run, q_run[0] + torch.arange(q_run.numel()))
                    assert torch.equal(k_run, k_run[0] + torch.arange(k_run.numel()))
                    assert int(q_run[0] - k_run[0]) == q_offset and int(k_run[-1]) <= int(q_run[-1])
                    pieces[rows, cols] += 1
                    seen[rows, cols] += (k_run[None, :] <= q_run[:, None]).long()  # the kernel's causal mask
                assert pieces.max() <= 1
                assert torch.equal(seen, ((k_pos[None, :] <= q_pos[:, None]) & same(q_pos, k_pos)).long())


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("with_alibi", [False, True])
@pytest.mark.parametrize("pack", [None, torch.tensor([0, 8, 16, 40])], ids=["one sequence", "pack"])
def test_flash_blocks_equal_blockwise_blocks(dtype, tolerance, with_alibi, pack):
    """A ring block of the balanced layout (two chunks per rank, of every sequence in a pack) through the flash
    kernel equals the blockwise code, forward (output, log-sum-exp) and backward (given the final output and
    log-sum-exp of the rows)."""
    generator = torch.Generator().manual_seed(11)
    if pack is None:
        q_pos, k_pos = layout.positions_on_rank(40, 0, 2), layout.positions_on_rank(40, 1, 2)
    else:
        q_pos, k_pos = layout.packed_positions_on_rank(pack, 0, 2), layout.packed_positions_on_rank(pack, 1, 2)
    q, grad = (torch.randn(2, 3, q_pos.numel(), 16, generator=generator, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 3, k_pos.numel(), 16, generator=generator, dtype=torch.float64) for _ in range(2))
    q, k, v, grad = (t.to(dtype) for t in (q, k, v, grad))
    rule = ScoreRule(scale=0.3, causal=True, slopes=alibi_slopes(3) if with_alibi else None, segments=pack)
    for own_keys in (False, True):
        keys = (q_pos, q, q) if own_keys else (k_pos, k, v)
        expected = BlockwiseKernels.forward(q, keys[1], keys[2], q_pos, keys[0], rule)
        actual = FlashBlockKernels.forward(q, keys[1], keys[2], q_pos, keys[0], rule)
        out, lse = expected
        for got, want in zip(actual, expected):
            assert got.dtype == want.dtype
            finite = torch.isfinite(want)
            assert torch.equal(finite, torch.isfinite(got))
            assert (got[finite] - want[finite]).abs().max() <= tolerance * (1 + want[finite].abs().max())
        final_out = out.to(dtype)
        delta = (grad.to(out.dtype) * final_out.to(out.dtype)).sum(-1)
        expected_grads = BlockwiseKernels.backward(q, keys[1], keys[2], grad, final_out, lse, delta, q_pos, keys[0],
                                                   rule)
        grads = FlashBlockKernels.backward(q, keys[1], keys[2], grad, final_out, lse, delta, q_pos, keys[0], rule)
        for got, want in zip(grads, expected_grads):
            assert got.dtype == want.dtype and (got - want).abs().max() <= tolerance * (1 + want.abs().max())


def test_ring_on_cpu_runs_the_flash_kernel_also_for_packs_and_dropout_the_blockwise_code():
    q, k, v = (torch.randn(1, 2, 12, 8, requires_grad=True) for _ in range(3))
    dropout = PositionalDropout.for_heads(0.2, seed=1, heads=2)
    for dropout, segments, kernel_ran in ((None, None, True), (None, torch.tensor([0, 4, 12]), True),
                                          (dropout, None, False)):
        with torch.profiler.profile() as profile:
            ring_attention(q, k, v, [torch.arange(12)], slopes=alibi_slopes(2), dropout=dropout,
                           segments=segments).sum().backward()
        names = {event.key for event in profile.key_averages()}
        expected = {"ascendspeed::alibi_flash_attention", "ascendspeed::alibi_flash_attention_backward"}
        assert (expected <= names) if kernel_ran else not (expected & names), names


def test_positional_dropout_drops_p_of_the_entries_by_position_alone():
    """The mask is a function of (seed, batch row, head, query, key): any block of it is the same block of the
    whole mask, a head share is those heads' rows, and about ``p`` of the entries are dropped."""
    dropout = PositionalDropout.for_heads(0.1, seed=12345, heads=8)
    positions = torch.arange(512)
    whole = dropout.keep_scale(2, positions, positions, torch.float64, "cpu")
    assert whole.shape == (2, 8, 512, 512)
    assert set(whole.unique().tolist()) == {0.0, 1 / 0.9}
    assert (whole == 0).double().mean().item() == pytest.approx(0.1, abs=2e-3)
    assert whole.mean().item() == pytest.approx(1.0, abs=3e-3)
    rows, cols = layout.positions_on_rank(512, 1, 4), torch.arange(100, 300)
    block = dropout.keep_scale(2, rows, cols, torch.float64, "cpu")
    assert torch.equal(block, whole[:, :, rows][..., cols])
    share = dropout.head_share(4, 3).keep_scale(2, positions, positions, torch.float64, "cpu")
    assert torch.equal(share, whole[:, 6:8])
    other_seed = PositionalDropout.for_heads(0.1, seed=12346, heads=8).keep_scale(2, positions, positions,
                                                                                 torch.float64, "cpu")
    assert (other_seed != whole).double().mean().item() == pytest.approx(2 * 0.1 * 0.9, abs=3e-3)
    # rows, heads, queries and keys each change the mask (no two of them share a stream)
    for a, b in ((whole[0], whole[1]), (whole[:, 0], whole[:, 1]), (whole[:, :, 0], whole[:, :, 1]),
                 (whole[..., 0], whole[..., 1])):
        assert (a != b).double().mean().item() == pytest.approx(0.18, abs=0.05)


@pytest.mark.parametrize("p, seed", [(0.0, 1), (1.0, 1), (0.5, -1), (0.5, 2**31)])
def test_positional_dropout_refuses_bad_settings(p, seed):
    with pytest.raises(ValueError, match="probability must be in|seed must be in"):
        PositionalDropout.for_heads(p, seed, heads=2)
