"""What each CPU shim does, checked one by one in this process (the distributed tests check them together)."""
import argparse
import importlib.util
import logging
import os

import pytest
import torch

import ascendspeed.megatron_adaptor  # noqa: F401 - installs the CPU shims under test
from ascendspeed.accelerator import cpu_megatron_lm, triton_guard


def test_current_device_is_accepted_wherever_megatron_passes_it():
    device = torch.cuda.current_device()
    assert device == torch.device("cpu")
    assert torch.empty(2, device=device).device == device
    assert torch.ones(2).to(device).device == device


@pytest.mark.parametrize("spelling", ["cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 1), 0])
@pytest.mark.parametrize("factory", ["zeros", "ones", "empty", "rand", "randn", "arange"])
def test_cuda_spellings_in_factories_land_on_the_cpu(spelling, factory):
    assert getattr(torch, factory)(3, device=spelling).device.type == "cpu"


def test_tensor_and_like_factories_are_redirected_too():
    assert torch.tensor([1.0], device="cuda").device.type == "cpu"
    assert torch.full((2,), 1.0, device="cuda").device.type == "cpu"
    assert torch.zeros_like(torch.ones(2), device="cuda").device.type == "cpu"


def test_other_devices_are_left_alone():
    assert torch.zeros(2, device="meta").device.type == "meta"
    assert torch.zeros(2).device.type == "cpu"


@pytest.mark.parametrize("spelling", ["cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 1), 0])
def test_to_a_cuda_spelling_moves_to_the_cpu(spelling):
    """``Tensor.to`` as Megatron-FSDP's test data and ``Module.to`` (one ``Tensor.to`` per tensor) reach it."""
    tensor = torch.arange(3, dtype=torch.float32)
    assert tensor.to(spelling) is tensor  # already on the device, as a device tensor's .to(its device) is
    moved = tensor.to(spelling, torch.float64, non_blocking=True)
    assert moved.device.type == "cpu" and moved.dtype == torch.float64 and torch.equal(moved, tensor.double())
    assert tensor.to(device=spelling, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert tensor.to(spelling, copy=True) is not tensor
    if not isinstance(spelling, int):  # a CPU-only torch cannot parse an index for Module.to
        assert torch.nn.Linear(2, 2).to(spelling).weight.device.type == "cpu"


def test_to_other_devices_and_dtypes_is_torchs():
    tensor = torch.ones(2)
    assert tensor.to(torch.float16).dtype == torch.float16
    assert tensor.to("meta").device.type == "meta"
    assert tensor.to(torch.empty(1, dtype=torch.int32)).dtype == torch.int32
    assert tensor.to(device="cpu", dtype=torch.float64).dtype == torch.float64


def test_modules_naming_cuda_devices_get_the_cpu_from_torch_device():
    """``torch.device(f"cuda:{torch.cuda.current_device()}")`` is ``"cuda:cpu"`` here, which torch refuses; the
    modules that spell their device so see a ``torch`` whose ``device`` makes CUDA spellings the CPU."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp

    with pytest.raises(RuntimeError, match="cuda:cpu"):
        torch.device(f"cuda:{torch.cuda.current_device()}")
    for module in (megatron_fsdp, mcore_fsdp_adapter):
        seen = module.torch
        assert seen is not torch and seen.device is not torch.device and seen.Tensor is torch.Tensor
        cpu = torch.device("cpu")
        assert seen.device(f"cuda:{torch.cuda.current_device()}") == cpu
        assert seen.device("cuda", 3) == cpu and seen.device(type="cuda") == cpu
        assert seen.device("meta") == torch.device("meta") and seen.device("cpu", 0) == torch.device("cpu", 0)
        assert isinstance(cpu, seen.device) and not isinstance("cpu", seen.device)
        assert type(seen.device("cuda")) is torch.device


def test_dot_cuda_copies_as_it_copies_a_host_tensor_to_the_device():
    tensor = torch.ones(3)
    copy = tensor.cuda(0, non_blocking=True)
    assert copy is not tensor and torch.equal(copy, tensor) and copy.device.type == "cpu"
    copy += 1
    assert torch.equal(tensor, torch.ones(3))
    # Megatron's LLaVA test: rows of an expansion, each written after .cuda()
    rows = torch.arange(4).expand(3, 4).cuda()
    rows[0, 0] = 9
    assert rows[:, 0].tolist() == [9, 0, 0]


def test_module_cuda_keeps_the_module_and_its_parameters():
    module = torch.nn.Linear(2, 2)
    weight = module.weight
    assert module.cuda() is module and module.weight is weight and module.weight.data_ptr() == weight.data_ptr()


@pytest.mark.parametrize(
    "dtype, cuda_name",
    [(torch.float32, "torch.cuda.FloatTensor"), (torch.float16, "torch.cuda.HalfTensor"),
     (torch.bfloat16, "torch.cuda.BFloat16Tensor")],
)
def test_type_names_compare_equal_to_their_cuda_spelling(dtype, cuda_name):
    name = torch.zeros(1, dtype=dtype).type()
    plain = cuda_name.replace("torch.cuda.", "torch.")
    assert name == cuda_name and name == plain and not name != cuda_name
    assert name in [cuda_name] and name in ["torch.cuda.Nothing", cuda_name]
    assert str(name) == plain and hash(name) == hash(plain) and {plain: 1}[name] == 1
    assert name != "torch.cuda.DoubleTensor"


def test_type_conversion_still_converts():
    assert torch.zeros(1).type(torch.float64).dtype == torch.float64
    assert torch.zeros(1).type("torch.DoubleTensor").dtype == torch.float64


@pytest.mark.parametrize("device", [torch.device("cpu"), "cuda", 0, None])
def test_a_device_scope_runs_its_block_on_the_cpu(device):
    """megatron-core's FSDP makes its streams inside ``with torch.cuda.device(torch.cuda.current_device())``."""
    with torch.cuda.device(device):
        assert torch.zeros(1, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.cuda.Stream().device.type == "cpu"
    assert torch.cuda._utils._get_device_index(torch.cuda.device(0)) == -1


def test_runtime_calls_do_nothing_and_report_no_cuda():
    torch.cuda.synchronize()
    torch.cuda.set_device(0)
    assert torch.cuda.is_available() is False
    assert torch.cuda.device_count() == 1  # the CPU: Megatron's harness computes rank % device_count()


def test_a_request_for_nccl_is_served_by_gloo_and_a_cuda_mesh_is_the_cpus(tmp_path, caplog):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with caplog.at_level(logging.WARNING, logger="ascendspeed"):
        dist.init_process_group(backend="nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
    try:
        assert dist.get_backend() == "gloo"
        assert dist.get_backend(dist.new_group([0], backend="nccl")) == "gloo"
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")  # megatron-core's FSDP2 mesh
        assert mesh.device_type == "cpu" and init_device_mesh("cuda", (1,)).device_type == "cpu"
        sharded = fully_shard(torch.nn.Linear(4, 2), mesh=mesh)
        assert sharded.weight.device == torch.device("cpu")
    finally:
        dist.destroy_process_group()
    if caplog.records:  # said once per process: an earlier test may have said it
        assert "gloo" in caplog.text and "'nccl'" in caplog.text


def test_groups_named_for_nccl_options_get_none():
    """Megatron-LM 0.15 names ``dp_cp`` for high-priority NCCL streams with --use-torch-fsdp2; a CPU-only torch
    has no ProcessGroupNCCL to build the options from, and gloo groups take none."""
    from megatron.core import parallel_state

    assert parallel_state.get_nccl_options("dp_cp", {"dp_cp": {"is_high_priority_stream": True}}) is None


def _world_asked_for_nccl(rank, world_size, store):
    """Megatron's start: the world asked for NCCL (served by gloo, connecting lazily as NCCL does)."""
    import datetime

    import torch.distributed as dist

    dist.destroy_process_group()
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world_size)
    pair = dist.new_group([0, 1])  # the world's backend, made by every rank and used
    summed = torch.full((2,), float(rank + 1))
    dist.all_reduce(summed, group=pair)
    if rank == 0:  # made by one rank and never used: NCCL never connects it, eager gloo waited for rank 1
        dist.new_group([0, 1], timeout=datetime.timedelta(seconds=10), backend="nccl")
    dist.barrier()
    return summed, os.environ.get("TORCH_GLOO_LAZY_INIT")


def _collectives_into_other_shapes(rank, world_size):
    import torch.distributed as dist

    from megatron.core.tensor_parallel.utils import gather_split_1d_tensor

    shard = torch.arange(8, dtype=torch.float32).view(2, 4) + 100 * rank
    gathered = torch.empty(world_size * 8)
    dist.all_gather_into_tensor(gathered, shard)  # NCCL's flat form
    full = torch.arange(world_size * 8, dtype=torch.float32).view(world_size * 4, 2)
    scattered = torch.empty(2, 4)
    dist.reduce_scatter_tensor(scattered, full)
    uneven = [torch.full((2 + 3 * peer, 2), -1.0) for peer in range(world_size)]  # rank r holds 2 + 3r rows
    dist.all_gather(uneven, torch.arange(4.0 + 6 * rank).view(-1, 2) + 100 * rank)
    empty_shard = [torch.full((3 * peer,), -1.0, dtype=torch.bfloat16) for peer in range(world_size)]
    dist.all_gather(empty_shard, torch.arange(3.0 * rank, dtype=torch.bfloat16), async_op=True).wait()
    return gathered, scattered, gather_split_1d_tensor(shard, dist.group.WORLD), uneven, empty_shard


def _premul_sums(rank, world_size):
    """NCCL's PREMUL_SUM (Megatron-FSDP's fused gradient scaling), a float and a tensor factor, fp32 and bf16, on
    fresh random inputs; returns the inputs, what was reduced, and the inputs after."""
    import torch.distributed as dist

    generator = torch.Generator().manual_seed(rank)
    results = []
    for dtype, factor in ((torch.float32, 0.125), (torch.bfloat16, torch.tensor([0.375], dtype=torch.bfloat16))):
        scatter_input = torch.randn(world_size * 6, generator=generator).to(dtype)
        kept = scatter_input.clone()
        scattered = torch.empty(6, dtype=dtype)
        dist.reduce_scatter_tensor(scattered, scatter_input, op=dist._make_nccl_premul_sum(factor))
        reduced = torch.randn(5, generator=generator).to(dtype)
        summands = reduced.clone()
        dist.all_reduce(reduced, op=dist._make_nccl_premul_sum(factor), async_op=True).wait()
        results.append((kept, scatter_input, scattered, summands, reduced, float(factor)))
    return results


SHARED_MEMORY_CASES = [  # (dtype, shape, op): one element, an odd size, 2.5 chunks of a rank's slot
    (dtype, shape, op)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
    for shape in ((1,), (3, 7), (5 * 1024 * 1024 // 16 // 2, 8))
    for op in ("SUM", "AVG", "MAX", "MIN")
    if not (op == "AVG" and not dtype.is_floating_point)
]


def _case_inputs(dtype, shape, seed, world_size):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=generator, dtype=torch.float64) * 100).to(dtype) for _ in range(world_size)]


def _shared_memory_all_reduces(rank, world_size):
    """All-reduces through shared memory (every dtype, size and op, non-contiguous, inside Megatron's coalescing
    manager, a tensor that requires grad, asynchronous), each against gloo's result for the same inputs."""
    import torch.distributed as dist

    from ascendspeed.accelerator import cpu_shared_memory

    def reduced(tensor, op, shared_memory):
        os.environ["ASCENDSPEED_SHM_ALL_REDUCE"] = "1" if shared_memory else "0"
        try:
            dist.all_reduce(tensor, op=op)
        finally:
            os.environ.pop("ASCENDSPEED_SHM_ALL_REDUCE")
        return tensor

    results = []
    for index, (dtype, shape, op) in enumerate(SHARED_MEMORY_CASES):
        mine = _case_inputs(dtype, shape, index, world_size)[rank]
        results.append((reduced(mine.clone(), getattr(dist.ReduceOp, op), True),
                        reduced(mine.clone(), getattr(dist.ReduceOp, op), False)))
    strided = torch.arange(64.0).view(8, 8)[:, ::2] * (rank + 1)
    dist.all_reduce(strided)
    coalesced = [torch.full((3,), float(rank)), torch.full((5,), 2.0 * rank)]
    with dist._coalescing_manager(dist.group.WORLD):
        for tensor in coalesced:
            dist.all_reduce(tensor)
    leaf = torch.full((4,), float(rank + 1), requires_grad=True)
    dist.all_reduce(leaf.data)
    overlapped = torch.full((6,), float(rank + 2))
    work = dist.all_reduce(overlapped, async_op=True)  # Megatron's --overlap-grad-reduce buckets
    completed_at_once = work.is_completed()
    work.wait()
    region = cpu_shared_memory._regions.get(dist.distributed_c10d._get_default_group())
    return (results, strided, coalesced, leaf.detach(), region is not None,
            (overlapped, work.get_future().value()[0], completed_at_once))


def _autograd_all_to_all(rank, world_size):
    """Autograd's list all-to-all with shards of the sender's size (megatron-core's multimodal CP gather), on the
    world and on a one-rank group of each rank (rank 1's does not hold global rank 0), forward and backward."""
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_to_all

    inputs = [torch.full((rank + 1, 2), 10.0 * rank + peer, requires_grad=True) for peer in range(world_size)]
    outputs = all_to_all([torch.empty(peer + 1, 2) for peer in range(world_size)], inputs)
    sum((output * (peer + 1)).sum() for peer, output in enumerate(outputs)).backward()
    singletons = [dist.new_group([member]) for member in range(world_size)]
    alone = torch.arange(6.0).view(3, 2) + rank
    (alone_out,) = all_to_all([torch.empty(3, 2)], [alone], group=singletons[rank])
    return [output.detach() for output in outputs], [tensor.grad for tensor in inputs], alone_out


@pytest.fixture(scope="module")
def nccl_world_job(tmp_path_factory):
    """One 2-rank job: the world asked for NCCL, then NCCL's collective shapes on it."""
    from tests.helpers.distributed import call, run_distributed_cases

    store = tmp_path_factory.mktemp("nccl_world") / "store"
    return run_distributed_cases(call, 2, [(_world_asked_for_nccl, str(store)), (_collectives_into_other_shapes,),
                                           (_premul_sums,), (_shared_memory_all_reduces,),
                                           (_autograd_all_to_all,)], timeout=180)


def test_groups_asked_for_nccl_connect_on_first_use_as_nccl_does(nccl_world_job):
    """Megatron's custom-process-group tests make groups per rank that nothing uses; NCCL connects a group on its
    first collective, so they run on GPUs, and deadlocked over gloo, which connected every group when made."""
    for rank, (summed, lazy_init_left_set) in enumerate(nccl_world_job[0]):
        assert torch.equal(summed, torch.full((2,), 3.0))
        assert lazy_init_left_set is None  # the setting is scoped to the groups NCCL was asked for


def test_collectives_take_the_tensors_nccl_takes(nccl_world_job):
    """The flat tensors of all_gather_into_tensor / reduce_scatter_tensor, and all_gather's shards of different
    sizes (an empty one too, and async), which gloo refused."""
    for rank, (gathered, scattered, megatron_gathered, uneven, empty_shard) in enumerate(nccl_world_job[1]):
        expected = torch.cat([torch.arange(8.0), torch.arange(8.0) + 100])
        torch.testing.assert_close(gathered, expected, rtol=0, atol=0)
        torch.testing.assert_close(megatron_gathered, expected, rtol=0, atol=0)
        torch.testing.assert_close(scattered, 2 * torch.arange(8.0 * rank, 8.0 * rank + 8).view(2, 4), rtol=0, atol=0)
        for peer, (rows, values) in enumerate(zip(uneven, empty_shard)):
            assert torch.equal(rows, torch.arange(4.0 + 6 * peer).view(-1, 2) + 100 * peer)
            assert torch.equal(values, torch.arange(3.0 * peer, dtype=torch.bfloat16))


def test_autograd_all_to_all_runs_on_any_group_as_on_nccl(nccl_world_job):
    """torch's gloo path of ``torch.distributed.nn.functional.all_to_all`` scattered from group ranks taken as
    global ranks, failing on a group without global rank 0 (Megatron's multimodal CP tests, CP groups past the
    first), and gloo's scatter refused shards of different sizes (every backward here sends them). Rank r
    receives peer p's shard of p + 1 rows holding 10 p + r; the gradient of each shard rank r sent is the weight
    its receiver gave it (r + 1)."""
    for rank, (outputs, grads, alone) in enumerate(nccl_world_job[4]):
        for peer, (output, grad) in enumerate(zip(outputs, grads)):
            assert torch.equal(output, torch.full((peer + 1, 2), 10.0 * peer + rank)), f"rank {rank}, from {peer}"
            assert torch.equal(grad, torch.full((rank + 1, 2), float(rank + 1))), f"rank {rank}, to {peer}"
        assert torch.equal(alone, torch.arange(6.0).view(3, 2) + rank), f"rank {rank}"


def test_premul_sum_scales_and_sums_as_nccl_does(nccl_world_job):
    """Each rank's inputs times the factor, summed (a float64 reference; each product rounded to the dtype, as
    NCCL's premul rounds it); reduce_scatter_tensor leaves its input as it was."""
    per_rank = nccl_world_job[2]
    for case in range(2):
        inputs = [per_rank[rank][case] for rank in range(2)]
        for rank, (kept, scatter_input, scattered, _, reduced, factor) in enumerate(inputs):
            dtype = scattered.dtype
            scaled = [(other[0].double() * factor).to(dtype).double() for other in inputs]
            expected = (scaled[0] + scaled[1])[6 * rank:6 * rank + 6].to(dtype)
            torch.testing.assert_close(scattered, expected, rtol=0, atol=0)
            assert torch.equal(scatter_input, kept)
            summed = sum((other[3].double() * factor).to(dtype).double() for other in inputs).to(dtype)
            torch.testing.assert_close(reduced, summed, rtol=0, atol=0)


def _pairs_made_by_their_members_only(rank, world_size, store):
    """Megatron's multi-module pipelines: each module's ranks make their own groups (its embedding groups), so
    ranks 0-1 and ranks 2-3 each make one group here, and torch's per-process count gives both the same name."""
    import torch.distributed as dist

    dist.destroy_process_group()
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world_size)
    pair = dist.new_group([0, 1] if rank < 2 else [2, 3], backend="nccl")
    summed = torch.full((3,), float(rank + 1))
    dist.all_reduce(summed, group=pair)
    return summed


def test_groups_of_other_ranks_that_torch_names_alike_stay_apart(tmp_path):
    """Both pairs were named alike, and a gloo group finds its members' addresses in the store by its name: the
    members of one pair connected to the other pair's processes and waited for good (Megatron's
    test_multimodule_schedules at 8 ranks). Their names now carry their members' ranks."""
    from tests.helpers.distributed import run_distributed

    results = run_distributed(_pairs_made_by_their_members_only, 4, str(tmp_path / "store"), timeout=60)
    for rank, summed in enumerate(results):
        assert torch.equal(summed, torch.full((3,), 3.0 if rank < 2 else 7.0)), (rank, summed)


def test_streams_and_events_are_inert_but_time():
    stream = torch.cuda.Stream(device="cuda", priority=-1)
    with torch.cuda.stream(stream):
        torch.cuda.current_stream().wait_stream(stream)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.ones(100).sum()
    end.record(torch.cuda.current_stream())
    end.synchronize()
    assert start.query() and start.elapsed_time(end) >= 0.0


def test_cuda_rng_is_the_cpu_generator():
    torch.cuda.manual_seed(7)
    first = torch.rand(4)
    torch.cuda.manual_seed(7)
    assert torch.equal(torch.rand(4), first)
    state = torch.cuda.get_rng_state()
    drawn = torch.rand(4)
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(4), drawn)


def _tracker_draws(seed):
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", seed)
    with tracker.fork():
        first = torch.rand(4)
    with tracker.fork():
        second = torch.rand(4)
    return first, second


def test_megatron_rng_tracker_forks_its_own_reproducible_stream(caplog):
    torch.manual_seed(1)
    expected_default = torch.rand(4)
    torch.manual_seed(1)
    with caplog.at_level(logging.WARNING):
        first, second = _tracker_draws(seed=99)
    assert torch.equal(torch.rand(4), expected_default), "the fork must restore the default stream"
    assert not torch.equal(first, second), "a second fork continues the tracked stream"
    again_first, again_second = _tracker_draws(seed=99)
    assert torch.equal(first, again_first) and torch.equal(second, again_second)
    assert not torch.equal(first, expected_default)
    assert "CPU RNG state changed" not in caplog.text


def test_megatron_sets_the_rng_state_at_once():
    from megatron.core.tensor_parallel.random import _set_cuda_rng_state

    state = torch.get_rng_state()
    drawn = torch.rand(3)
    _set_cuda_rng_state(state)
    assert torch.equal(torch.rand(3), drawn)


@pytest.mark.skipif(triton_guard.triton_installed(), reason="triton is installed: the guard is not needed")
@pytest.mark.skipif(importlib.util.find_spec("megatron.core.transformer.custom_layers.batch_invariant_kernels") is None,
                    reason="megatron-core before 0.16 has no module that only needs triton")
def test_module_that_only_needs_triton_imports_and_explains_on_use():
    from megatron.core.transformer.custom_layers.batch_invariant_kernels import enable_batch_invariant_mode

    with pytest.raises(ImportError, match="needs triton"):
        enable_batch_invariant_mode()


@pytest.mark.skipif(triton_guard.triton_installed(), reason="triton is installed: the guard is not needed")
def test_other_missing_modules_still_fail_to_import():
    with pytest.raises(ModuleNotFoundError):
        import ascendspeed_no_such_module  # noqa: F401
    with pytest.raises(ModuleNotFoundError):
        import triton  # noqa: F401


def _megatron_lm_args(**values):
    args = argparse.Namespace(**{dest: value for dest, (value, _) in cpu_megatron_lm.CPU_ARGUMENT_DEFAULTS.items()})
    for dest, value in values.items():
        setattr(args, dest, value)
    return args


def test_cpu_capable_megatron_lm_arguments_pass():
    cpu_megatron_lm.check_cpu_arguments(_megatron_lm_args())


@pytest.mark.parametrize(
    "dest, value, flag",
    [("transformer_impl", "inference_optimized", "--transformer-impl local"),
     ("distributed_backend", "nccl", "--distributed-backend gloo"),
     ("gradient_accumulation_fusion", True, "--no-gradient-accumulation-fusion"),
     ("masked_softmax_fusion", True, "--no-masked-softmax-fusion"),
     ("apply_rope_fusion", True, "--no-rope-fusion"),
     ("no_persist_layer_norm", False, "--no-persist-layer-norm")],
)
def test_gpu_only_megatron_lm_arguments_name_the_flag_to_use(dest, value, flag):
    with pytest.raises(cpu_megatron_lm.CpuArgumentError, match=flag):
        cpu_megatron_lm.check_cpu_arguments(_megatron_lm_args(**{dest: value}))


def test_transformer_engine_impl_passes_where_te_is_absent(monkeypatch):
    """--transformer-impl transformer_engine builds megatron-core's local modules for TE's classes where TE is
    absent (accelerator.te_fallback); with TE installed on a CPU machine it is refused."""
    from ascendspeed.accelerator import te_fallback

    args = _megatron_lm_args(transformer_impl="transformer_engine")
    monkeypatch.setattr(te_fallback, "needed", lambda: True)
    cpu_megatron_lm.check_cpu_arguments(args)
    monkeypatch.setattr(te_fallback, "needed", lambda: False)
    with pytest.raises(cpu_megatron_lm.CpuArgumentError, match="--transformer-impl local"):
        cpu_megatron_lm.check_cpu_arguments(args)


def test_torchscript_still_compiles_calls_to_redirected_factories():
    @torch.jit.script
    def padded(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.zeros(2)])

    assert torch.equal(padded(torch.ones(1)), torch.tensor([1.0, 0.0, 0.0]))


def _multihot_sample(tokens, topk, experts, dtype, generator):
    """Top-k rows with distinct experts, some of them -1 (dropped) or past this rank's experts (another rank's)."""
    indices = torch.stack([torch.randperm(experts + 3, generator=generator)[:topk] for _ in range(tokens)]) - 1
    indices = indices.to(torch.int32)
    probs = torch.rand(tokens, topk, generator=generator, dtype=torch.float64).to(dtype).requires_grad_(True)
    return indices, probs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, topk, experts", [(1, 1, 1), (7, 2, 4), (64, 6, 30), (33, 8, 7)])
def test_indices_to_multihot_without_triton_matches_a_float64_loop(tokens, topk, experts, dtype):
    from megatron.core.fusions import fused_indices_converter

    generator = torch.Generator().manual_seed(tokens * 100 + topk)
    indices, probs = _multihot_sample(tokens, topk, experts, dtype, generator)
    routing_map, routed_probs = fused_indices_converter.fused_indices_to_multihot(indices, probs, experts)
    upstream = torch.randn(tokens, experts, generator=generator, dtype=torch.float64)
    (routed_probs.double() * upstream).sum().backward()

    expected_map = torch.zeros(tokens, experts, dtype=torch.bool)
    expected_probs = torch.zeros(tokens, experts, dtype=torch.float64)
    expected_grad = torch.zeros(tokens, topk, dtype=torch.float64)
    for token in range(tokens):
        for slot in range(topk):
            expert = int(indices[token, slot])
            if 0 <= expert < experts:
                expected_map[token, expert] = True
                expected_probs[token, expert] = probs[token, slot].double()
                expected_grad[token, slot] = upstream[token, expert].to(dtype).double()
    assert routing_map.dtype == torch.bool and routed_probs.dtype == dtype
    assert torch.equal(routing_map, expected_map)
    assert torch.equal(routed_probs.double(), expected_probs)
    assert torch.equal(probs.grad.double(), expected_grad)


def test_indices_to_multihot_names_mismatched_shapes():
    from megatron.core.fusions import fused_indices_converter

    with pytest.raises(ValueError, match="probs_indices"):
        fused_indices_converter.fused_indices_to_multihot(torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 3), 4)


def test_all_reduce_among_ranks_of_one_host_runs_in_shared_memory_as_gloo_reduces(nccl_world_job):
    """Every dtype, op and size (one element to 2.5 chunks of a rank's slot) reduced through shared memory gives
    gloo's bits and the float64 reduction rounded to the dtype; both ranks get the same bits."""
    per_rank = nccl_world_job[3]
    for index, (dtype, shape, op) in enumerate(SHARED_MEMORY_CASES):
        inputs = torch.stack([value.double() for value in _case_inputs(dtype, shape, index, 2)])
        expected = {"SUM": inputs.sum(0), "AVG": inputs.mean(0), "MAX": inputs.max(0).values,
                    "MIN": inputs.min(0).values}[op]
        for rank in range(2):
            shared, gloo = per_rank[rank][0][index]
            assert torch.equal(shared, per_rank[0][0][index][0]), (dtype, shape, op)
            if dtype.is_floating_point:  # gloo's AVG divides in the dtype: within one rounding of it
                torch.testing.assert_close(shared, gloo, rtol=0 if op != "AVG" else None,
                                           atol=0 if op != "AVG" else None)
                torch.testing.assert_close(shared, expected.to(dtype), rtol=0, atol=0)
            else:
                assert torch.equal(shared, gloo) and torch.equal(shared, expected.to(dtype)), (dtype, shape, op)
    for rank in range(2):
        _, strided, coalesced, leaf, used, (overlapped, future_value, completed_at_once) = per_rank[rank]
        assert used and completed_at_once
        assert torch.equal(overlapped, torch.full((6,), 5.0)) and torch.equal(future_value, overlapped)
        assert torch.equal(strided, torch.arange(64.0).view(8, 8)[:, ::2] * 3)
        assert torch.equal(coalesced[0], torch.full((3,), 1.0)) and torch.equal(coalesced[1], torch.full((5,), 2.0))
        assert torch.equal(leaf, torch.full((4,), 3.0))


def _shared_memory_region(world_size, pids):
    """A region as the group's ranks would map it, in this process: each rank's pid in its line."""
    from ascendspeed.accelerator.cpu_shared_memory import SLOT_BYTES
    from ascendspeed.ops._extension import load_extension

    header = load_extension().shm_all_reduce_header_bytes(world_size)
    region = torch.zeros(header + 2 * world_size * SLOT_BYTES, dtype=torch.uint8)
    for rank, pid in enumerate(pids):
        region[64 * (1 + rank):64 * (1 + rank) + 8].view(torch.int64)[0] = pid
    return region


def test_a_rank_waiting_for_a_peer_that_exited_says_which_one():
    """A rank that crashed never arrives: the waiting rank names it within seconds instead of waiting out the
    process group's timeout."""
    import subprocess
    import sys

    from ascendspeed.accelerator.cpu_shared_memory import SLOT_BYTES

    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    region = _shared_memory_region(2, [os.getpid(), int(exited.stdout)])
    with pytest.raises(RuntimeError, match=rf"rank 1 of the group \(pid {int(exited.stdout)}\) exited"):
        torch.ops.ascendspeed.shm_all_reduce_(torch.ones(4), region, 0, 2, SLOT_BYTES, 0, 60.0)


def test_a_rank_left_waiting_by_live_peers_times_out_naming_the_cause():
    from ascendspeed.accelerator.cpu_shared_memory import SLOT_BYTES

    region = _shared_memory_region(2, [os.getpid(), os.getpid()])
    with pytest.raises(RuntimeError, match=r"rank 0 waited more than 1.5 s for the other ranks of its group"):
        torch.ops.ascendspeed.shm_all_reduce_(torch.ones(4), region, 0, 2, SLOT_BYTES, 0, 1.5)
