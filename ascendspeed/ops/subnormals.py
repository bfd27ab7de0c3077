"""Flush-to-zero for CPU code whose data are full of subnormal numbers (ALiBi's softmax).

With ALiBi, distant keys get attention probabilities below fp32's smallest normal number (1.2e-38): at
2048 tokens and the paper's slopes about 3% of the visible probabilities are subnormal, and so are parts
of the softmax gradient. Many x86 cores take a microcode assist of a hundred cycles or more for each
subnormal operand or result of a vector instruction, so the same attention can run at half speed on one
CPU and full speed on another. Flush-to-zero / denormals-are-zero (FTZ/DAZ) turns those values into
zeros: each changes by less than 1.2e-38, far below the resolution of any output they add up to.

The mode is a per-thread CPU register; ``torch.ops.ascendspeed.set_flush_subnormals`` sets it on the
calling thread and on every thread of torch's intra-op pool (``torch.set_flush_denormal`` sets only the
calling thread). It is the C++ operator in ``ascendspeed/csrc/common/flush_subnormals.cpp``; on CPUs
other than x86-64 and AArch64 it does nothing.
"""
from __future__ import annotations

import contextlib

import torch

from ascendspeed.ops._extension import load_extension

__all__ = ["flushing_subnormals", "flush_subnormals_in_backward"]

load_extension()  # defines ascendspeed::set_flush_subnormals


def _set(enabled: bool) -> bool:
    """Set the mode on every CPU thread torch computes on; the calling thread's previous mode."""
    return torch.ops.ascendspeed.set_flush_subnormals(enabled)


@contextlib.contextmanager
def flushing_subnormals(device: torch.device):
    """Subnormal inputs and results are zero in CPU kernels run inside the block (no-op on other devices)."""
    if device.type != "cpu":
        yield
        return
    previous = _set(True)
    try:
        yield
    finally:
        _set(previous)


def flush_subnormals_in_backward(output: torch.Tensor, input: torch.Tensor) -> None:
    """Flush subnormals while autograd goes from ``output``'s gradient to ``input``'s.

    ``output`` must be computed from ``input`` on the CPU. The mode is switched on when the gradient of
    ``output`` arrives and back to what it was when the gradient of ``input`` has been computed; the
    backward of everything in between (for ALiBi: the softmax) runs flushed.
    """
    if output.device.type != "cpu" or not (output.requires_grad and input.requires_grad):
        return
    previous: list[bool] = []

    def switch_on(grad: torch.Tensor) -> None:
        previous.append(_set(True))

    def switch_back(grad: torch.Tensor) -> None:
        if previous:
            _set(previous.pop())

    output.register_hook(switch_on)
    input.register_hook(switch_back)
