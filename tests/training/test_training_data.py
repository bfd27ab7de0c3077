"""The byte-level data pipeline of the pretraining entry: text, tokenizer, split, batches."""
import gzip

import pytest
import torch

from ascendspeed.training.errors import DataError
from ascendspeed.training.data import (
    DEFAULT_TEXT,
    ByteTokenizer,
    EvalPlan,
    TextSplits,
    causal_mask,
    eval_microbatches,
    eval_windows,
    padded_vocab_size,
    parse_split,
    read_text,
    train_microbatches,
)

CPU = torch.device("cpu")


def test_embedded_text_is_the_novel_in_plain_ascii():
    text = read_text()
    assert text.startswith(b"PRIDE AND PREJUDICE")
    assert b"It is a truth universally acknowledged" in text
    assert 600_000 < len(text) < 800_000
    assert max(text) < 128


def test_embedded_text_is_packaged():
    assert DEFAULT_TEXT.name.endswith(".txt.gz")
    assert (DEFAULT_TEXT.parent / "README.md").is_file()


def test_user_files_plain_and_gzip_are_concatenated(tmp_path):
    plain = tmp_path / "a.txt"
    plain.write_text("first file")
    packed = tmp_path / "b.txt.gz"
    with gzip.open(packed, "wb") as handle:
        handle.write("zweite Datei: äöü".encode())
    assert read_text([str(plain), str(packed)]) == "first file\n\nzweite Datei: äöü".encode()


def test_missing_file_names_the_flag(tmp_path):
    with pytest.raises(DataError, match="--data-path"):
        read_text([str(tmp_path / "nope.txt")])


def test_byte_tokenizer_round_trips_any_text():
    tokenizer = ByteTokenizer()
    text = "Mr. Darcy — naïve 字"
    ids = tokenizer.encode(text)
    assert ids.dtype == torch.uint8 and len(ids) == len(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.vocab_size == 256


@pytest.mark.parametrize("divisible_by, tp, expected", [(128, 1, 256), (128, 2, 256), (100, 1, 300), (128, 4, 512)])
def test_vocab_is_padded_per_tensor_parallel_shard(divisible_by, tp, expected):
    assert padded_vocab_size(256, divisible_by, tp) == expected


def test_split_weights_follow_megatron():
    assert parse_split("95,5") == pytest.approx((0.95, 0.05))
    assert parse_split("969, 30, 1") == pytest.approx((0.969, 0.030))
    for bad in ("100", "95,0", "a,b", "1,2,3,4"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)


def test_validation_is_the_unseen_tail():
    data = bytes(range(256)) * 40
    splits = TextSplits.from_bytes(data, "95,5")
    assert len(splits.train) == int(len(data) * 0.95)
    assert len(splits.valid) == int(len(data) * 0.05)
    joined = torch.cat([splits.train, splits.valid])
    assert bytes(joined.tolist()) == data[: len(joined)]


def _shards(iteration, dp_size=2, seed=7, mbs=2, nmb=3):
    tokens = torch.arange(1000, dtype=torch.int64) % 251
    return [
        train_microbatches(tokens, seq_length=16, micro_batch_size=mbs, num_microbatches=nmb,
                           data_parallel_rank=rank, data_parallel_size=dp_size, seed=seed,
                           iteration=iteration, device=CPU)
        for rank in range(dp_size)
    ]


def test_train_batches_shift_labels_and_mask_the_future():
    batch = _shards(0)[0][0]
    assert batch.tokens.shape == batch.labels.shape == (2, 16)
    assert torch.equal(batch.tokens[:, 1:], batch.labels[:, :-1])
    assert torch.equal(batch.position_ids[0], torch.arange(16))
    assert batch.attention_mask.shape == (1, 1, 16, 16)
    assert batch.attention_mask[0, 0, 3, 4] and not batch.attention_mask[0, 0, 4, 4]


def test_train_batches_depend_only_on_seed_and_iteration():
    first, again, later = _shards(5), _shards(5), _shards(6)
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(first[0], again[0]))
    assert not all(torch.equal(a.tokens, b.tokens) for a, b in zip(first[0], later[0]))


def test_data_parallel_ranks_share_out_one_global_batch():
    """Two ranks together see exactly the windows one rank sees with the whole global batch."""
    split = _shards(3, dp_size=2, nmb=3)
    whole = _shards(3, dp_size=1, nmb=6)[0]
    from_ranks = torch.cat([b.tokens for rank in split for b in rank])
    assert torch.equal(from_ranks, torch.cat([b.tokens for b in whole]))
    assert not torch.equal(split[0][0].tokens, split[1][0].tokens)


def test_eval_windows_cover_the_text_without_overlap():
    tokens = torch.arange(101)
    windows = eval_windows(tokens, 10)
    assert windows.shape == (10, 11)
    assert torch.equal(windows[:, :-1].reshape(-1), torch.arange(100))
    assert torch.equal(windows[:, 1:].reshape(-1), torch.arange(1, 101))
    assert eval_windows(torch.arange(5), 10).shape == (0, 11)


def test_eval_plan_shrinks_micro_batches_and_splits_ranks_evenly():
    assert EvalPlan.fit(40, micro_batch_size=8, data_parallel_size=2) == EvalPlan(8, 2)
    assert EvalPlan.fit(5, micro_batch_size=8, data_parallel_size=2) == EvalPlan(2, 1)
    assert EvalPlan.fit(1, micro_batch_size=8, data_parallel_size=2) is None
    assert EvalPlan.fit(11, micro_batch_size=8, data_parallel_size=1, microbatch_multiple=2) == EvalPlan(5, 2)
    assert EvalPlan.fit(40, micro_batch_size=8, data_parallel_size=1, microbatch_multiple=2) == EvalPlan(8, 4)
    assert EvalPlan.fit(1, micro_batch_size=8, data_parallel_size=1, microbatch_multiple=2) is None
    windows = eval_windows(torch.arange(401), 10)
    plan = EvalPlan.fit(len(windows), 4, 2)
    seen = [b.tokens for rank in range(2) for b in eval_microbatches(windows, plan, rank, CPU)]
    assert torch.equal(torch.cat(seen).reshape(-1), torch.arange(400))


def test_causal_mask_is_megatron_convention():
    mask = causal_mask(4, CPU)
    assert mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], torch.ones(4, 4, dtype=torch.bool).triu(1))
