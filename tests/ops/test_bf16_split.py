"""The in-place bf16 split / join operators (``--reuse-fp32-param``'s layout switches) against the torch
composition they replace, bit for bit, in every layout the feature uses.

Layouts: the interleaved one of a ``ParameterUnit`` (``low=None``: fp32 values over [bf16 | remainders]
of the same buffer) and the shard one of a ``BucketShardUnit`` (the fp32 values of shard ``rank`` of a
bucket of ``dp`` shards in the bucket's first ``2n`` int16 slots, its bf16 values at ``rank * n``,
the remainders in a tensor of their own) for every rank at DP 2 and 4. Values: fresh random bit
patterns with zeros, subnormals, infinities, NaNs, the largest finite values and exact ties that round
down and up. Schedules: the default one, and one-element blocks in ascending and in descending order
(an overlap hazard inside a range that one order hides, the other exposes), on 1, 2 and 5 threads.
"""
import pytest
import torch

from ascendspeed.ops import bf16_join_, bf16_split_
from ascendspeed.ops.bf16_split import NPU_KERNELS, _composite_join, _composite_split, join_reference, split_reference

pytestmark = pytest.mark.megatron_independent  # one release covers it: .ci/run runs it on the newest only

SPECIAL = [
    0x00000000, 0x80000000,  # +-0
    0x00000001, 0x007FFFFF, 0x00008000, 0x80018000, 0x807FFFFF,  # subnormals (and subnormal ties)
    0x7F800000, 0xFF800000,  # +-inf
    0x7FC00000, 0xFFC00001, 0x7F800001, 0xFFFF8000, 0x7FFFFFFF, 0x7FC18000,  # NaNs, quiet and signalling
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7E8000,  # the largest finite values, rounding to inf and not
    0x3F808000, 0xBF808000, 0x40008000,  # exact ties with an even upper half: they round down
    0x3F818000, 0xBF818000, 0x407F8000,  # exact ties with an odd upper half: they round up
    0x3F807FFF, 0x3F808001, 0x3FFFFFFF,  # beside a tie; a round-up that carries into the exponent
]

SIZES = [*range(1, 40), 64, 100, 1001, 4097, 70001]
LAYOUTS = [("interleaved", None), *[(f"dp{dp}-rank{rank}", (dp, rank)) for dp in (2, 4) for rank in range(dp)]]
SCHEDULES = {
    "default": (1024, 16384, False),
    "one-element-ascending": (1, 1 << 40, False),
    "one-element-descending": (1, 1 << 40, True),
    "small-blocks-all-threads": (3, 5, True),
}


