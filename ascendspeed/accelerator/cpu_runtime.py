"""``torch.cuda`` runtime entry points given CPU meanings, so Megatron's CUDA calls run on the CPU.

Megatron treats ``torch.cuda`` as "the device": it allocates on ``torch.cuda.current_device()`` (175 call
sites in megatron-core 0.16, more each release), synchronizes, creates streams and events, and keeps
its model-parallel RNG states with ``torch.cuda.get_rng_state``/``manual_seed``. On a CPU-only torch every
one of these raises (or, for the lazily queued RNG calls, silently does nothing). Rather than patching
each call site, these shims give the entry points the meaning they have when the CPU is the device:

* ``current_device()`` returns ``torch.device("cpu")``, which every ``device=``/``.to()`` accepts;
* ``synchronize``/``set_device``/``set_stream`` do nothing, and ``with torch.cuda.device(d)`` selects nothing:
  CPU kernels run synchronously on one device;
* streams and events are inert objects (CPU execution is already ordered); events still time;
* the "CUDA" RNG *is* the CPU generator: CPU dropout and init draw from ``torch.default_generator``,
  so Megatron's RNG tracker must save, seed and restore that generator to fork its streams;
* ``is_available()`` stays ``False`` (also when a GPU exists but the CPU was chosen), so third-party code
  keeps its CPU paths (pinned memory, autocast) instead of trying to reach a GPU;
* ``device_count()`` is 1, the CPU: Megatron divides by it (``rank % torch.cuda.device_count()`` in its test
  harness, async checkpoint workers and Megatron-LM's initialisation) and skips model-parallel set-up and
  RNG seeding when it is 0, leaving Megatron half initialised without an error;
* ``torch.distributed.init_process_group`` / ``new_group`` asked for ``nccl`` (Megatron's default and its
  test harness's) get ``gloo``, and say so once: NCCL needs CUDA devices, gloo runs the same collectives on
  CPU tensors. A ``device_id`` naming a CUDA device is dropped (gloo binds no device). Those groups connect
  on their first collective, as NCCL's communicators do, not when they are made, as gloo's do: code that
  makes groups per rank which no collective ever uses (Megatron's custom-process-group tests) runs with
  NCCL and deadlocked with eager gloo (``TORCH_GLOO_LAZY_INIT``; a value the user set is kept). Their names
  carry their members' ranks besides torch's count of groups, since gloo looks its peers up in the store by
  name and ranks that make groups in different orders gave one name to groups of different ranks;
* ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` take the flat tensor of ``world x`` the shard's
  elements that NCCL takes (``gather_split_1d_tensor`` gathers 2-D shards into a 1-D tensor): gloo splits
  the big tensor along its first dimension and wants each piece shaped as the shard, so it gets a view of
  the same memory shaped that way;
* ``all_gather`` into a list of tensors of different sizes (NCCL gathers uneven shards: megatron-core's
  uneven DTensor gather, MoE's gathers by split sizes) pads every shard to the largest for gloo, which wants
  them equal, and copies each into its tensor (an async call's copies happen in its ``wait()``);
* ``all_reduce`` / ``reduce_scatter_tensor`` with NCCL's ``PREMUL_SUM`` (Megatron-FSDP's fused gradient scaling,
  ``_make_nccl_premul_sum(factor)``), which gloo refuses, scale the input by the factor and sum: in place for
  ``all_reduce``, whose input is its output, and on a scaled copy for ``reduce_scatter_tensor``, whose input NCCL
  leaves as it was;
* ``all_reduce`` in a group whose ranks all run on this host goes through shared memory instead of gloo's sockets
  (``cpu_shared_memory``: 2-5x faster; an asynchronous call completes when issued);
* a ``DeviceMesh`` of device type ``"cuda"`` is a CPU mesh (its groups are gloo's), so torch's FSDP2 keeps
  its shards on the CPU;
* ``torch.distributed.nn.functional.all_to_all`` (autograd's list all-to-all: megatron-core's multimodal CP
  gather) runs on any group with shards of any size, as on NCCL: torch's gloo path scattered from group ranks
  taken as global ones and wanted equal shards.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import time
import weakref

import torch

from ascendspeed.accelerator import cpu_shared_memory
from ascendspeed.patching import EXISTS, replace, wrap

logger = logging.getLogger("ascendspeed")

CPU = torch.device("cpu")


def current_device() -> torch.device:
    """The CPU: every ``device=torch.cuda.current_device()`` allocation lands in host memory."""
    return CPU


def synchronize(device=None) -> None:
    """CPU kernels complete before they return; there is nothing to wait for."""


def set_device(device) -> None:
    """There is one CPU device; ``torch.cuda.set_device(local_rank)`` selects it."""


class CpuDeviceScope:
    """``torch.cuda.device(d)``, the block's device: the CPU, whatever ``d`` names (megatron-core passes
    ``current_device()``, the CPU itself). A class, as torch's own device checks ask ``isinstance`` of it."""

    def __init__(self, device):
        self.idx = -1

    def __enter__(self):
        return self

    def __exit__(self, *exception) -> bool:
        return False


