"""``all_reduce`` among CPU ranks of one host through shared memory instead of gloo's sockets.

gloo moves every byte of a CPU collective through a TCP connection and its own threads: about 1 GB/s between
two processes of one host, 3.4 ms for the 3.4 MB gradient buffer of a 0.84M-parameter GPT, exposed after
backward by Megatron's default ``--no-overlap-grad-reduce``, and a fixed cost of tens of microseconds on each
of tensor parallelism's small activation all-reduces. When every rank of a group runs on this host, its
all-reduces of CPU tensors run in a shared memory region instead
(``ascendspeed/csrc/shm_all_reduce/``): each rank copies its data in, reduces one partition of every rank's
data, and copies the reduced partitions out, at memory bandwidth.

What it serves is decided from what every rank of a collective passes alike (the group, the tensor's dtype and
size, the reduction), so every rank takes the same path: calls on CPU tensors of real or integer dtypes, with
``SUM``, ``AVG`` (real dtypes), ``MAX`` or ``MIN``, in groups of two or more ranks. An asynchronous call is
reduced when issued and gets a completed work object (``completed_work``). A group's region is made on its
first such call: the group's rank 0 creates it, gloo tells the others its name and whether every rank is on this
host (host name and boot id), and once all ranks mapped it its name is unlinked, so nothing outlives them. Any rank
that cannot map it (a full ``/dev/shm``) leaves the whole group on gloo. bf16/fp16 sums accumulate in fp32 and
round once, as NCCL does; each partition is reduced by one rank, so every rank gets the same bits.
``ASCENDSPEED_SHM_ALL_REDUCE=0`` keeps every all-reduce on gloo.
"""
from __future__ import annotations

import hashlib
import logging
import mmap
import os
import socket
import threading
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger("ascendspeed")

SLOT_BYTES = 1024 * 1024
"""Bytes of one rank's data per chunk; a group's region holds two chunks of every rank's slot."""

_REDUCTIONS = {dist.ReduceOp.SUM: 0, dist.ReduceOp.AVG: 1, dist.ReduceOp.MAX: 2, dist.ReduceOp.MIN: 3}
_REAL = {torch.float32, torch.float64, torch.bfloat16, torch.float16}
_INTEGER = {torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64}
_RENDEZVOUS_BYTES = 64


@dataclass
class _Region:
    memory: mmap.mmap
    bytes: torch.Tensor
    rank: int
    world: int
    timeout_s: float
    lock: threading.Lock = field(default_factory=threading.Lock)  # a rank's threads take turns with the region


_regions: "weakref.WeakKeyDictionary[object, Optional[_Region]]" = weakref.WeakKeyDictionary()
_announced = False


def enabled() -> bool:
    return os.environ.get("ASCENDSPEED_SHM_ALL_REDUCE", "1") != "0"


def all_reduce(tensor: torch.Tensor, op, group) -> bool:
    """Reduce ``tensor`` in place across ``group`` through shared memory and return True, or return False
    (nothing done) for gloo to serve the call."""
    reduction = _REDUCTIONS.get(op)
    if (reduction is None or not enabled() or tensor.device.type != "cpu" or tensor.numel() == 0
            or not (tensor.dtype in _REAL or (tensor.dtype in _INTEGER and op != dist.ReduceOp.AVG))):
        return False
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    if dist.distributed_c10d._rank_not_in_group(group) or group.size() < 2:
        return False
    if group not in _regions:
        _regions[group] = _map_region(group)
    region = _regions[group]
    if region is None or SLOT_BYTES < tensor.element_size() * region.world:
        return False
    with region.lock, torch.no_grad():
        torch.ops.ascendspeed.shm_all_reduce_(tensor, region.bytes, region.rank, region.world, SLOT_BYTES,
                                              reduction, region.timeout_s)
    return True


def completed_work(tensor: torch.Tensor):
    """The work object of an asynchronous call that already completed (``wait()`` returns at once)."""
    future = torch.futures.Future()
    future.set_result([tensor])
    return torch._C._distributed_c10d._create_work_from_future(future)


def _host_key() -> bytes:
    """Equal for processes of one host (and one boot of it), different across hosts."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = b""
    return hashlib.sha256(socket.gethostname().encode() + b"/" + boot_id).digest()[:16]


def _gather(group, payload: bytes) -> list[bytes]:
    """Every rank's payload, through the group's own backend (the process group's method: this may run inside
    Megatron's coalescing manager, where ``torch.distributed``'s functions queue instead of running)."""
    mine = torch.zeros(_RENDEZVOUS_BYTES, dtype=torch.uint8)
    mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = [[torch.empty_like(mine) for _ in range(group.size())]]
    group.allgather(gathered, [mine]).wait()
    return [bytes(part.tolist()) for part in gathered[0]]


def _map_region(group) -> Optional[_Region]:
    from ascendspeed.ops._extension import load_extension

    ops = load_extension()
    rank, world = group.rank(), group.size()
    size = ops.shm_all_reduce_header_bytes(world) + 2 * world * SLOT_BYTES
    token = os.urandom(16) if rank == 0 else bytes(16)
    created_here = rank == 0 and _create(_region_path(token), size)
    views = _gather(group, _host_key() + token + bytes([created_here]))
    host, created = views[0][:16], views[0][32] == 1
    path = _region_path(views[0][16:32])  # rank 0's token
    if not created or any(view[:16] != host for view in views):
        if created_here:
            os.unlink(path)
        return None
    memory = _open(path, size)
    if memory is not None:
        ops.shm_all_reduce_register_rank(torch.frombuffer(memory, dtype=torch.uint8), rank, world)
    mapped = _gather(group, os.getpid().to_bytes(8, "little") + bytes([memory is not None]))
    if rank == 0:
        os.unlink(path)
    pids = [int.from_bytes(view[:8], "little") for view in mapped]
    if not all(view[8] == 1 for view in mapped) or not all(_visible(pid) for pid in pids):
        if memory is not None:
            memory.close()
        return None
    global _announced
    if not _announced:
        _announced = True
        logger.info("ascendspeed: all_reduce among CPU ranks of one host runs in shared memory "
                    "(ASCENDSPEED_SHM_ALL_REDUCE=0 keeps it on gloo)")
    timeout = dist.constants.default_pg_timeout.total_seconds()
    return _Region(memory, torch.frombuffer(memory, dtype=torch.uint8), rank, world, timeout)


def _region_path(token: bytes) -> str:
    return f"/dev/shm/ascendspeed-all-reduce-{token.hex()}"


def _create(path: str, size: int) -> bool:
    """The region's file with every page reserved: a full ``/dev/shm`` fails here, not with a SIGBUS later."""
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return False
    try:
        os.posix_fallocate(descriptor, 0, size)
        return True
    except OSError:
        os.unlink(path)
        return False
    finally:
        os.close(descriptor)


def _open(path: str, size: int) -> Optional[mmap.mmap]:
    try:
        descriptor = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        return mmap.mmap(descriptor, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        return None
    finally:
        os.close(descriptor)


def _visible(pid: int) -> bool:
    """Whether this process can see ``pid`` (the waiting ranks check their peers are alive by pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
