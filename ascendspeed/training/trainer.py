"""The training loop: megatron-core's schedules, DDP, optimizer and LR schedule on the byte-level text.

``train(args)`` runs a whole job (arguments from ``arguments.parse_args``) and returns a ``TrainResult``
on every rank, so tests and benchmarks can assert on losses without parsing output.
"""
from __future__ import annotations

import _thread
import argparse
import contextlib
import dataclasses
import inspect
import math
import signal
import sys
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_batch_on_this_cp_rank

from ascendspeed.features import AppliedFeature, all_features, apply_features, disable_features
from ascendspeed.patching import MANAGER
from ascendspeed.training import checkpointing, memory, moe_metrics, watchdog
from ascendspeed.training.activations import SavedTensorAccount, model_state_tensors
from ascendspeed.training.data import (
    DEFAULT_TEXT,
    Batch,
    EvalPlan,
    TextSplits,
    check_text_suffices,
    eval_microbatches,
    eval_windows,
    read_text,
    train_microbatches,
)
from ascendspeed.training.errors import CheckpointError, DivergenceError, Terminated, TrainingError
from ascendspeed.training.initialize import initialize_parallel, teardown
from ascendspeed.training.model import (
    build_config,
    build_model,
    build_optimizer,
    build_scheduler,
    local_parameter_count,
)
from ascendspeed.training.progress import ProgressLog, format_duration, perplexity, print_rank_0


@dataclasses.dataclass
class EvalResult:
    """Validation at one sequence length; ``skipped`` says why there is no loss."""

    seq_length: int
    loss: Optional[float] = None
    tokens: int = 0
    skipped: Optional[str] = None

    @property
    def perplexity(self) -> Optional[float]:
        return None if self.loss is None else perplexity(self.loss)


@dataclasses.dataclass
class TrainResult:
    """What a run did. ``losses[i]`` is the training loss of iteration ``start_iteration + i + 1``.

    ``activations``: (iteration, bytes) of the steps whose activations were measured (the first step of the run
    and of every logging interval): what autograd kept for backward, at the step's peak, on this rank.
    ``telemetry``: what the enabled features report over the run's training steps, summed over all ranks,
    by their telemetry's key (e.g. ``cp_ring`` with ``--log-cp-ring-overlap``); ``progress`` entries carry
    each interval's under the same key.
    """

    start_iteration: int
    iteration: int
    losses: list[float]
    learning_rates: list[float]
    validation: list[tuple[int, float]]
    final_validation: list[EvalResult]
    progress: list[dict]
    elapsed: float
    tokens_per_second: float
    num_parameters: int
    features: list[str]
    checkpoint: Optional[str] = None
    memory_account: Optional[memory.MemoryAccount] = None
    activations: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    peak_resident_bytes: int = 0
    telemetry: dict = dataclasses.field(default_factory=dict)


def _mean_over_last_stage(values: list[torch.Tensor], device: torch.device) -> float:
    """Average per-micro-batch losses held by the last pipeline stage (of every data-parallel replica)
    and hand the result to every rank, rank 0 included, whichever stage it is."""
    packed = torch.zeros(2, dtype=torch.float64, device=device)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True) and values:
        packed[0] = torch.stack([v.double() for v in values]).mean()
        packed[1] = 1.0
    dist.all_reduce(packed)
    return (packed[0] / packed[1]).item()


def _loss_func(output_tensor: torch.Tensor):
    """Mean next-byte cross entropy of one micro-batch (every position counts: there is no padding).

    The reported copy is a clone: the schedule divides the returned loss in place by the micro-batch count."""
    watchdog.report("backward")
    loss = output_tensor.float().mean()
    return loss, {"lm loss": loss.detach().clone()}


def batch_on_this_context_parallel_rank(batch: dict) -> dict:
    """This rank's chunks of every sequence, by megatron-core's ``get_batch_on_this_cp_rank`` (the balanced
    causal split Megatron-LM's ``get_batch`` makes): along the sequence for tokens, labels and positions,
    along the queries for the attention mask. Since 0.19 it takes the group (and splits over the whole world
    without one)."""
    if parallel_state.get_context_parallel_world_size() == 1:
        return batch
    if "cp_group" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                         cp_group=parallel_state.get_context_parallel_group())
    return get_batch_on_this_cp_rank(batch)