def is_available() -> bool:
    """The CPU was chosen: report no CUDA so third-party code keeps its CPU paths."""
    return False


def device_count() -> int:
    """One device, the CPU (``current_device()``)."""
    return 1


def _gloo_for_nccl(backend):
    """``backend`` with every NCCL request served by gloo (``"nccl"``, ``Backend.NCCL``, ``"cpu:gloo,cuda:nccl"``)."""
    if not _asks_for_nccl(backend):
        return backend
    if not _gloo_for_nccl.said:
        logger.warning("ascendspeed: the CPU serves torch.distributed backend %r with gloo (NCCL needs CUDA devices)",
                       str(backend))
        _gloo_for_nccl.said = True
    return "gloo"


_gloo_for_nccl.said = False


_GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"


def _asks_for_nccl(backend) -> bool:
    return "nccl" in str(backend).lower()


def _serves_nccl(backend) -> bool:
    """Whether a group of ``backend`` is gloo serving NCCL: asked for by name or, for ``backend=None``, as the
    world's backend."""
    return _asks_for_nccl(backend) if backend is not None else _connecting_lazily_as_nccl.world_asked_for_nccl


@contextlib.contextmanager
def _connecting_lazily_as_nccl(backend):
    """Gloo groups made in this block connect on first use where NCCL (which connects lazily) was asked for;
    torch reads ``TORCH_GLOO_LAZY_INIT`` when it makes each gloo group."""
    if not _serves_nccl(backend) or _GLOO_LAZY_INIT in os.environ:
        yield
        return
    os.environ[_GLOO_LAZY_INIT] = "1"
    try:
        yield
    finally:
        os.environ.pop(_GLOO_LAZY_INIT, None)


_connecting_lazily_as_nccl.world_asked_for_nccl = False


def _without_cuda_device(device_id):
    return None if isinstance(device_id, torch.device) and device_id.type == "cuda" else device_id


def wrap_init_process_group(original):
    """``init_process_group`` with gloo where NCCL was asked for."""

    @functools.wraps(original)
    def init_process_group(backend=None, *args, **kwargs):
        if "device_id" in kwargs:
            kwargs["device_id"] = _without_cuda_device(kwargs["device_id"])
        _connecting_lazily_as_nccl.world_asked_for_nccl = _asks_for_nccl(backend)
        with _connecting_lazily_as_nccl(backend):
            return original(_gloo_for_nccl(backend), *args, **kwargs)

    return init_process_group


def wrap_new_group(original):
    """``new_group`` with gloo where NCCL was asked for."""

    @functools.wraps(original)
    def new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
        if "device_id" in kwargs:
            kwargs["device_id"] = _without_cuda_device(kwargs["device_id"])
        with _connecting_lazily_as_nccl(backend), _naming_by_members(_serves_nccl(backend)):
            return original(ranks, timeout, _gloo_for_nccl(backend), *args, **kwargs)

    return new_group


