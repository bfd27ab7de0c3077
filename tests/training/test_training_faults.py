"""A hostile user against the pretraining entry: bad flags, resumes that disagree with their checkpoint,
divergence, damaged or missing checkpoints, full disks, bad data files. Nothing may go silently wrong:
each case gets an error naming the flag or file and the fix, on every rank, and no rank is left hanging.

Runs real megatron-core training on 2 gloo processes; faults are real (truncated files, a file-size
limit for the full disk), nothing is mocked.
"""
import gzip
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.distributed import run_distributed

REPO = Path(__file__).resolve().parents[2]

TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--micro-batch-size", "4", "--lr", "5e-3", "--min-lr", "5e-4", "--lr-warmup-iters", "1",
    "--eval-iters", "1", "--log-interval", "100", "--eval-interval", "0", "--eval-seq-lengths", "64",
]


def _train(world_size, *flags):
    """(result, None) or (None, (error type name, message)) for a TrainingError."""
    from ascendspeed.training.arguments import parse_args
    from ascendspeed.training.errors import TrainingError
    from ascendspeed.training.trainer import train

    try:
        return train(parse_args([*TINY, *flags], world_size=world_size)), None
    except TrainingError as error:
        return None, (type(error).__name__, str(error))


# -- arguments (issue 12 items 6, 7) -----------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--micro-batch-size", "0"], "--micro-batch-size must be positive"),
    (["--num-attention-heads", "0"], "--num-attention-heads must be positive"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be positive"),
    (["--pipeline-model-parallel-size", "0"], "--pipeline-model-parallel-size must be positive"),
    (["--num-layers", "0"], "--num-layers must be positive"),
    (["--hidden-size", "0"], "--hidden-size must be positive"),
    (["--hidden-size", "-64"], "--hidden-size must be positive"),
    (["--kv-channels", "0"], "--kv-channels must be positive"),
    (["--kv-channels", "-8"], "--kv-channels must be positive"),
    (["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by must be positive"),
    (["--group-query-attention", "--num-query-groups", "0"], "--num-query-groups must be positive"),
    (["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups 3"),
    (["--eval-iters", "0"], "--eval-iters must be positive"),
    (["--global-batch-size", "0"], "--global-batch-size must be positive"),
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size must be positive"),
    (["--clip-grad", "-1"], "--clip-grad must not be negative"),
    (["--lr-warmup-iters", "-1"], "--lr-warmup-iters must not be negative"),
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--min-lr=-1e-4"], "--min-lr must not be negative"),
    (["--weight-decay", "-0.1"], "--weight-decay must not be negative"),
    (["--attention-dropout", "1.5"], "--attention-dropout must be in [0, 1)"),
    (["--adam-beta2", "1"], "--adam-beta2 must be in [0, 1)"),
    (["--rotary-percent", "0"], "--rotary-percent must be in (0, 1]"),
    (["--seq-length", "0"], "--seq-length must be positive"),
    (["--train-iters", "0"], "--train-iters must be positive"),
    (["--save-interval", "0"], "--save-interval must be positive"),
    (["--lr-decay-iters", "0"], "--lr-decay-iters must be positive"),
    (["--split", "95,0"], "--split"),
    (["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "99"], "--ffn-hidden-size 99"),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"], "not allowed with"),
])
def test_out_of_range_flags_are_usage_errors_naming_the_flag(flags, message, capsys):
    from ascendspeed.training.arguments import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(flags, world_size=2, device="cpu")
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_warmup_default_adapts_to_a_short_run():
    from ascendspeed.training.arguments import parse_args

    assert parse_args(["--train-iters", "8"], world_size=1, device="cpu").lr_warmup_iters == 0
    assert parse_args(["--train-iters", "100"], world_size=1, device="cpu").lr_warmup_iters == 10
    assert parse_args([], world_size=1, device="cpu").lr_warmup_iters == 20
    explicit = parse_args(["--train-iters", "8", "--lr-warmup-iters", "3"], world_size=1, device="cpu")
    assert explicit.lr_warmup_iters == 3


# -- data (item 10) ------------------------------------------------------------------------------------------
def _args(data_path, *flags):
    from ascendspeed.training.arguments import parse_args

    return parse_args(["--data-path", str(data_path), *flags], world_size=2, device="cpu")


def test_an_empty_file_is_named(tmp_path):
    from ascendspeed.training.data import read_text
    from ascendspeed.training.errors import DataError

    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=f"--data-path: {re.escape(str(empty))} is empty"):
        read_text([str(empty)])
    packed = tmp_path / "empty.txt.gz"
    with gzip.open(packed, "wb"):
        pass
    with pytest.raises(DataError, match="is empty after decompression"):
        read_text([str(packed)])