def patterns(n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` fp32 bit patterns (int32): random ones, a quarter of them replaced by the special ones."""
    bits = torch.randint(-(1 << 31), 1 << 31, (n,), generator=generator, dtype=torch.int64)
    special = torch.tensor(SPECIAL, dtype=torch.int64)
    positions = torch.randperm(n, generator=generator)[: max(1, n // 4)]
    bits[positions] = special[torch.randint(0, len(SPECIAL), (positions.numel(),), generator=generator)]
    return bits.to(torch.int32)  # int64 -> int32 keeps the low 32 bits


def layout(bits: torch.Tensor, dp_rank, generator: torch.Generator):
    """``(halves, high_offset, low)`` holding the fp32 values ``bits`` in the main layout."""
    n = bits.numel()
    if dp_rank is None:
        return bits.clone().view(torch.int16), 0, None
    dp, rank = dp_rank
    bucket = torch.randint(-(1 << 15), 1 << 15, (dp * n,), generator=generator, dtype=torch.int16)
    bucket[: 2 * n] = bits.view(torch.int16)
    return bucket, rank * n, torch.randint(-(1 << 15), 1 << 15, (n,), generator=generator, dtype=torch.int16)


def clone_layout(halves, high_offset, low):
    return halves.clone(), high_offset, None if low is None else low.clone()


def split_parts(n, halves, high_offset, low):
    """What a split defines: the bf16 values and the remainders."""
    return halves[high_offset: high_offset + n], low if low is not None else halves[n: 2 * n]


@pytest.fixture
def schedule(request):
    block, grain, descending = SCHEDULES[request.param]
    torch.ops.ascendspeed._bf16_split_schedule(block, grain, descending)
    yield request.param
    torch.ops.ascendspeed._bf16_split_schedule()


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 5], indirect=True)
@pytest.mark.parametrize("schedule", list(SCHEDULES), indirect=True)
@pytest.mark.parametrize("name, dp_rank", LAYOUTS, ids=[name for name, _ in LAYOUTS])
def test_split_and_join_match_the_torch_composition_bit_for_bit(name, dp_rank, schedule, threads):
    generator = torch.Generator().manual_seed(hash((name, schedule, threads)) % (1 << 31))
    for n in SIZES:
        bits = patterns(n, generator)
        halves, high_offset, low = layout(bits, dp_rank, generator)
        untouched = torch.ones(halves.numel(), dtype=torch.bool)
        untouched[: 2 * n] = False
        untouched[high_offset: high_offset + n] = False
        before = halves.clone()
        expected = clone_layout(halves, high_offset, low)

        ties = bf16_split_(halves, high_offset, low)
        expected_ties = _composite_split(*expected)
        for actual, wanted, what in zip(split_parts(n, halves, high_offset, low),
                                        split_parts(n, *expected), ("bf16 values", "remainders")):
            assert torch.equal(actual, wanted), f"n={n}: {what}"
        assert ties.dtype == torch.int64 and torch.equal(ties, expected_ties), f"n={n}: ties"
        assert torch.equal(halves[untouched], before[untouched]), f"n={n}: slots outside the layout kept"

        bf16_join_(halves, ties, high_offset, low)
        _composite_join(expected[0], expected_ties, high_offset, expected[2])
        assert torch.equal(halves, expected[0]), f"n={n}: joined buffer"
        restored = halves[: 2 * n].view(torch.int32)
        nan = bits.view(torch.float32).isnan()
        assert torch.equal(restored[~nan], bits[~nan]), f"n={n}: every fp32 value but NaN restored exactly"
        assert restored.view(torch.float32)[nan].isnan().all(), f"n={n}: NaN stays NaN"


def test_ties_both_ways_are_kept_exactly():
    """Only ties that rounded down are listed; both kinds come back exactly."""
    down, up = 0x3F808000, 0x3F818000  # upper halves 0x3F80 (even) and 0x3F81 (odd)
    bits = torch.tensor([down, up, 0x12345678, down, up, down], dtype=torch.int32)
    halves = bits.clone().view(torch.int16)
    ties = bf16_split_(halves)
    assert ties.tolist() == [0, 3, 5]
    assert [h & 0xFFFF for h in halves[:6].tolist()] == [0x3F80, 0x3F82, 0x1234, 0x3F80, 0x3F82, 0x3F80]
    bf16_join_(halves, ties)
    assert torch.equal(halves.view(torch.int32), bits)


def test_the_reference_rounds_like_megatrons_cast():
    main = torch.randn(4097)
    high, low, ties = split_reference(main)
    megatron = torch.empty_like(main, dtype=torch.bfloat16)
    megatron.copy_(main)  # Float16OptimizerWithFloat16Params._copy_main_params_to_model_params
    assert torch.equal(high, megatron.view(torch.int16))
    out = torch.empty(4097, 2, dtype=torch.int16)
    assert torch.equal(join_reference(high, low, ties, out).view(torch.float32).view(-1), main)


def test_empty_and_no_ties():
    halves = torch.empty(0, dtype=torch.int16)
    assert bf16_split_(halves).numel() == 0
    bf16_join_(halves, torch.empty(0, dtype=torch.int64))
    bits = torch.tensor([0x3F800000, 0x40000000], dtype=torch.int32)
    halves = bits.clone().view(torch.int16)
    ties = bf16_split_(halves)
    assert ties.numel() == 0
    bf16_join_(halves, ties)
    assert torch.equal(halves.view(torch.int32), bits)


def _bad_calls(device):
    halves = torch.zeros(8, dtype=torch.int16, device=device)
    low = torch.zeros(4, dtype=torch.int16, device=device)
    ties = torch.zeros(0, dtype=torch.int64, device=device)
    other = "meta" if device == "cpu" else "cpu"
    split, join = torch.ops.ascendspeed.bf16_split_, torch.ops.ascendspeed.bf16_join_
    return [
        (TypeError, "halves must be int16", lambda: split(halves.float())),
        (ValueError, "halves must be 1-D and contiguous", lambda: split(halves.view(2, 4))),
        (ValueError, "halves must be 1-D and contiguous", lambda: split(torch.zeros(16, dtype=torch.int16, device=device)[::2])),
        (ValueError, "halves must start at an even int16 offset", lambda: split(torch.zeros(9, dtype=torch.int16, device=device)[1:])),
        (ValueError, "without low, halves .* must have an even length", lambda: split(torch.zeros(6, dtype=torch.int16, device=device)[:5])),
        (ValueError, "without low .* high_offset must be 0", lambda: split(halves, 2)),
        (TypeError, "low must be int16", lambda: split(halves, 0, low.int())),
        (ValueError, "low must be 1-D and contiguous", lambda: split(halves, 0, low.view(2, 2))),
        (ValueError, "halves must hold the 5 fp32 values", lambda: split(halves, 0, torch.zeros(5, dtype=torch.int16, device=device))),
        (IndexError, "high_offset \\+ n must lie within halves", lambda: split(halves, 5, low)),
        (IndexError, "high_offset \\+ n must lie within halves", lambda: split(halves, -1, low)),
        (ValueError, "low must be on the device of halves", lambda: split(halves, 0, torch.zeros(4, dtype=torch.int16, device=other))),
        (TypeError, "ties must be int64", lambda: join(halves, ties.int())),
        (ValueError, "ties must be 1-D", lambda: join(halves, ties.view(0, 1))),
        (ValueError, "ties must be on the device of halves", lambda: join(halves, torch.zeros(0, dtype=torch.int64, device=other))),
        (IndexError, "high_offset \\+ n must lie within halves", lambda: join(halves, ties, 6, low)),
    ]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_bad_inputs_name_the_argument(device):
    for error, message, call in _bad_calls(device):
        with pytest.raises(error, match=f"bf16_(split|join)_: {message}"):
            call()


def test_low_sharing_memory_with_halves_is_refused():
    buffer = torch.zeros(16, dtype=torch.int16)
    with pytest.raises(ValueError, match="low must not share memory with halves"):
        bf16_split_(buffer[:8], 0, buffer[6:10])
    with pytest.raises(ValueError, match="low must not share memory with halves"):
        bf16_join_(buffer[:8], torch.zeros(0, dtype=torch.int64), 0, buffer[4:8])


@pytest.mark.parametrize("ties, message", [
    ([2, 1], "got 1 at index 1"), ([1, 1], "got 1 at index 1"), ([4], "got 4 at index 0"), ([-1], "got -1 at index 0"),
])
def test_bad_tie_positions_are_refused(ties, message):
    expected = f"bf16_join_: ties must be strictly increasing positions in \\[0, 4\\) .*, {message}"
    with pytest.raises(ValueError, match=expected):
        bf16_join_(torch.zeros(8, dtype=torch.int16), torch.tensor(ties, dtype=torch.int64))


def test_python_kernels_check_through_the_meta_kernel():
    with pytest.raises(IndexError, match="bf16_split_: high_offset"):
        _composite_split(torch.zeros(8, dtype=torch.int16), 5, torch.zeros(4, dtype=torch.int16))
    with pytest.raises(TypeError, match="bf16_join_: ties must be int64"):
        _composite_join(torch.zeros(8, dtype=torch.int16), torch.zeros(0, dtype=torch.int32))


def test_meta_kernels_check_only():
    halves = torch.empty(8, dtype=torch.int16, device="meta")
    ties = torch.ops.ascendspeed.bf16_split_(halves)
    assert ties.device.type == "meta" and ties.dtype == torch.int64
    torch.ops.ascendspeed.bf16_join_(halves, torch.empty(3, dtype=torch.int64, device="meta"))


def test_split_has_a_data_dependent_output_under_fake_tensors():
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

    assert torch.Tag.dynamic_output_shape in torch.ops.ascendspeed.bf16_split_.default.tags
    with FakeTensorMode():
        halves = torch.empty(8, dtype=torch.int16)
        with pytest.raises(DynamicOutputShapeException):
            torch.ops.ascendspeed.bf16_split_(halves)
        torch.ops.ascendspeed.bf16_join_(halves, torch.empty(2, dtype=torch.int64))


def test_join_compiles_fullgraph_and_keeps_the_operator():
    def switch(halves, ties):
        bf16_join_(halves, ties)
        return halves.view(torch.float32) * 2

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    bits = torch.tensor([0x3F808000, 0x12345678, 0x40490FDB, 0x3F818000], dtype=torch.int32)
    halves = bits.clone().view(torch.int16)
    ties = bf16_split_(halves)
    result = torch.compile(switch, fullgraph=True, backend=capture)(halves, ties)
    op = torch.ops.ascendspeed.bf16_join_
    assert any(node.target in (op, op.default) for node in graphs[0].graph.nodes)
    assert torch.equal(halves.view(torch.int32), bits) and torch.equal(result, bits.view(torch.float32) * 2)


def test_join_passes_torch_opcheck():
    halves = torch.tensor([0x3F808000, 0x12345678, 0x3F818000], dtype=torch.int32).view(torch.int16)
    ties = bf16_split_(halves)
    result = torch.library.opcheck(torch.ops.ascendspeed.bf16_join_.default, (halves, ties, 0, None))
    assert set(result.values()) == {"SUCCESS"}, result


def test_device_kernels_registered():
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    for op in ("ascendspeed::bf16_split_", "ascendspeed::bf16_join_"):
        assert has_kernel(op, "CPU") and has_kernel(op, "Meta") and has_kernel(op, "CUDA"), op
        assert not torch._library.simple_registry.singleton.find(op).fake_impl.kernel, f"{op}: Python fake kernel"
        assert has_kernel(op, "PrivateUse1") == NPU_KERNELS


def _bytes_allocated(call) -> int:
    """Bytes the operator call allocates (torch's CPU allocator, as the profiler records them)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        call()
    return sum(max(event.self_cpu_memory_usage, 0) for event in profiler.key_averages())


def test_transient_memory_is_what_the_overlap_needs():
    """Interleaved: the remainders of the first ceil(n/2) elements are staged (1 byte per element);
    shard layouts stage nothing. The split also allocates its tie list (8 bytes per tie)."""
    n = (1 << 16) + 1
    halves = torch.randn(n).view(torch.int16).clone()
    ties = bf16_split_(halves)
    assert _bytes_allocated(lambda: bf16_join_(halves, ties)) == 2 * ((n + 1) // 2)
    assert _bytes_allocated(lambda: bf16_split_(halves)) == 2 * ((n + 1) // 2) + 8 * ties.numel()
    bucket, low = torch.zeros(2 * n, dtype=torch.int16), torch.zeros(n, dtype=torch.int16)
    bucket[: 2 * n] = halves
    ties = bf16_split_(bucket, n, low)
    assert _bytes_allocated(lambda: bf16_join_(bucket, ties, n, low)) == 0
    assert _bytes_allocated(lambda: bf16_split_(bucket, n, low)) == 8 * ties.numel()