@contextlib.contextmanager
def _naming_by_members(active: bool):
    previous = _naming_by_members.active
    _naming_by_members.active = active
    try:
        yield
    finally:
        _naming_by_members.active = previous


_naming_by_members.active = False


def wrap_process_group_name(original):
    """``_process_group_name`` adding the members' ranks to the name of a gloo group that serves NCCL.

    torch names a group by a per-process count of ``new_group`` calls, and a gloo group finds its members'
    addresses in the store under that name. Ranks that make different groups in different orders (Megatron's
    multi-module pipelines: each module's ranks make its embedding groups) then give one name to two groups of
    different ranks, whose members read each other's addresses, connect to the wrong processes and wait for good.
    NCCL's subgroups are split from the world's communicator and never look their name up. With the ranks in
    the name such groups stay apart, and the members of one group, which made the same calls before it, still
    agree on its name."""

    @functools.wraps(original)
    def _process_group_name(ranks, use_hashed_name):
        name = original(ranks, use_hashed_name)
        if use_hashed_name or not _naming_by_members.active or not ranks:
            return name
        members = hashlib.sha1(",".join(str(rank) for rank in sorted(ranks)).encode()).hexdigest()[:16]
        return f"{name}@{members}"

    return _process_group_name


# By identity: meshes compare equal by layout alone, so a set would take a later state's mesh for an earlier one's.
_device_meshes: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
_meshed_group_names: set = set()


def groups_named_by_device_meshes() -> set:
    """Names of the process groups of the ``DeviceMesh``es made so far. DTensors made under one model-parallel state
    can carry their mesh into the next (seen with Megatron-FSDP models; torch's sharding propagation caches specs
    by a mesh equality that ignores the groups), and a mesh resolves its groups by name: such groups stay alive,
    as NCCL's groups do (``cpu_megatron_core`` destroys the others with their state). torch names a mesh's
    groups after ``__init__`` (``DeviceMesh.from_group``, sub-meshes), so the names are collected from the
    meshes still alive whenever a mesh is made and whenever this is asked."""
    for mesh in list(_device_meshes.values()):
        _meshed_group_names.update(getattr(mesh, "_dim_group_names", None) or ())
    return _meshed_group_names


def wrap_device_mesh_init(original):
    """``DeviceMesh("cuda", ...)`` as a CPU mesh: its groups are gloo's (NCCL's were refused above), and torch's
    FSDP2 places shards on ``torch.device(mesh.device_type, torch.cuda.current_device())`` unless the mesh is
    a CPU mesh (megatron-core builds its FSDP2 mesh with ``DeviceMesh.from_group(group, "cuda")``). The mesh is
    remembered, weakly (``groups_named_by_device_meshes``)."""

    @functools.wraps(original)
    def __init__(self, device_type, *args, **kwargs):
        groups_named_by_device_meshes()
        original(self, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)
        _device_meshes[id(self)] = self

    return __init__


def wrap_device_mesh_setstate(original):
    """A ``DeviceMesh`` copied (``copy.deepcopy`` of a state dict holding DTensors, pickling) is made without
    ``__init__``; the copy names the same groups and can outlive the mesh it came from, so it is remembered
    too (``groups_named_by_device_meshes``)."""

    @functools.wraps(original)
    def __setstate__(self, state):
        original(self, state)
        _device_meshes[id(self)] = self

    return __setstate__


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


def _stacked_like(big: torch.Tensor, shard: torch.Tensor, group) -> torch.Tensor:
    """``big`` (``world`` shards' elements) viewed as the shards stacked along the first dimension, which is
    what gloo requires, when it is another shape of the same elements."""
    if shard.dim() == 0 or big.dim() == shard.dim() and big.shape[1:] == shard.shape[1:]:
        return big
    world = torch.distributed.get_world_size(group)
    if big.numel() != world * shard.numel() or not big.is_contiguous():
        return big  # gloo names the mismatch
    return big.view(world * shard.shape[0], *shard.shape[1:])


