"""Tensor-level CUDA spellings given CPU meanings: ``device="cuda"`` literals, ``.cuda()``, ``.to("cuda")``,
type names, CUDA device objects.

Megatron spells "the device" five ways besides ``torch.cuda.current_device()``:

* ``torch.zeros(..., device="cuda")`` and friends (optimizer, grad scaler, clip_grads, schedules,
  ``local_multi_tensor_l2_norm``, Megatron-LM's jit warm-up). Only the tensor *factories* are wrapped,
  and only their ``device`` keyword is rewritten: every other torch call keeps its C fast path
  (a global ``TorchFunctionMode`` would tax every op, and confuse ``torch.compile``); TorchScript still
  compiles calls to a wrapped factory as its ATen op;
* ``tensor.cuda()`` (batches, state dicts): a copy on the CPU, as ``.cuda()`` of a host tensor is a copy on
  the device. Code may change the result and expect its source untouched (Megatron's LLaVA test expands a
  row with ``expand(...).cuda()`` and writes into each row); the same tensor back would write through to
  the source, and to every row of the expansion. ``Module.cuda()`` returns the module as it is: its
  parameters are already on the device (no copy of a whole model);
* ``param.type() == 'torch.cuda.FloatTensor'`` (optimizer, distributed optimizer, clip_grads) selects fp32
  vs fp16 handling. A CPU tensor's ``type()`` keeps its true name (``'torch.FloatTensor'``) but returns it
  as a ``str`` that also compares equal to the ``torch.cuda.`` spelling, so those checks take the branch
  they take on a GPU, while printing and hashing stay those of the plain name;
* ``tensor.to("cuda")`` / ``.to(torch.device("cuda", i))`` (Megatron-FSDP's test data, ``Module.to`` of a
  CUDA device, which moves each tensor with ``Tensor.to``): the tensor on the CPU, as for ``.cuda()``;
* ``torch.device(f"cuda:{torch.cuda.current_device()}")`` (Megatron-FSDP's ``MegatronFSDP`` and megatron-core's
  ``FullyShardedDataParallel`` name their device so, and compare it with the one they were given): with the
  current device the CPU, the string is ``"cuda:cpu"``, which torch refuses. ``torch.device`` itself cannot
  change (a C type: pickling, TorchScript and ``torch.library`` look it up by identity), so only those modules
  see a ``torch`` whose ``device`` makes CUDA spellings the CPU (``TorchWithCpuDevices``); every other name
  in them is torch's own.

Only the CUDA spellings change: ``device="cpu"``, ``"meta"`` and every other device are left untouched.
"""
from __future__ import annotations

import functools
import types

import torch

from ascendspeed.patching import EXISTS, replace, wrap

CPU = torch.device("cpu")

def is_cuda_spelling(device) -> bool:
    """True for ``"cuda"``, ``"cuda:1"``, ``torch.device("cuda", 0)`` and bare indices (torch reads an int
    device as an index of the accelerator, which is CUDA's in Megatron's code)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return isinstance(device, int) and not isinstance(device, bool)


_REDIRECTED = {}


def _redirect_device_keyword(factory):
    """The factory with a CUDA ``device=`` rewritten to the CPU; one wrapper per factory, kept for good,
    so TorchScript can keep compiling calls to it as the ATen op it stands for."""
    if factory in _REDIRECTED:
        return _REDIRECTED[factory]

    @functools.wraps(factory)
    def on_cpu(*args, **kwargs):
        if "device" in kwargs and is_cuda_spelling(kwargs["device"]):
            kwargs["device"] = CPU
        return factory(*args, **kwargs)

    register_builtin = getattr(torch.jit._builtins, "_register_builtin", None)
    if register_builtin is not None:
        register_builtin(on_cpu, "aten::" + factory.__name__)
    _REDIRECTED[factory] = on_cpu
    return on_cpu


def _wrap_tensor_to(original):
    """``Tensor.to`` with a CUDA device, positional or keyword, moving to the CPU; everything else untouched."""

    @functools.wraps(original)
    def to(self, *args, **kwargs):
        if args and is_cuda_spelling(args[0]):
            args = (CPU,) + args[1:]
        elif "device" in kwargs and is_cuda_spelling(kwargs["device"]):
            kwargs["device"] = CPU
        return original(self, *args, **kwargs)

    return to


class _DeviceNamingCpuForCuda(type):
    """The metaclass of ``TorchWithCpuDevices.device``: calls make CUDA spellings the CPU, and ``isinstance``
    answers for ``torch.device``."""

    def __call__(cls, *args, **kwargs):
        spelling = args[0] if args else kwargs.get("type")
        if isinstance(spelling, str) and spelling.split(":")[0] == "cuda":
            return CPU
        return torch.device(*args, **kwargs)

    def __instancecheck__(cls, instance) -> bool:
        return isinstance(instance, torch.device)


class _CpuForCudaDevice(metaclass=_DeviceNamingCpuForCuda):
    """``torch.device`` where ``"cuda"``, ``"cuda:<anything>"`` and ``("cuda", index)`` name the CPU."""


class TorchWithCpuDevices(types.ModuleType):
    """``torch`` for a module that names CUDA devices from ``torch.cuda.current_device()``: ``device`` is
    ``_CpuForCudaDevice``, every other attribute torch's."""

    device = _CpuForCudaDevice

    def __init__(self):
        super().__init__("torch", torch.__doc__)

    def __getattr__(self, name):
        return getattr(torch, name)


