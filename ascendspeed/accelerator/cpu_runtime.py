"""``torch.cuda`` runtime entry points given CPU meanings, so Megatron's CUDA calls run on the CPU.

Megatron treats ``torch.cuda`` as "the device": it allocates on ``torch.cuda.current_device()`` (175 call
sites in megatron-core 0.16, more each release), synchronizes, creates streams and events, and keeps
its model-parallel RNG states with ``torch.cuda.get_rng_state``/``manual_seed``. On a CPU-only torch every
one of these raises (or, for the lazily queued RNG calls, silently does nothing). Rather than patching
each call site, these shims give the entry points the meaning they have when the CPU is the device:

* ``current_device()`` returns ``torch.device("cpu")``, which every ``device=``/``.to()`` accepts;
* ``synchronize``/``set_device``/``set_stream`` do nothing: CPU kernels run synchronously on one device;
* streams and events are inert objects (CPU execution is already ordered); events still time;
* the "CUDA" RNG *is* the CPU generator: CPU dropout and init draw from ``torch.default_generator``,
  so Megatron's RNG tracker must save, seed and restore that generator to fork its streams;
* ``is_available()`` stays ``False`` (also when a GPU exists but the CPU was chosen), so third-party code
  keeps its CPU paths (pinned memory, autocast) instead of trying to reach a GPU.

``torch.cuda.device_count()`` is left alone (0 on a CPU-only build): see ``cpu_megatron_lm`` for the one
place that needs it to count the CPU.
"""
from __future__ import annotations

import time

import torch

from ascendspeed.patching import EXISTS, replace

CPU = torch.device("cpu")


def current_device() -> torch.device:
    """The CPU: every ``device=torch.cuda.current_device()`` allocation lands in host memory."""
    return CPU


def synchronize(device=None) -> None:
    """CPU kernels complete before they return; there is nothing to wait for."""


def set_device(device) -> None:
    """There is one CPU device; ``torch.cuda.set_device(local_rank)`` selects it."""


def is_available() -> bool:
    """The CPU was chosen: report no CUDA so third-party code keeps its CPU paths."""
    return False


class CpuStream(torch.cpu.Stream):
    """An inert stream accepting ``torch.cuda.Stream``'s arguments: CPU work is already in program order."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        super().__init__()
        self.device = CPU
        self.priority = priority

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        event = event if event is not None else CpuEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False


class CpuEvent:
    """An event accepting ``torch.cuda.Event``'s arguments; complete when recorded, and it still times."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 external: bool = False):
        self.enable_timing = enable_timing
        self._recorded_at = None

    def record(self, stream=None) -> None:
        self._recorded_at = time.perf_counter()

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: "CpuEvent") -> float:
        """Milliseconds between the two ``record`` calls, as ``torch.cuda.Event.elapsed_time``."""
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("both events must be recorded before elapsed_time()")
        return (end_event._recorded_at - self._recorded_at) * 1000.0


_DEFAULT_STREAM = CpuStream()


def current_stream(device=None) -> CpuStream:
    return _DEFAULT_STREAM


def default_stream(device=None) -> CpuStream:
    return _DEFAULT_STREAM


def stream(stream=None) -> CpuStream:
    """``with torch.cuda.stream(s):`` runs its body in program order, as everything on the CPU."""
    return stream if isinstance(stream, CpuStream) else _DEFAULT_STREAM


def set_stream(stream) -> None:
    pass


def get_rng_state(device="cuda") -> torch.Tensor:
    """The device RNG is the CPU generator (dropout and init on CPU tensors draw from it)."""
    return torch.default_generator.get_state()


def set_rng_state(new_state: torch.Tensor, device="cuda") -> None:
    torch.default_generator.set_state(new_state)


def manual_seed(seed: int) -> None:
    """Seeds the CPU generator only, as ``torch.cuda.manual_seed`` seeds only the device generator."""
    torch.default_generator.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def patches():
    """Every shim here replaces a whole ``torch.cuda`` entry point, so torch's exact signature does not
    matter (``EXISTS``); copies bound elsewhere (``torch.cuda.get_rng_state`` is ``torch.cuda.random``'s)
    are swept by the patch manager."""
    return [
        replace("torch.cuda:current_device", current_device, expect=EXISTS, name="cpu runtime: current_device"),
        replace("torch.cuda:synchronize", synchronize, expect=EXISTS, name="cpu runtime: synchronize"),
        replace("torch.cuda:set_device", set_device, expect=EXISTS, name="cpu runtime: set_device"),
        replace("torch.cuda:is_available", is_available, expect=EXISTS, name="cpu runtime: is_available"),
        replace("torch.cuda:current_stream", current_stream, expect=EXISTS, name="cpu runtime: current_stream"),
        replace("torch.cuda:default_stream", default_stream, expect=EXISTS, name="cpu runtime: default_stream"),
        replace("torch.cuda:stream", stream, expect=EXISTS, name="cpu runtime: stream"),
        replace("torch.cuda:set_stream", set_stream, expect=EXISTS, name="cpu runtime: set_stream"),
        replace("torch.cuda:Stream", CpuStream, expect=EXISTS, name="cpu runtime: Stream"),
        replace("torch.cuda:Event", CpuEvent, expect=EXISTS, name="cpu runtime: Event"),
        replace("torch.cuda.random:get_rng_state", get_rng_state, expect=EXISTS, name="cpu runtime: get_rng_state"),
        replace("torch.cuda.random:set_rng_state", set_rng_state, expect=EXISTS, name="cpu runtime: set_rng_state"),
        replace("torch.cuda.random:manual_seed", manual_seed, expect=EXISTS, name="cpu runtime: manual_seed"),
        replace("torch.cuda.random:manual_seed_all", manual_seed_all, expect=EXISTS, name="cpu runtime: manual_seed_all"),
    ]