def wrap_all_gather_into_tensor(original):
    """``all_gather_into_tensor`` into any shape of the gathered elements, as on NCCL."""

    @functools.wraps(original)
    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        return original(_stacked_like(output_tensor, input_tensor, group), input_tensor, group, async_op)

    return all_gather_into_tensor


def _premul_factor(op):
    """The factor of a ``PREMUL_SUM`` reduction (a float or a one-element tensor), or None for other ops."""
    if getattr(op, "op", None) == torch.distributed.ReduceOp.PREMUL_SUM:
        return op.factor
    return None


def wrap_reduce_scatter_tensor(original):
    """``reduce_scatter_tensor`` from any shape of the scattered elements, and with ``PREMUL_SUM``, as on NCCL."""

    @functools.wraps(original)
    def reduce_scatter_tensor(output, input, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        factor = _premul_factor(op)
        if factor is not None:
            input, op = input * factor, torch.distributed.ReduceOp.SUM
        return original(output, _stacked_like(input, output, group), op, group, async_op)

    return reduce_scatter_tensor


def wrap_all_reduce(original):
    """``all_reduce`` with ``PREMUL_SUM``, as on NCCL: the tensor scaled in place, then summed; synchronous calls
    among ranks of one host in shared memory (``cpu_shared_memory``)."""

    @functools.wraps(original)
    def all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        factor = _premul_factor(op)
        if factor is not None:
            tensor.mul_(factor)
            op = torch.distributed.ReduceOp.SUM
        if cpu_shared_memory.all_reduce(tensor, op, group):
            return cpu_shared_memory.completed_work(tensor) if async_op else None
        return original(tensor, op, group, async_op)

    return all_reduce


class _PlacedOnWait:
    """An async collective whose results reach the caller's tensors when it is waited for."""

    def __init__(self, work, place):
        self._work, self._place, self._placed = work, place, False

    def wait(self, *args, **kwargs):
        done = self._work.wait(*args, **kwargs)
        if not self._placed:
            self._place()
            self._placed = True
        return done

    def is_completed(self) -> bool:
        if not self._placed and self._work.is_completed():
            self.wait()
        return self._placed


def wrap_autograd_all_to_all_forward(original):
    """Autograd's list all-to-all, on gloo, as NCCL runs it. torch's gloo path scatters from each rank of the group
    in turn: it passes the group rank as ``src``, a global rank ("Global rank 0 is not part of group" on a group
    without global rank 0), and gloo's scatter wants every shard of the output's size, where NCCL's
    ``all_to_all`` sends each peer a shard of its own size (the backward always does: it returns each peer the
    gradient of what that peer sent). Here the shards travel flattened in one ``all_to_all_single`` by their
    sizes. NCCL's path is torch's."""

    @functools.wraps(original)
    def forward(ctx, group, out_tensor_list, *tensors):
        distributed = torch.distributed
        if distributed.get_backend(group=group) != distributed.Backend.GLOO:
            return original(ctx, group, out_tensor_list, *tensors)
        ctx.group = group
        ctx.input_tensor_size_list = [tensor.size() for tensor in tensors]
        sent = torch.cat([tensor.reshape(-1) for tensor in tensors])
        received_sizes = [output.numel() for output in out_tensor_list]
        received = sent.new_empty(sum(received_sizes))
        distributed.all_to_all_single(received, sent, received_sizes, [tensor.numel() for tensor in tensors],
                                      group=group)
        for output, shard in zip(out_tensor_list, received.split(received_sizes)):
            output.copy_(shard.view(output.shape))
        return tuple(out_tensor_list)

    return forward


def wrap_all_gather(original):
    """``all_gather`` of shards of different shapes, as on NCCL: gloo gathers them padded to the largest."""

    @functools.wraps(original)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if all(out.shape == tensor.shape for out in tensor_list) or any(out.dtype != tensor.dtype
                                                                         for out in tensor_list):
            return original(tensor_list, tensor, group, async_op)
        largest = max(max(out.numel() for out in tensor_list), tensor.numel())
        padded = tensor.new_zeros(largest)
        padded[:tensor.numel()] = tensor.reshape(-1)
        gathered = [tensor.new_empty(largest) for _ in tensor_list]
        work = original(gathered, padded, group, async_op)

        def place():
            for out, shard in zip(tensor_list, gathered):
                out.copy_(shard[:out.numel()].view(out.shape))

        if async_op:
            return _PlacedOnWait(work, place)
        place()
        return work

    return all_gather


def patches():
    """Every shim here replaces a whole ``torch.cuda`` entry point, so torch's exact signature does not
    matter (``EXISTS``); copies bound elsewhere (``torch.cuda.get_rng_state`` is ``torch.cuda.random``'s)
    are swept by the patch manager."""
    return [
        replace("torch.cuda:current_device", current_device, expect=EXISTS, name="cpu runtime: current_device"),
        replace("torch.cuda:synchronize", synchronize, expect=EXISTS, name="cpu runtime: synchronize"),
        replace("torch.cuda:set_device", set_device, expect=EXISTS, name="cpu runtime: set_device"),
        replace("torch.cuda:device", CpuDeviceScope, expect=EXISTS, name="cpu runtime: device, a scope on the CPU"),
        replace("torch.cuda:is_available", is_available, expect=EXISTS, name="cpu runtime: is_available"),
        replace("torch.cuda:device_count", device_count, expect=EXISTS, name="cpu runtime: device_count, the CPU"),
        wrap("torch.distributed.distributed_c10d:init_process_group", wrap_init_process_group, expect=EXISTS,
             name="cpu runtime: wrap init_process_group, gloo serves nccl"),
        wrap("torch.distributed.distributed_c10d:new_group", wrap_new_group, expect=EXISTS,
             name="cpu runtime: wrap new_group, gloo serves nccl"),
        wrap("torch.distributed.distributed_c10d:_process_group_name", wrap_process_group_name,
             expect="(ranks, use_hashed_name)",
             name="cpu runtime: wrap _process_group_name, gloo groups serving nccl named by their members too"),
        wrap("torch.distributed.device_mesh:DeviceMesh.__init__", wrap_device_mesh_init, expect=EXISTS,
             name="cpu runtime: wrap DeviceMesh.__init__, a CUDA mesh is the CPU's, its groups recorded"),
        wrap("torch.distributed.device_mesh:DeviceMesh.__setstate__", wrap_device_mesh_setstate,
             expect="(self, state)", name="cpu runtime: wrap DeviceMesh.__setstate__, a copied mesh's groups recorded"),
        wrap("torch.distributed.distributed_c10d:all_gather_into_tensor", wrap_all_gather_into_tensor,
             expect="(output_tensor, input_tensor, group=None, async_op=False)",
             name="cpu runtime: wrap all_gather_into_tensor, any shape of the gathered elements"),
        wrap("torch.distributed.nn.functional:_AlltoAll.forward", wrap_autograd_all_to_all_forward,
             expect="(ctx, group, out_tensor_list, *tensors)",
             name="cpu runtime: wrap autograd's all_to_all forward, any group and shard sizes as on NCCL"),
        wrap("torch.distributed.distributed_c10d:all_gather", wrap_all_gather,
             expect="(tensor_list, tensor, group=None, async_op=False)",
             name="cpu runtime: wrap all_gather, shards of different sizes as NCCL gathers them"),
        wrap("torch.distributed.distributed_c10d:reduce_scatter_tensor", wrap_reduce_scatter_tensor,
             expect="(output, input, op=<RedOpType.SUM: 0>, group=None, async_op=False)",
             name="cpu runtime: wrap reduce_scatter_tensor, any shape of the scattered elements, PREMUL_SUM"),
        wrap("torch.distributed.distributed_c10d:all_reduce", wrap_all_reduce,
             expect="(tensor, op=<RedOpType.SUM: 0>, group=None, async_op=False)",
             name="cpu runtime: wrap all_reduce, PREMUL_SUM as a scale and a sum, one host's ranks in shared memory"),
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