def test_a_gz_that_is_not_gzip_or_is_truncated_is_named(tmp_path):
    from ascendspeed.training.data import read_text
    from ascendspeed.training.errors import DataError

    fake = tmp_path / "plain.txt.gz"
    fake.write_text("plain text under a .gz name " * 10)
    with pytest.raises(DataError, match=f"{re.escape(str(fake))} is not a complete gzip file.*rename it"):
        read_text([str(fake)])
    truncated = tmp_path / "cut.txt.gz"
    truncated.write_bytes(gzip.compress(os.urandom(50_000))[:20_000])
    with pytest.raises(DataError, match=f"{re.escape(str(truncated))} is not a complete gzip file.*truncated"):
        read_text([str(truncated)])
    with pytest.raises(DataError, match="is not a file"):
        read_text([str(tmp_path)])


def test_a_text_shorter_than_one_sequence_is_named_before_the_model_is_built(tmp_path):
    from ascendspeed.training.data import TextSplits, check_text_suffices, read_text
    from ascendspeed.training.errors import DataError

    short = tmp_path / "short.txt"
    short.write_text("x" * 100)
    args = _args(short)
    splits = TextSplits.from_bytes(read_text(args.data_path), args.split)
    with pytest.raises(DataError, match=f"--data-path {re.escape(str(short))} is too short for --seq-length 128 and --split 95,5: its training part"):
        check_text_suffices(splits, args, data_parallel_size=2)
    medium = tmp_path / "medium.txt"
    medium.write_text("x" * 3000)  # training part fine, validation part 150 bytes: one window, two ranks
    args = _args(medium)
    splits = TextSplits.from_bytes(read_text(args.data_path), args.split)
    with pytest.raises(DataError, match="validation part has 150 bytes: 1 sequence.s., while 2 data-parallel"):
        check_text_suffices(splits, args, data_parallel_size=2)
    args = _args(medium, "--split", "80,20")
    check_text_suffices(TextSplits.from_bytes(read_text(args.data_path), args.split), args, data_parallel_size=2)


# -- resume (items 1, 4) ----------------------------------------------------------------------------------
def _resume_worker(rank, world_size, directory):
    straight, _ = _train(world_size, "--train-iters", "10")
    first, _ = _train(world_size, "--train-iters", "6", "--save", directory)
    outcomes = {"straight_lr": straight.learning_rates, "first_lr": first.learning_rates}
    _, outcomes["extend"] = _train(world_size, "--train-iters", "10", "--load", directory)
    _, outcomes["new_lr"] = _train(world_size, "--train-iters", "6", "--lr", "1e-3", "--load", directory)
    follow, _ = _train(world_size, "--train-iters", "10", "--load", directory, "--override-opt_param-scheduler")
    keep, _ = _train(world_size, "--train-iters", "10", "--load", directory, "--use-checkpoint-opt_param-scheduler")
    outcomes.update(follow_lr=follow.learning_rates, follow_start=follow.start_iteration,
                    keep_lr=keep.learning_rates)
    _, outcomes["behind"] = _train(world_size, "--train-iters", "4", "--load", directory)
    done, _ = _train(world_size, "--train-iters", "6", "--load", directory)
    outcomes["done"] = (done.start_iteration, done.iteration, done.losses)
    return outcomes


