"""What a run prints: one line per logging interval and a validation summary, from rank 0 only."""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Optional

import torch.distributed as dist


def print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, file=sys.stdout, flush=True)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


@dataclasses.dataclass
class ProgressLog:
    """Interval statistics for the progress line. ETA uses the mean iteration time of this run so far,
    which already includes evaluations and checkpoint writes at their usual rate."""

    train_iters: int
    start_iteration: int
    tokens_per_iteration: int
    started: float = dataclasses.field(default_factory=time.perf_counter)
    interval_start: Optional[float] = None
    interval_losses: list = dataclasses.field(default_factory=list)
    interval_skipped: int = 0

    def __post_init__(self):
        self.interval_start = self.started

    def record(self, loss: float, skipped: bool = False) -> None:
        """``skipped``: the update was dropped (fp16 overflow); the loss is still counted."""
        self.interval_losses.append(loss)
        self.interval_skipped += int(skipped)

    @property
    def interval_iterations(self) -> int:
        """Iterations recorded since the last line."""
        return len(self.interval_losses)

    def line(self, iteration: int, learning_rate: float, grad_norm: Optional[float],
             loss_scale: Optional[float] = None, extras: Optional[dict] = None,
             activation_bytes: Optional[int] = None) -> dict:
        """Close the interval; returns its statistics and prints the progress line on rank 0. ``extras``: other
        interval means by name (the MoE routers' auxiliary losses), shown after the learning rate;
        ``activation_bytes``: the activations of the interval's measured step at their peak."""
        extras = extras or {}
        now = time.perf_counter()
        iterations = len(self.interval_losses)
        interval_time = max(now - self.interval_start, 1e-9)
        elapsed = now - self.started
        done = iteration - self.start_iteration
        eta = elapsed / max(done, 1) * (self.train_iters - iteration)
        loss = sum(self.interval_losses) / len(self.interval_losses) if self.interval_losses else math.nan
        stats = {
            "iteration": iteration,
            "loss": loss,
            "lr": learning_rate,
            "grad_norm": grad_norm,
            "tokens_per_second": iterations * self.tokens_per_iteration / interval_time,
            "elapsed": elapsed,
            "eta": eta,
            **extras,
        }
        if activation_bytes is not None:
            stats["activations_MiB"] = activation_bytes / 2**20
        width = len(str(self.train_iters))
        parts = [
            f"iteration {iteration:>{width}}/{self.train_iters}",
            f"loss {loss:.4f}",
            f"lr {learning_rate:.3e}",
            *(f"{name} {value:.4f}" for name, value in extras.items()),
        ]
        if grad_norm is not None:
            parts.append(f"grad norm {grad_norm:.3f}")
        if loss_scale is not None:
            parts.append(f"loss scale {loss_scale:.0f}")
        if self.interval_skipped:
            parts.append(f"skipped {self.interval_skipped}")
        if activation_bytes is not None:
            parts.append(f"activations {activation_bytes / 2**20:.1f} MiB")
        parts += [
            f"{stats['tokens_per_second']:,.0f} tokens/s",
            f"elapsed {format_duration(elapsed)}",
            f"ETA {format_duration(eta)}",
        ]
        print_rank_0(" | ".join(parts))
        self.interval_start = now
        self.interval_losses = []
        self.interval_skipped = 0
        return stats
