"""A hostile user against the pretraining entry: bad flags, resumes that disagree with their checkpoint,
divergence, damaged or missing checkpoints, full disks, bad data files. Nothing may go silently wrong:
each case gets an error naming the flag or file and the fix, on every rank, and no rank is left hanging.

Runs real megatron-core training on 2 gloo processes; faults are real (truncated files, a file-size
limit for the full disk), nothing is mocked.
"""
import gzip
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.checkpoints import stored_tensors
from tests.helpers.distributed import run_distributed

REPO = Path(__file__).resolve().parents[2]

TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--micro-batch-size", "4", "--lr", "5e-3", "--min-lr", "5e-4", "--lr-warmup-iters", "1",
    "--eval-iters", "1", "--log-interval", "100", "--eval-interval", "0", "--eval-seq-lengths", "64",
    "--split", "998,2",  # a small held-out part: the final validation runs, over 40 windows instead of 1,000
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


@pytest.mark.entry_supervision
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


@pytest.mark.entry_supervision
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
        assert outcome["files_after"] == [".ascendspeed_save.lock", "iter_0000002", "latest_checkpointed_iteration.txt"]
        assert outcome["unwritable"][0] == "CheckpointError"
        assert "is not writable" in outcome["unwritable"][1] and "NotADirectoryError" in outcome["unwritable"][1]