def test_resume_with_a_different_schedule_is_refused_unless_told_which_wins(tmp_path):
    results = run_distributed(_resume_worker, 2, str(tmp_path / "ckpt"), timeout=400)
    for outcome in results:
        kind, message = outcome["extend"]
        assert kind == "ResumeError"
        assert "--lr-decay-iters (default --train-iters): checkpoint 6, now 10" in message
        assert "--override-opt_param-scheduler" in message and "--use-checkpoint-opt_param-scheduler" in message
        assert "--lr: checkpoint 0.005, now 0.001" in outcome["new_lr"][1]
        # Following the new flags: iterations 7-10 run at the uninterrupted 10-iteration run's rates.
        assert outcome["follow_start"] == 6
        assert outcome["follow_lr"] == pytest.approx(outcome["straight_lr"][6:])
        # Keeping the checkpoint's schedule: its decay ended at iteration 6, the rest runs at --min-lr.
        assert outcome["keep_lr"] == pytest.approx([5e-4] * 4)
        assert outcome["behind"][0] == "ResumeError"
        assert "holds iteration 6, past --train-iters 4" in outcome["behind"][1]
        assert outcome["done"] == (6, 6, [])


# -- checkpoints (items 3, 5) -----------------------------------------------------------------------------
def _missing_checkpoint_worker(rank, world_size, root):
    root = Path(root)
    (root / "empty").mkdir(exist_ok=True)
    outcomes = {}
    _, outcomes["missing"] = _train(world_size, "--train-iters", "2", "--load", str(root / "nope"))
    _, outcomes["empty"] = _train(world_size, "--train-iters", "2", "--load", str(root / "empty"))
    fresh, _ = _train(world_size, "--train-iters", "2", "--load", str(root / "nope"), "--allow-fresh-start",
                      "--save", str(root / "real"))
    outcomes["fresh"] = (fresh.start_iteration, fresh.iteration)
    # A mistyped --load with the real directory as --save must not roll the real checkpoint back.
    _, outcomes["rollback"] = _train(world_size, "--train-iters", "2", "--load", str(root / "typo"),
                                     "--allow-fresh-start", "--save", str(root / "real"))
    outcomes["tracker_after"] = (root / "real" / "latest_checkpointed_iteration.txt").read_text()
    outcomes["files_after"] = sorted(p.name for p in (root / "real").iterdir())
    _, outcomes["unwritable"] = _train(world_size, "--train-iters", "100000",
                                       "--save", str(root / "real" / "latest_checkpointed_iteration.txt" / "sub"))
    return outcomes


def test_a_load_that_finds_nothing_is_an_error_and_never_rolls_back_a_checkpoint(tmp_path):
    results = run_distributed(_missing_checkpoint_worker, 2, str(tmp_path), timeout=300)
    for outcome in results:
        assert outcome["missing"][0] == "CheckpointError"
        assert f"--load {tmp_path / 'nope'} does not exist" in outcome["missing"][1]
        assert "--allow-fresh-start" in outcome["missing"][1]
        assert "holds no checkpoint" in outcome["empty"][1]
        assert outcome["fresh"] == (0, 2)
        assert outcome["rollback"][0] == "CheckpointError"
        assert "already holds a checkpoint at iteration 2" in outcome["rollback"][1]
        assert outcome["tracker_after"] == "2\n"
        assert outcome["files_after"] == ["iter_0000002", "latest_checkpointed_iteration.txt"]
        assert outcome["unwritable"][0] == "CheckpointError"
        assert "is not writable" in outcome["unwritable"][1] and "NotADirectoryError" in outcome["unwritable"][1]


