"""Errors that stop a run: each message names the file or flag at fault and what to do about it.

``pretrain_gpt`` prints a ``TrainingError`` as one line on stderr and exits with status 1 (argument errors
exit with argparse's status 2 before anything starts); other exceptions keep their traceback.
"""
from __future__ import annotations


class TrainingError(RuntimeError):
    """A run cannot go on, and continuing would lose work or give a wrong result."""


class CheckpointError(TrainingError):
    """A checkpoint cannot be read or written; the message names the file and the cause."""


class ResumeError(TrainingError):
    """The flags of a resumed run contradict its checkpoint (schedule, iteration count)."""


class DataError(TrainingError, ValueError):
    """The training text cannot be read or is too short for the requested batches."""


class DivergenceError(TrainingError):
    """The loss or the gradient norm is no longer finite: the weights are lost from this iteration on."""


class Terminated(BaseException):
    """SIGTERM (a scheduler's or torchrun's stop) arrived: unwind, removing the temporary file of a save in
    progress, and exit with 128 + the signal number. A ``BaseException``, so no ``except Exception`` of the
    code it interrupts swallows it."""

    def __init__(self, signum: int, during: str):
        super().__init__(f"stopped by signal {signum} during {during}")
        self.signum = signum
        self.during = during