def _forward_step(data_iterator, model):
    """Each context-parallel rank takes its chunks of the sequence; the schedule scales the loss by the
    context-parallel size and DDP averages over data x context parallel ranks, as in Megatron-LM."""
    watchdog.report("forward")
    batch = batch_on_this_context_parallel_rank(dict(vars(next(data_iterator))))
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, _loss_func


def _iterators(batches: list[Batch], model: list):
    """One iterator per model chunk: the interleaved schedule walks each chunk through the micro-batches."""
    if len(model) == 1:
        return iter(batches)
    return [iter(batches) for _ in model]


def wire_schedule_hooks(config, model: list, optimizer, *, overlap_grad_reduce: bool,
                        align_grad_reduce: bool) -> None:
    """Set the hooks megatron-core's pipeline schedules call, as Megatron-LM's ``setup_model_and_optimizer``
    does; the one place that wires them.

    ``config``: the ``TransformerConfig`` the schedules read; ``model``: the DDP-wrapped chunks (one per
    virtual pipeline stage); ``optimizer``: its ``scale_loss`` scales the loss (fp16). With
    ``overlap_grad_reduce`` the schedule suspends gradient synchronisation between micro-batches
    (``no_sync``); with ``align_grad_reduce`` as well, it starts each chunk's reduction itself when that
    chunk's last backward is done (``start_grad_sync``).
    """
    def one_or_list(functions):
        return functions[0] if len(functions) == 1 else functions

    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = watchdog.reporting(finalize_model_grads,
                                                          "the gradient all-reduce (finalize_model_grads)")
    if overlap_grad_reduce:
        config.no_sync_func = one_or_list([chunk.no_sync for chunk in model])
        if align_grad_reduce:
            config.grad_sync_func = one_or_list([chunk.start_grad_sync for chunk in model])


def _all_finite(model: list, device: torch.device) -> bool:
    """Whether every parameter of every rank is finite (collective over the whole job)."""
    local = all(bool(torch.isfinite(param).all()) for chunk in model for param in chunk.parameters())
    flag = torch.tensor([0.0 if local else 1.0], device=device)
    dist.all_reduce(flag)
    return flag.item() == 0.0


class Evaluator:
    """Validation loss on non-overlapping windows of the held-out text, spread over data-parallel ranks."""

    def __init__(self, args: argparse.Namespace, model: list, tokens: torch.Tensor, device: torch.device):
        self.args = args
        self.model = model
        self.tokens = tokens
        self.device = device
        self.forward_backward = get_forward_backward_func()

    def reach(self, seq_length: int) -> Optional[str]:
        """Why the model cannot be evaluated at ``seq_length``, or None."""
        if (self.args.position_embedding_type == "learned_absolute"
                and seq_length > self.args.max_position_embeddings):
            return (f"learned_absolute position embeddings have {self.args.max_position_embeddings} "
                    f"positions (--max-position-embeddings); they cannot extrapolate")
        return None

    def evaluate(self, seq_length: int, max_windows: Optional[int] = None) -> EvalResult:
        reason = self.reach(seq_length)
        if reason is not None:
            return EvalResult(seq_length, skipped=reason)
        windows = eval_windows(self.tokens, seq_length)[:max_windows]
        dp_size = parallel_state.get_data_parallel_world_size()
        interleaved = self.args.virtual_pipeline_model_parallel_size is not None
        plan = EvalPlan.fit(len(windows), self.args.micro_batch_size, dp_size,
                            self.args.pipeline_model_parallel_size if interleaved else 1)
        if plan is None:
            return EvalResult(seq_length, skipped=f"the validation text ({len(self.tokens)} tokens) holds fewer "
                                                  f"windows of this length than this layout needs")
        batches = list(eval_microbatches(windows, plan, parallel_state.get_data_parallel_rank(), self.device))
        for chunk in self.model:
            chunk.eval()
        try:
            with torch.no_grad():
                losses = self.forward_backward(
                    forward_step_func=_forward_step,
                    data_iterator=_iterators(batches, self.model),
                    model=self.model,
                    num_microbatches=plan.num_microbatches,
                    seq_length=seq_length,
                    micro_batch_size=plan.micro_batch_size,
                    forward_only=True,
                )
        finally:
            for chunk in self.model:
                chunk.train()
        loss = _mean_over_last_stage([entry["lm loss"] for entry in losses], self.device)
        return EvalResult(seq_length, loss=loss, tokens=plan.windows_per_rank * dp_size * seq_length)