TORCH_WITH_CPU_DEVICES = TorchWithCpuDevices()


def tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    """``Tensor.cuda()``: a copy on the CPU, as a host tensor's ``.cuda()`` is a copy on the device."""
    return self.to(CPU, non_blocking=non_blocking, copy=True, memory_format=memory_format)


def module_cuda(self, device=None):
    """``Module.cuda()``: the module, its parameters and buffers already on the device (the CPU)."""
    return self


class AcceleratorTypeName(str):
    """A tensor type name (``'torch.FloatTensor'``) that also equals its ``'torch.cuda.'`` spelling."""

    __slots__ = ()

    def __eq__(self, other):
        if isinstance(other, str) and other.startswith("torch.cuda."):
            other = "torch." + other[len("torch.cuda."):]
        return str.__eq__(self, other)

    def __ne__(self, other):
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    __hash__ = str.__hash__


def _wrap_tensor_type(original):
    @functools.wraps(original)
    def type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return AcceleratorTypeName(name) if self.device.type == "cpu" else name
        return original(self, dtype, non_blocking, **kwargs)

    return type


def patches():
    """Torch targets use ``EXISTS``: the wrappers forward every argument, whatever torch's signature."""
    redirect = _redirect_device_keyword
    return [
        wrap("torch:tensor", redirect, expect=EXISTS, name="cpu device literal: torch.tensor(device='cuda')"),
        wrap("torch:as_tensor", redirect, expect=EXISTS, name="cpu device literal: torch.as_tensor(device='cuda')"),
        wrap("torch:empty", redirect, expect=EXISTS, name="cpu device literal: torch.empty(device='cuda')"),
        wrap("torch:zeros", redirect, expect=EXISTS, name="cpu device literal: torch.zeros(device='cuda')"),
        wrap("torch:ones", redirect, expect=EXISTS, name="cpu device literal: torch.ones(device='cuda')"),
        wrap("torch:full", redirect, expect=EXISTS, name="cpu device literal: torch.full(device='cuda')"),
        wrap("torch:arange", redirect, expect=EXISTS, name="cpu device literal: torch.arange(device='cuda')"),
        wrap("torch:rand", redirect, expect=EXISTS, name="cpu device literal: torch.rand(device='cuda')"),
        wrap("torch:randn", redirect, expect=EXISTS, name="cpu device literal: torch.randn(device='cuda')"),
        wrap("torch:randint", redirect, expect=EXISTS, name="cpu device literal: torch.randint(device='cuda')"),
        wrap("torch:empty_like", redirect, expect=EXISTS, name="cpu device literal: torch.empty_like(device='cuda')"),
        wrap("torch:zeros_like", redirect, expect=EXISTS, name="cpu device literal: torch.zeros_like(device='cuda')"),
        wrap("torch:ones_like", redirect, expect=EXISTS, name="cpu device literal: torch.ones_like(device='cuda')"),
        wrap("torch:full_like", redirect, expect=EXISTS, name="cpu device literal: torch.full_like(device='cuda')"),
        wrap("torch:rand_like", redirect, expect=EXISTS, name="cpu device literal: torch.rand_like(device='cuda')"),
        wrap("torch:randn_like", redirect, expect=EXISTS, name="cpu device literal: torch.randn_like(device='cuda')"),
        replace("torch:Tensor.cuda", tensor_cuda, expect=EXISTS, name="cpu device literal: Tensor.cuda()"),
        replace("torch.nn:Module.cuda", module_cuda, expect="(self, device=None)",
                name="cpu device literal: Module.cuda() keeps the module"),
        wrap("torch:Tensor.type", _wrap_tensor_type, expect=EXISTS, name="cpu type names: Tensor.type()"),
        wrap("torch:Tensor.to", _wrap_tensor_to, expect=EXISTS, name="cpu device literal: Tensor.to('cuda')"),
        # Only these modules' ``torch`` changes (``sweep=False``): every other module keeps torch itself.
        replace("megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp:torch", TORCH_WITH_CPU_DEVICES,
                expect=EXISTS, sweep=False,
                name="cpu device objects: megatron_fsdp's torch.device('cuda:...') is the CPU"),
        replace("megatron.core.distributed.fsdp.mcore_fsdp_adapter:torch", TORCH_WITH_CPU_DEVICES, expect=EXISTS,
                sweep=False, name="cpu device objects: mcore_fsdp_adapter's torch.device('cuda:...') is the CPU"),
    ]