def _damaged_checkpoint_worker(rank, world_size, root):
    import torch.distributed as dist

    directory = Path(root) / "ckpt"
    tracker = directory / "latest_checkpointed_iteration.txt"
    shard = directory / "iter_0000002" / "__0_0.distcp"  # data-parallel replicas: rank 0 writes every tensor
    _train(world_size, "--train-iters", "2", "--save", str(directory))
    outcomes = {}

    def damage(action):
        dist.barrier()
        if rank == 0:
            action()
        dist.barrier()

    def resume():
        return _train(world_size, "--train-iters", "2", "--load", str(directory))[1]

    original = shard.read_bytes()
    damage(lambda: shard.write_bytes(original[: len(original) // 2]))
    outcomes["truncated"] = resume()
    damage(lambda: shard.write_bytes(b""))
    outcomes["empty_file"] = resume()
    damage(lambda: shard.write_bytes(original))
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
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    for rank, outcome in enumerate(results):
        for case in ("truncated", "empty_file"):
            kind, message = outcome[case]
            assert kind == "CheckpointError", case
            named = re.escape(str(ckpt / "iter_0000002"))
            assert re.search(f"cannot (load|read) checkpoint {named}", message), message
            assert "rank 0: EOFError" in message and "damaged" in message
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
        "saved": sorted(p.name for p in directory.iterdir()),
    }


@pytest.mark.entry_supervision
def test_a_full_disk_names_the_file_and_keeps_the_previous_checkpoint(tmp_path):
    results = run_distributed(_full_disk_worker, 2, str(tmp_path), timeout=300)
    for rank, outcome in enumerate(results):
        kind, message = outcome["error"]
        assert kind == "CheckpointError"
        assert f"cannot write checkpoint {tmp_path / 'ckpt' / 'iter_0000003'} (staged in " in message
        assert "File too large" in message and "MiB free" in message
        assert outcome["tracker"] == "2\n"
        # no partial checkpoint under its final or its staging name
        assert outcome["saved"] == [".ascendspeed_save.lock", "iter_0000002", "latest_checkpointed_iteration.txt"]


# -- divergence (item 2) ---------------------------------------------------------------------------------
def _divergence_worker(rank, world_size, directory):
    _, error = _train(world_size, "--train-iters", "12", "--lr", "1e30", "--lr-warmup-iters", "0",
                      "--save", directory, "--save-interval", "1")
    tracker = Path(directory) / "latest_checkpointed_iteration.txt"
    return {"error": error, "latest": int(tracker.read_text()) if tracker.exists() else None}


@pytest.mark.entry_supervision
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
        tensors = stored_tensors(directory / f"iter_{latest:07d}")
        assert tensors and all(torch.isfinite(t).all() for t in tensors.values())


@pytest.mark.entry_supervision
def test_torchrun_exits_non_zero_with_one_line_on_divergence(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
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


# -- round 2 (issue 21) -------------------------------------------------------------------------------------
#: Every run of a round-2 job decays over the same iterations, so resuming with another --train-iters
#: needs no schedule flag.
SCHEDULE = ("--lr-decay-iters", "10")


def _digests(tensors) -> list[str]:
    """Exact fingerprints of ``tensors`` as a sorted list: equal lists mean bit-identical values."""
    import hashlib

    return sorted(hashlib.sha1(t.detach().float().contiguous().numpy().tobytes()).hexdigest() for t in tensors)


def _resumed(world_size, root, *flags):
    """Build and resume a trainer as ``train`` does, save what it loaded (fingerprinted as ``_saved``), then
    train on; returns what it saw."""
    import hashlib

    from ascendspeed.features import apply_features, disable_features
    from ascendspeed.training import checkpointing
    from ascendspeed.training.arguments import parse_args
    from ascendspeed.training.initialize import initialize_parallel, teardown
    from ascendspeed.training.model import unwrap
    from ascendspeed.training.trainer import Trainer

    args = parse_args([*TINY, *SCHEDULE, *flags], world_size=world_size)
    features = apply_features(args)
    state = initialize_parallel(args)
    try:
        trainer = Trainer(args, state.device)
        seen = {"local_weights": _digests(p for _, p in unwrap(trainer.model[0]).named_parameters()),
                "start": trainer.iteration}
        args.save = str(Path(root) / f"resaved-{hashlib.sha1(' '.join(flags).encode()).hexdigest()[:8]}")
        checkpointing.save_checkpoint(args, trainer.iteration, trainer.model, trainer.optimizer, trainer.scheduler)
        seen.update(_saved(args.save))
        args.save = None
        seen["losses"] = trainer.run(features).losses
        trainer.close()
        return seen
    finally:
        teardown(state)
        disable_features(features)


def _saved(directory):
    """What the newest checkpoint in ``directory`` holds (every rank's shards), fingerprinted: the model's
    weights, the fp32 main weights (the weights themselves where the checkpoint has none) and Adam's first
    moments."""
    iteration = int((Path(directory) / "latest_checkpointed_iteration.txt").read_text())
    tensors = stored_tensors(Path(directory) / f"iter_{iteration:07d}")
    weights = {key: value for key, value in tensors.items() if not key.startswith("optimizer.")}
    main = {key: value for key, value in tensors.items()  # without / with the distributed optimizer
            if key.startswith(("optimizer.state.fp32_param.", "optimizer.state.param."))}
    return {"weights": _digests(weights.values()), "main": _digests((main or weights).values()),
            "exp_avg": _digests(v for k, v in tensors.items() if k.startswith("optimizer.state.exp_avg."))}


#: Resumes that change the model or the optimizer: flags -> what the refusal must say.
REFUSED_RESUMES = {
    "rope": (["--position-embedding-type", "rope"],
             ["--position-embedding-type: checkpoint alibi, now rope", "pass the checkpoint's values "
              "(--position-embedding-type alibi)"]),
    "learned_absolute": (["--position-embedding-type", "learned_absolute"],
                         ["--position-embedding-type: checkpoint alibi, now learned_absolute"]),
    "layers": (["--num-layers", "3"], ["--num-layers: checkpoint 2, now 3"]),
    "vocabulary": (["--make-vocab-size-divisible-by", "512"],
                   ["padded vocabulary size: checkpoint 256, now 512 (set by --make-vocab-size-divisible-by; the "
                    "checkpoint used --make-vocab-size-divisible-by 128)"]),
    "gelu": (["--no-swiglu"], ["--swiglu: checkpoint True, now False", "--ffn-hidden-size: checkpoint 128, now 256",
                               "--ffn-hidden-size 128 --swiglu"]),
    "sgd": (["--optimizer", "sgd"], ["--optimizer: checkpoint adam, now sgd", "--no-load-optim"]),
    "distributed_optimizer": (["--use-distributed-optimizer"],
                              ["--use-distributed-optimizer: checkpoint False, now True", "--no-load-optim"]),
}


def _architecture_and_precision_worker(rank, world_size, root):
    fp32, bf16, reuse = (str(Path(root) / name) for name in ("fp32", "bf16", "reuse"))
    _train(world_size, "--train-iters", "2", "--save", fp32, *SCHEDULE)
    outcomes = {"refused": {case: _train(world_size, "--train-iters", "3", "--load", fp32, *SCHEDULE, *flags)[1]
                            for case, (flags, _) in REFUSED_RESUMES.items()}}
    _train(world_size, "--train-iters", "2", "--save", bf16, "--bf16", *SCHEDULE)
    _train(world_size, "--train-iters", "2", "--save", reuse, "--bf16", "--reuse-fp32-param",
           "--use-distributed-optimizer", *SCHEDULE)
    outcomes["saved"] = {name: _saved(path) for name, path in (("fp32", fp32), ("bf16", bf16), ("reuse", reuse))}
    outcomes["fp32_to_bf16"] = _resumed(world_size, root, "--train-iters", "3", "--load", fp32, "--bf16")
    outcomes["bf16_to_fp32"] = _resumed(world_size, root, "--train-iters", "3", "--load", bf16)
    outcomes["reuse_to_fp32"] = _resumed(world_size, root, "--train-iters", "3", "--load", reuse,
                                         "--use-distributed-optimizer")
    return outcomes


def test_a_resume_into_another_model_is_refused_and_a_precision_change_continues_exactly(tmp_path):
    import math

    results = run_distributed(_architecture_and_precision_worker, 2, str(tmp_path), timeout=400)
    for outcome in results:
        for case, (_, expected) in REFUSED_RESUMES.items():
            refusal = outcome["refused"][case]
            assert refusal is not None, f"{case}: resumed without a word"
            assert refusal[0] in ("ResumeError", "CheckpointError"), (case, refusal)
            for text in expected:
                assert text in refusal[1], (case, refusal[1])
        saved = outcome["saved"]
        # fp32 -> bf16: the fp32 weights become the main weights, the moments carry over, bit for bit.
        assert outcome["fp32_to_bf16"]["main"] == saved["fp32"]["weights"]
        assert outcome["fp32_to_bf16"]["exp_avg"] == saved["fp32"]["exp_avg"]
        # bf16 -> fp32: the model takes the fp32 main weights, not their bf16 rounding.
        assert outcome["bf16_to_fp32"]["weights"] == saved["bf16"]["main"] != saved["bf16"]["weights"]
        assert outcome["bf16_to_fp32"]["exp_avg"] == saved["bf16"]["exp_avg"]
        # --reuse-fp32-param bf16 with the distributed optimizer -> fp32 with it: every shard's main weights.
        assert outcome["reuse_to_fp32"]["main"] == saved["reuse"]["main"]
        assert outcome["reuse_to_fp32"]["exp_avg"] == saved["reuse"]["exp_avg"]
        assert outcome["reuse_to_fp32"]["weights"] != saved["reuse"]["weights"]
        for case in ("fp32_to_bf16", "bf16_to_fp32", "reuse_to_fp32"):
            assert outcome[case]["start"] == 2 and len(outcome[case]["losses"]) == 1, case
            assert math.isfinite(outcome[case]["losses"][0]), case
    # Every rank's fp32 model holds every shard's main weights (gathered), so the ranks agree.
    assert results[0]["reuse_to_fp32"]["local_weights"] == results[1]["reuse_to_fp32"]["local_weights"]


#: Layouts of a 4-layer model on 2 ranks: pipeline stages tie the embedding to the output layer across ranks
#: (a grad-buffer bucket of its own), virtual stages store each rank's two layer chunks as ``model0``/``model1``.
LAYOUTS = {"dp2": [], "tp2": ["--tensor-model-parallel-size", "2"], "pp2": ["--pipeline-model-parallel-size", "2"],
           "vpp2": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]}
#: Small buckets: the grad buffer has several (each padded), as a large model's with --overlap-grad-reduce.
LAYOUT_CHANGE_FLAGS = ("--num-layers", "4", "--use-distributed-optimizer", "--overlap-grad-reduce",
                       "--ddp-bucket-size", "20000", "--global-batch-size", "8", "--lr-decay-iters", "6")


def _layout_change_worker(rank, world_size, root):
    """Save at iteration 3 in one layout, resume in another: the resumed iterations are the saving layout's
    uninterrupted run's (one global batch of 8 in every layout, so every layout sees the same data)."""
    from ascendspeed.training import dist_checkpoint

    outcomes = {}
    for saved_in, resumed_in in (("tp2", ["dp2"]), ("dp2", ["tp2", "vpp2"]), ("pp2", ["dp2", "pp2"]),
                                 ("vpp2", ["pp2"])):
        directory = str(Path(root) / saved_in)
        straight, _ = _train(world_size, "--train-iters", "6", *LAYOUT_CHANGE_FLAGS, *LAYOUTS[saved_in])
        _train(world_size, "--train-iters", "3", "--save", directory, *LAYOUT_CHANGE_FLAGS, *LAYOUTS[saved_in])
        for layout in resumed_in:
            resumed, error = _train(world_size, "--train-iters", "6", "--load", directory, *LAYOUT_CHANGE_FLAGS,
                                    *LAYOUTS[layout])
            outcomes[saved_in, layout] = (straight.losses[3:], resumed and resumed.losses, error)
    # What Megatron-LM writes by default (and the entry wrote with pipeline stages before it stored the
    # model-space form): the distributed optimizer's state per data-parallel bucket, bound to its TP x PP.
    per_bucket = dict(dist_checkpoint.content_metadata(True), distrib_optim_sharding_type="dp_reshardable")
    stored_form, dist_checkpoint.content_metadata = dist_checkpoint.content_metadata, lambda _: per_bucket
    try:
        _train(world_size, "--train-iters", "3", "--save", str(Path(root) / "per_bucket"), *LAYOUT_CHANGE_FLAGS,
               *LAYOUTS["pp2"])
    finally:
        dist_checkpoint.content_metadata = stored_form
    outcomes["per_bucket"] = _train(world_size, "--train-iters", "6", "--load", str(Path(root) / "per_bucket"),
                                    *LAYOUT_CHANGE_FLAGS)[1]
    return outcomes


def test_a_checkpoint_resumes_at_another_parallel_layout(tmp_path):
    """Megatron's distributed format reshards: TP 2 -> DP 2 and back, DP 2 <-> PP 2 (virtual stages
    included), DP 2 -> 1 rank and 1 rank -> DP 2 continue the saving layout's run, the distributed optimizer's
    state included (stored right with several grad-buffer buckets: feature
    ``accelerator.model_space_checkpoints``; without it the resumed losses are 10-20 % off). A per-bucket
    optimizer state at another TP x PP is refused with the fix."""
    results = run_distributed(_layout_change_worker, 2, str(tmp_path), timeout=600)
    for outcome in results:
        for change in (("tp2", "dp2"), ("dp2", "tp2"), ("dp2", "vpp2"), ("pp2", "dp2"), ("pp2", "pp2"),
                       ("vpp2", "pp2")):
            straight, resumed, error = outcome[change]
            assert error is None, (change, error)
            assert resumed == pytest.approx(straight, rel=1e-6, abs=0), change
        error = outcome["per_bucket"]
        assert error is not None and error[0] == "CheckpointError", error
        assert "'dp_reshardable', which loads only at the tensor- and pipeline-parallel sizes that wrote it (1, 2)" \
            in error[1] and "--no-load-optim" in error[1], error[1]
    # the data-parallel checkpoint on one rank, and one rank's checkpoint on two
    one_rank = run_distributed(_one_rank_worker, 1, str(tmp_path), timeout=300)[0]
    resumed, error = one_rank["dp2"]
    assert error is None, error
    assert resumed == pytest.approx(results[0]["dp2", "tp2"][0], rel=1e-6, abs=0)
    resumed, error = run_distributed(_layout_resume_worker, 2, str(tmp_path / "one_rank"), timeout=300)[0]
    assert error is None, error
    assert resumed == pytest.approx(one_rank["straight"], rel=1e-6, abs=0)


def _one_rank_worker(rank, world_size, root):
    straight, _ = _train(world_size, "--train-iters", "6", *LAYOUT_CHANGE_FLAGS)
    _train(world_size, "--train-iters", "3", "--save", str(Path(root) / "one_rank"), *LAYOUT_CHANGE_FLAGS)
    dp2, error = _train(world_size, "--train-iters", "6", "--load", str(Path(root) / "dp2"), *LAYOUT_CHANGE_FLAGS)
    return {"straight": straight.losses[3:], "dp2": (dp2 and dp2.losses, error)}


def _layout_resume_worker(rank, world_size, directory):
    resumed, error = _train(world_size, "--train-iters", "6", "--load", directory, *LAYOUT_CHANGE_FLAGS)
    return resumed and resumed.losses, error


#: Another process holding the ``--save`` lock: what a second run of the entry on that directory meets.
HOLD_SAVE_LOCK = """
import sys
from pathlib import Path
from ascendspeed.training.save_lock import SaveDirectoryLock
lock = SaveDirectoryLock(Path(sys.argv[1]))
lock.acquire()
print("locked", flush=True)
sys.stdin.read()
"""


def _make_unwritable(path: Path):
    """Make ``path`` refuse new files, for root too (root ignores permission bits, not the immutable
    attribute); returns the undo, or None where the file system cannot."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        return lambda: path.chmod(0o755)
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        return None
    return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)


def _save_directory_worker(rank, world_size, root):
    import torch.distributed as dist

    directory = Path(root) / "ckpt"
    outcomes, holder, undo = {}, None, None
    if rank == 0:
        directory.mkdir(parents=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        holder = subprocess.Popen([sys.executable, "-c", HOLD_SAVE_LOCK, str(directory)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)
        assert holder.stdout.readline().strip() == "locked"
        outcomes["holder"] = holder.pid
    dist.barrier()
    _, outcomes["busy"] = _train(world_size, "--train-iters", "2", "--save", str(directory), *SCHEDULE)
    dist.barrier()
    if rank == 0:
        holder.kill()  # the holder crashes: its lock must not outlive it
        holder.wait()
    dist.barrier()
    _, outcomes["after_crash"] = _train(world_size, "--train-iters", "2", "--save", str(directory), *SCHEDULE)
    stale = directory / ".iter_0000003.tmp"  # what a SIGKILL during a save leaves
    blocked = directory / "iter_0000003"
    dist.barrier()
    if rank == 0:
        shutil.copytree(directory / "iter_0000002", stale)
        blocked.mkdir()
        undo = _make_unwritable(blocked)
        outcomes["unwritable_possible"] = undo is not None
    dist.barrier()
    try:
        _, outcomes["unwritable"] = _train(world_size, "--train-iters", "3", "--load", str(directory), "--save",
                                           str(directory), *SCHEDULE)
    finally:
        if undo is not None:
            undo()
    outcomes["stale_left"] = stale.exists()
    outcomes["tracker"] = (directory / "latest_checkpointed_iteration.txt").read_text()
    return outcomes


@pytest.mark.entry_supervision
def test_a_save_directory_in_use_is_refused_and_a_failed_save_names_its_true_cause(tmp_path):
    from ascendspeed.training.save_lock import SaveDirectoryLock

    results = run_distributed(_save_directory_worker, 2, str(tmp_path), timeout=300)
    directory = tmp_path / "ckpt"
    holder = results[0]["holder"]
    for rank, outcome in enumerate(results):
        kind, message = outcome["busy"]
        assert kind == "CheckpointError"
        assert f"--save {directory} is in use by another run (host " in message and f"pid {holder}," in message
        assert "choose another --save" in message
        assert outcome["after_crash"] is None  # the crashed holder's lock went with it
        assert not outcome["stale_left"]  # removed at start-up
        if results[0]["unwritable_possible"]:
            kind, message = outcome["unwritable"]
            assert kind == "CheckpointError"
            if rank == 0:
                assert f"cannot move the written checkpoint {directory / '.iter_0000003.tmp'} into place as " \
                       f"{directory / 'iter_0000003'}" in message
                assert f"{directory / 'iter_0000003'} is not writable" in message and "free space" not in message
            else:
                assert "failed on rank(s) [0]" in message
        assert outcome["tracker"] == "2\n"
    lock = SaveDirectoryLock(directory)  # every run above released it
    assert lock.acquire() is None
    lock.release()


def _entry(tmp_path, *flags):
    """The entry under torchrun in its own session (so a test can signal the whole job)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "ascendspeed.training.pretrain_gpt", *TINY, *flags,
    ]
    env = dict(os.environ, ASCENDSPEED_DEVICE="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _worker_pid(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of torchrun's worker process for ``rank`` (from its environment)."""
    for child in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise AssertionError(f"no worker of rank {rank} under torchrun {launcher.pid}")


def _communicate(launcher: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        return launcher.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_job(launcher)
        out, err = launcher.communicate()
        raise AssertionError(f"the job did not end within {timeout:.0f} s:\n{out[-2000:]}\n{err[-4000:]}") from None


def _stop_job(launcher: subprocess.Popen) -> None:
    if launcher.poll() is None:
        os.killpg(launcher.pid, 9)
        launcher.wait()


@pytest.mark.entry_supervision
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds torchrun's workers through /proc")
def test_a_frozen_rank_stops_every_rank_within_the_stall_timeout_naming_it(tmp_path):
    import time

    launcher = _entry(tmp_path, "--train-iters", "100000", "--log-interval", "1", "--rank-stall-timeout-seconds", "4")
    try:
        trained_since = None
        for line in launcher.stdout:  # training runs: both ranks are past start-up ...
            if trained_since is None and re.match(r"iteration +3/", line):
                trained_since = time.monotonic()
            if trained_since is not None and time.monotonic() > trained_since + 1.5:
                break  # ... and the heartbeats (every 0.5 s) have reported training iterations
        frozen = _worker_pid(launcher, 1)
        os.kill(frozen, 19)  # SIGSTOP
        stopped = time.monotonic()
        _, err = _communicate(launcher, timeout=60)
        took = time.monotonic() - stopped
    finally:
        _stop_job(launcher)
    assert launcher.returncode != 0
    line = re.search(r"^\[rank 0\] pretrain_gpt: error: rank 1 \(host \S+, pid (\d+)\) stopped making progress: no "
                     r"heartbeat for \d+ s \(--rank-stall-timeout-seconds 4\); it last reported (.+?) at iteration "
                     r"(\d+) .*killed the frozen process", err, re.M)
    assert line, err[-3000:]
    print(line.group(0), f"\nstopped {took:.1f} s after SIGSTOP")
    assert int(line.group(1)) == frozen and int(line.group(3)) >= 1  # its last beat, up to 0.5 s old
    assert line.group(2) in ("forward", "backward", "the optimizer step", "the loss all-reduce",
                             "the gradient all-reduce (finalize_model_grads)"), line.group(2)
    assert took < 30, f"the job took {took:.0f} s to stop"


@pytest.mark.entry_supervision
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs a POSIX process group")
def test_sigterm_during_a_save_leaves_no_temporary_file(tmp_path):
    import glob
    import time

    directory = tmp_path / "ckpt"
    launcher = _entry(tmp_path, "--hidden-size", "256", "--train-iters", "1000", "--save", str(directory),
                      "--save-interval", "1")
    try:
        deadline = time.monotonic() + 200
        while not glob.glob(str(directory / ".iter_*.tmp")):
            assert launcher.poll() is None and time.monotonic() < deadline, "no save began"
            time.sleep(0.001)
        os.killpg(launcher.pid, 15)  # SIGTERM to torchrun, which passes it on to its workers
        _, err = _communicate(launcher, timeout=90)
    finally:
        _stop_job(launcher)
    assert launcher.returncode != 0
    print("\n".join(re.findall(r"^\[rank \d\] pretrain_gpt: .*$", err, re.M)))
    stopped = re.findall(r"^\[rank (\d)\] pretrain_gpt: stopped by signal 15 during (.+?)(?: at iteration \d+)?; "
                         r"temporary checkpoint files removed", err, re.M)
    # a save writes its shards, then waits for every rank's (the staging directory exists through both)
    assert {"saving the checkpoint", "the all-reduce after saving iteration"} & {
        re.sub(r" \d+$", "", phase) for _, phase in stopped}, err[-3000:]
    # A rank the signal found waiting for the other in a collective names the rank that left.
    left = re.findall(r"^\[rank (\d)\] pretrain_gpt: error: rank \d \(host \S+, pid \d+\) left the run with Terminated: "
                      r"stopped by signal 15", err, re.M)
    assert sorted([rank for rank, _ in stopped] + left) == ["0", "1"], err[-3000:]
    assert not re.search(r"^\[rank\d\]:Traceback", err, re.M), err[-3000:]
    assert not list(directory.rglob("*.tmp"))
    tracker = directory / "latest_checkpointed_iteration.txt"
    if tracker.exists():  # whatever is the latest is complete
        assert stored_tensors(directory / f"iter_{int(tracker.read_text()):07d}")


@pytest.mark.entry_supervision
def test_a_sigterm_that_lands_in_a_weakref_callback_still_stops_the_run():
    """Python swallows an exception raised inside a weakref callback (it only reports it as "Exception
    ignored in"); a SIGTERM whose handler ran there must still stop the run (CI saw a rank save on after it)."""
    import signal
    import time
    import weakref

    from ascendspeed.training.errors import Terminated
    from ascendspeed.training.trainer import _terminate_on_sigterm

    class Referent:
        pass

    def callback(_):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10_000):  # the handler runs at one of these bytecodes, inside the callback
            pass

    previous = signal.getsignal(signal.SIGTERM)
    ran_after_the_signal = []
    try:
        with pytest.raises(Terminated, match="stopped by signal 15"):
            with _terminate_on_sigterm():
                referent = Referent()
                reference = weakref.ref(referent, callback)
                del referent
                time.sleep(5)  # the run goes on (before the fix: to its end, saving on)
                ran_after_the_signal.append(reference)
        assert not ran_after_the_signal
    finally:
        signal.signal(signal.SIGTERM, previous)