class Trainer:
    """Owns the model, optimizer and schedule of one run; ``run`` trains from the loaded iteration."""

    def __init__(self, args: argparse.Namespace, device: torch.device):
        self.args = args
        self.device = device
        self.save_lock = checkpointing.prepare_save_directory(args) if args.save else None
        try:
            self._build(args, device)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release ``--save`` for another run."""
        if self.save_lock is not None:
            self.save_lock.release()
            self.save_lock = None

    def _build(self, args: argparse.Namespace, device: torch.device) -> None:
        if args.load:
            watchdog.report(f"checking --load {args.load}")
            checkpointing.check_resume(args)
        watchdog.report("building the model")
        self.splits = TextSplits.from_bytes(read_text(args.data_path), args.split)
        check_text_suffices(self.splits, args, data_parallel_size=parallel_state.get_data_parallel_world_size())
        self.config = build_config(args)
        self.model = build_model(args, self.config, device)
        self.optimizer = build_optimizer(args, self.model)
        self.scheduler = build_scheduler(args, self.optimizer)
        wire_schedule_hooks(self.config, self.model, self.optimizer, overlap_grad_reduce=args.overlap_grad_reduce,
                            align_grad_reduce=args.align_grad_reduce)
        self.memory: Optional[memory.MemoryAccount] = None  # measured after the first step (see run)
        self.forward_backward = get_forward_backward_func()
        self.evaluator = Evaluator(args, self.model, self.splits.valid, device)
        self.iteration = 0
        if args.load:
            self._resume()
        if args.save:
            self._refuse_rolling_back(args.save)

    def _resume(self) -> None:
        args = self.args
        watchdog.report(f"loading the checkpoint of --load {args.load}")
        self.iteration = checkpointing.load_checkpoint(args, self.model, self.optimizer, self.scheduler)
        if not self.iteration:
            print_rank_0(f"no checkpoint in {args.load}: starting from scratch (--allow-fresh-start)")
            return
        print_rank_0(f"resumed from {args.load} at iteration {self.iteration}")
        if args.no_load_optim:
            print_rank_0("--no-load-optim: the optimizer state and the learning-rate schedule start afresh "
                         "(warmup included), as in Megatron-LM")
        if self.iteration == args.train_iters:
            print_rank_0(f"the checkpoint already reached --train-iters {args.train_iters}: nothing to train, "
                         f"only validating it; raise --train-iters to continue training")

    def _refuse_rolling_back(self, directory: str) -> None:
        """A run whose saves would land below the newest checkpoint already in ``--save`` would move that
        directory's tracker backwards and replace its files (a mistyped ``--load`` did exactly that)."""
        newest = checkpointing.latest_iteration(directory)
        if newest is not None and newest > self.iteration:
            raise CheckpointError(
                f"--save {directory} already holds a checkpoint at iteration {newest}, and this run starts at "
                f"iteration {self.iteration}: its saves would replace that checkpoint. Resume it with --load "
                f"{directory}, or choose another --save")

    @property
    def tokens_per_iteration(self) -> int:
        return self.args.global_batch_size * self.args.seq_length

    def num_parameters(self) -> int:
        """Parameters of the whole model, whatever its tensor, pipeline and expert layout."""
        dense, expert = local_parameter_count(self.model)
        dense = torch.tensor([dense], dtype=torch.float64, device=self.device)
        dist.all_reduce(dense, group=parallel_state.get_model_parallel_group())
        expert = torch.tensor([expert], dtype=torch.float64, device=self.device)
        dist.all_reduce(expert, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
        return int(dense.item() + expert.item())

    def learning_rate(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def train_step(self) -> tuple[float, Optional[float], bool]:
        """One iteration: forward/backward over all micro-batches, gradient sync, optimizer step.
        Returns (loss, grad norm, whether the update was applied)."""
        args = self.args
        batches = train_microbatches(
            self.splits.train,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            num_microbatches=args.num_microbatches,
            data_parallel_rank=parallel_state.get_data_parallel_rank(),
            data_parallel_size=parallel_state.get_data_parallel_world_size(),
            seed=args.seed,
            iteration=self.iteration,
            device=self.device,
        )
        watchdog.report("forward", self.iteration + 1)
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self.forward_backward(
            forward_step_func=_forward_step,
            data_iterator=_iterators(batches, self.model),
            model=self.model,
            num_microbatches=args.num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        # Reduced here, where the gradient reduction has just brought the ranks into step, rather than after the
        # optimizer: a rank that reaches it first then waits for the others once per step, not twice.
        watchdog.report("the loss all-reduce")
        loss = _mean_over_last_stage([entry["lm loss"] for entry in losses], self.device)
        watchdog.report("the optimizer step")
        updated, grad_norm, _ = self.optimizer.step()
        if updated:
            self.scheduler.step(increment=1)
        self.iteration += 1
        return loss, grad_norm, updated

    def _stop_if_diverged(self, loss: float, grad_norm: Optional[float]) -> None:
        """Megatron-LM's ``--check-for-nan-in-loss-and-grad``: the loss and the gradient norm of an applied
        update are the same on every rank, so every rank stops together. (An fp16 update skipped for an
        overflowing gradient is the loss scaler's normal business.)"""
        bad = [f"loss {loss}"] if not math.isfinite(loss) else []
        if grad_norm is not None and not math.isfinite(grad_norm):
            bad.append(f"gradient norm {grad_norm}")
        if bad:
            self._diverged(f"iteration {self.iteration}: {' and '.join(bad)}")

    def _diverged(self, what: str) -> None:
        latest = checkpointing.latest_iteration(self.args.save) if self.args.save else None
        resume = (f"resume from iteration {latest} (--load {self.args.save} --override-opt_param-scheduler)"
                  if latest else "restart")
        raise DivergenceError(
            f"training diverged at {what}; stopped without saving a checkpoint of it. Lower --lr (now "
            f"{self.args.lr:g}) or raise --lr-warmup-iters, then {resume}; "
            f"--no-check-for-nan-in-loss-and-grad trains on regardless")

    def save(self) -> str:
        watchdog.report("saving the checkpoint", self.iteration)
        if self.args.check_for_nan_in_loss_and_grad and not _all_finite(self.model, self.device):
            self._diverged(f"iteration {self.iteration}: a parameter is no longer finite")
        directory = checkpointing.save_checkpoint(self.args, self.iteration, self.model, self.optimizer,
                                                  self.scheduler)
        print_rank_0(f"saved checkpoint {directory}")
        return str(directory)

    def periodic_validation(self) -> float:
        watchdog.report("validation")
        windows = self.args.eval_iters * self.args.global_batch_size
        result = self.evaluator.evaluate(self.args.seq_length, max_windows=windows)
        if result.loss is None:
            raise ValueError(f"cannot validate at --seq-length {self.args.seq_length}: {result.skipped}")
        print_rank_0(f"validation at iteration {self.iteration} | loss {result.loss:.4f} | "
                     f"perplexity {result.perplexity:.2f}")
        return result.loss

    def run(self, features: list[AppliedFeature]) -> TrainResult:
        args = self.args
        start = self.iteration
        num_parameters = self.num_parameters()
        names = [feature.name for feature in features]
        self._print_header(num_parameters, names)
        validation = [(start, self.periodic_validation())]
        log = ProgressLog(args.train_iters, start, self.tokens_per_iteration)
        reports = [report for report in (feature.telemetry() for feature in features) if report is not None]
        losses, learning_rates, progress, activations = [], [], [], []
        checkpoint = None
        while self.iteration < args.train_iters:
            learning_rates.append(self.learning_rate())
            for report in reports:
                report.step_started()
            measured = self.iteration == start or self.iteration % args.log_interval == 0
            account = SavedTensorAccount(model_state_tensors(self.model)) if measured else None
            with account.recording() if measured else contextlib.nullcontext():
                loss, grad_norm, updated = self.train_step()
            if measured:
                activations.append((self.iteration, account.peak))
            for report in reports:
                report.step_finished()
            if args.check_for_nan_in_loss_and_grad:
                self._stop_if_diverged(loss, grad_norm if updated else None)
            if self.memory is None:  # torch allocates the optimizer state in the first step
                self.memory = memory.account(self.model, self.optimizer)
                print_rank_0(self.memory.line(activation_bytes=activations[-1][1]))
            losses.append(loss)
            log.record(loss, skipped=not updated)
            done = self.iteration == args.train_iters
            if self.iteration % args.log_interval == 0 or done:
                loss_scale = self.optimizer.get_loss_scale().item() if args.fp16 else None
                aux_losses = moe_metrics.aux_losses(args.num_microbatches * log.interval_iterations,
                                                    args.num_layers) if args.num_experts else None
                progress.append(log.line(self.iteration, learning_rates[-1], grad_norm, loss_scale, aux_losses,
                                         activation_bytes=activations[-1][1]))
                for report in reports:
                    progress[-1][report.key] = report.close_interval(self.iteration)
            if args.eval_interval and self.iteration % args.eval_interval == 0 and not done:
                validation.append((self.iteration, self.periodic_validation()))
            if args.save and (done or (args.save_interval and self.iteration % args.save_interval == 0)):
                checkpoint = self.save()
        elapsed = time.perf_counter() - log.started
        if self.iteration > start:
            validation.append((self.iteration, self.periodic_validation()))
        watchdog.report("the final validation")
        final = [self.evaluator.evaluate(length) for length in args.eval_seq_lengths]
        self._print_summary(validation, final, elapsed)
        telemetry = {report.key: report.close_run() for report in reports}
        print_rank_0(memory.peak_line())
        trained = self.iteration - start
        return TrainResult(
            start_iteration=start,
            iteration=self.iteration,
            losses=losses,
            learning_rates=learning_rates,
            validation=validation,
            final_validation=final,
            progress=progress,
            elapsed=elapsed,
            tokens_per_second=trained * self.tokens_per_iteration / elapsed if trained else 0.0,
            num_parameters=num_parameters,
            features=names,
            checkpoint=checkpoint,
            memory_account=self.memory,
            activations=activations,
            peak_resident_bytes=memory.peak_resident_bytes(),
            telemetry=telemetry,
        )

    def _print_header(self, num_parameters: int, features: list[str]) -> None:
        args = self.args
        data = ", ".join(args.data_path) if args.data_path else f"embedded {DEFAULT_TEXT.name}"
        vpp = f", vpp {args.virtual_pipeline_model_parallel_size}" if args.virtual_pipeline_model_parallel_size else ""
        moe_layout = f", ep {args.expert_model_parallel_size}" if args.num_experts else ""
        experts = (f" in {args.num_experts} experts (top-{args.moe_router_topk}, {args.moe_token_dispatcher_type} "
                   f"dispatcher, expert ffn {args.moe_ffn_hidden_size})" if args.num_experts else "")
        print_rank_0(
            f"ascendspeed pretrain_gpt: {args.world_size} rank(s) on {args.device} "
            f"(tp {args.tensor_model_parallel_size}, pp {args.pipeline_model_parallel_size}{vpp}, "
            f"dp {args.data_parallel_size}{moe_layout}), backend {args.distributed_backend}\n"
            f"  model: GPT {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads, "
            f"ffn {args.ffn_hidden_size}{experts}, {args.position_embedding_type} positions, "
            f"{num_parameters / 1e6:.2f}M parameters, {'bf16' if args.bf16 else 'fp16' if args.fp16 else 'fp32'}\n"
            f"  data: {data}: {len(self.splits.train):,} training / {len(self.splits.valid):,} validation "
            f"bytes (byte-level tokens)\n"
            f"  batch: {args.global_batch_size} sequences of {args.seq_length} = "
            f"{self.tokens_per_iteration:,} tokens per iteration ({args.num_microbatches} micro-batch(es) of "
            f"{args.micro_batch_size} per data-parallel rank), {args.train_iters} iterations\n"
            f"  ascendspeed features: {', '.join(features) if features else 'none enabled'}"
            f" (available: {', '.join(f.name for f in all_features()) or 'none'})"
        )

    def _print_summary(self, validation: list, final: list[EvalResult], elapsed: float) -> None:
        (first_iteration, first), (last_iteration, last) = validation[0], validation[-1]
        lines = [
            f"validation loss {first:.4f} -> {last:.4f} (perplexity {perplexity(first):.2f} -> "
            f"{perplexity(last):.2f}) from iteration {first_iteration} to {last_iteration}, "
            f"training took {format_duration(elapsed)}",
            f"final validation on the whole held-out text ({len(self.splits.valid):,} tokens):",
            f"  {'length':>7}  {'loss':>8}  {'perplexity':>10}",
        ]
        for result in final:
            if result.loss is None:
                lines.append(f"  {result.seq_length:>7}  skipped: {result.skipped}")
            elif math.isfinite(result.loss):
                lines.append(f"  {result.seq_length:>7}  {result.loss:>8.4f}  {result.perplexity:>10.2f}")
            else:
                lines.append(f"  {result.seq_length:>7}  {result.loss:>8}  {'inf':>10}")
        print_rank_0("\n".join(lines))


@contextlib.contextmanager
def _terminate_on_sigterm():
    """SIGTERM (torchrun, a scheduler) raises ``Terminated`` in the main thread, so the run unwinds: the
    temporary file of a save in progress is removed, ``--save`` released. Python's default is to die on
    the spot, leaving a full-size temporary rank file behind. Repeated SIGTERMs (a scheduler's and then
    torchrun's) are ignored while it unwinds; SIGKILL still ends it at once.

    A signal's handler runs at whatever bytecode the main thread is at, which can be a weakref callback or a
    ``__del__`` (torch.save drops such references): Python cannot propagate an exception from there, it
    only reports it through ``sys.unraisablehook``. That hook sees the swallowed ``Terminated`` and marks
    the signal pending again, so it is raised at the next ordinary statement instead of being lost."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    raising = []  # non-empty from raising Terminated until it is known to be lost

    def handler(signum, frame):
        if raising:
            return
        received.append(signum)
        raising.append(signum)
        raise Terminated(signum, watchdog.PROGRESS.describe())

    previous_unraisable_hook = sys.unraisablehook

    def redeliver_swallowed_termination(unraisable):
        if not (isinstance(unraisable.exc_value, Terminated) and raising):
            previous_unraisable_hook(unraisable)
            return
        raising.clear()
        # From another thread, so the signal is only marked pending: raised in the main thread here, the
        # handler would run at once, inside this hook, and be swallowed again. A bare _thread, since
        # threading.Thread.start() waits in Python code, where the handler would run just the same.
        _thread.start_new_thread(_thread.interrupt_main, (unraisable.exc_value.signum,))

    previous = signal.signal(signal.SIGTERM, handler)
    sys.unraisablehook = redeliver_swallowed_termination
    try:
        yield
    except Terminated:
        raise
    except BaseException as failure:
        if received:  # the signal's exception came back re-wrapped (Python 3.11's pickle: a PicklingError)
            raise Terminated(received[0], watchdog.PROGRESS.describe()) from failure
        raise
    finally:
        sys.unraisablehook = previous_unraisable_hook
        signal.signal(signal.SIGTERM, signal.SIG_IGN if received else previous)


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"


def train(args: argparse.Namespace) -> TrainResult:
    """Run the job ``args`` describes: device shims, features, process groups, training, teardown."""
    from ascendspeed.adaptor import install

    install()
    already = MANAGER.features()
    features = apply_features(args)
    state = initialize_parallel(args)
    watchdog.report("start-up", 0)
    guard, error = None, None
    try:
        with _terminate_on_sigterm():
            guard = watchdog.start(args, on_abort=checkpointing.remove_in_flight_temporaries)
            trainer = Trainer(args, state.device)
            try:
                return trainer.run(features)
            finally:
                trainer.close()
    except TrainingError as failure:  # every rank raises it together, each with its own message
        error = failure
        raise
    except RuntimeError as failure:  # a collective failed: name the rank that left, if it said so
        error = failure
        left = guard.peers_that_left() if guard is not None else []
        if left:
            error = TrainingError(f"{'; '.join(left)}; this rank stops too (it was in {watchdog.PROGRESS.describe()}: "
                                  f"{_first_line(failure)})")
            raise error from failure
        raise
    except BaseException as failure:
        error = failure
        raise
    finally:
        if guard is not None:
            guard.stop(error)
        teardown(state)
        # A later run in this process without a feature's flag must not run that feature.
        disable_features([feature.name for feature in features if feature.name not in already])