def _damaged_checkpoint_worker(rank, world_size, root):
    import torch.distributed as dist

    directory = Path(root) / "ckpt"
    tracker = directory / "latest_checkpointed_iteration.txt"
    rank_one = directory / "iter_0000002" / "rank_00001.pt"
    _train(world_size, "--train-iters", "2", "--save", str(directory))
    outcomes = {}

    def damage(action):
        dist.barrier()
        if rank == 0:
            action()
        dist.barrier()

    def resume():
        return _train(world_size, "--train-iters", "2", "--load", str(directory))[1]

    original = rank_one.read_bytes()
    damage(lambda: rank_one.write_bytes(original[: len(original) // 2]))
    outcomes["truncated"] = resume()
    damage(lambda: rank_one.write_bytes(b""))
    outcomes["empty_file"] = resume()
    damage(lambda: rank_one.write_bytes(original))
    damage(lambda: tracker.write_text(""))
    outcomes["empty_tracker"] = resume()
    damage(lambda: tracker.write_text("99\n"))
    outcomes["missing_iteration"] = resume()
    damage(lambda: tracker.unlink())
    outcomes["no_tracker"] = resume()
    return outcomes


def test_damaged_checkpoints_name_the_file_and_the_cause_on_every_rank(tmp_path):
    results = run_distributed(_damaged_checkpoint_worker, 2, str(tmp_path), timeout=300)
    ckpt = tmp_path / "ckpt"
    rank_one = ckpt / "iter_0000002" / "rank_00001.pt"
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    for rank, outcome in enumerate(results):
        for case in ("truncated", "empty_file"):
            kind, message = outcome[case]
            assert kind == "CheckpointError", case
            if rank == 1:
                assert f"cannot read checkpoint file {rank_one}" in message and "damaged or truncated" in message
            else:
                assert "failed on rank(s) [1]" in message
        assert f"checkpoint tracker {tracker} holds ''" in outcome["empty_tracker"][1]
        assert f"names iteration 99, but {ckpt / 'iter_0000099'} does not exist" in outcome["missing_iteration"][1]
        assert "holds iter_0000002 but no latest_checkpointed_iteration.txt" in outcome["no_tracker"][1]


def _full_disk_worker(rank, world_size, root):
    import resource
    import signal

    directory = Path(root) / "ckpt"
    _train(world_size, "--train-iters", "2", "--save", str(directory))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, hard))
    try:
        _, error = _train(world_size, "--train-iters", "3", "--load", str(directory), "--save", str(directory),
                          "--override-opt_param-scheduler")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    return {
        "error": error,
        "tracker": (directory / "latest_checkpointed_iteration.txt").read_text(),
        "iter_3": sorted(p.name for p in (directory / "iter_0000003").iterdir()),
    }


def test_a_full_disk_names_the_file_and_keeps_the_previous_checkpoint(tmp_path):
    results = run_distributed(_full_disk_worker, 2, str(tmp_path), timeout=300)
    for rank, outcome in enumerate(results):
        kind, message = outcome["error"]
        assert kind == "CheckpointError"
        assert f"cannot write checkpoint file {tmp_path / 'ckpt' / 'iter_0000003' / f'rank_0000{rank}.pt'}" in message
        assert "File too large" in message and "MiB free" in message
        assert outcome["tracker"] == "2\n"
        assert outcome["iter_3"] == []  # no partial file under a final or temporary name


# -- divergence (item 2) ---------------------------------------------------------------------------------
def _divergence_worker(rank, world_size, directory):
    _, error = _train(world_size, "--train-iters", "12", "--lr", "1e30", "--lr-warmup-iters", "0",
                      "--save", directory, "--save-interval", "1")
    tracker = Path(directory) / "latest_checkpointed_iteration.txt"
    return {"error": error, "latest": int(tracker.read_text()) if tracker.exists() else None}


def test_a_diverging_run_stops_before_saving_a_non_finite_checkpoint(tmp_path):
    import torch

    directory = tmp_path / "ckpt"
    results = run_distributed(_divergence_worker, 2, str(directory), timeout=300)
    for outcome in results:
        kind, message = outcome["error"]
        assert kind == "DivergenceError"
        stopped = int(re.search(r"training diverged at iteration (\d+)", message).group(1))
        assert "Lower --lr (now 1e+30)" in message
        assert outcome["latest"] is None or outcome["latest"] < stopped
    latest = results[0]["latest"]
    if latest is not None:
        for rank in range(2):
            state = torch.load(directory / f"iter_{latest:07d}" / f"rank_0000{rank}.pt", weights_only=False)
            assert all(torch.isfinite(t).all() for t in state["model"][0].values() if torch.is_tensor(t))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_torchrun_exits_non_zero_with_one_line_on_divergence(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
        "-m", "ascendspeed.training.pretrain_gpt", *TINY, "--train-iters", "12", "--lr", "1e30",
        "--lr-warmup-iters", "0", "--save", str(tmp_path / "ckpt"),
    ]
    env = dict(os.environ, ASCENDSPEED_DEVICE="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode != 0, done.stdout[-2000:]
    assert re.search(r"^\[rank 0\] pretrain_gpt: error: training diverged at iteration \d+", done.stderr, re.M), \
        done.stderr[-3000:]
    assert "raise DivergenceError" not in done.stderr  # one line per rank, no traceback from the ranks
    assert not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()
