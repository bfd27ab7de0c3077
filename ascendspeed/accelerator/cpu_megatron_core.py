"""The megatron-core sites the generic CPU shims cannot reach: the RNG tracker and pipeline p2p on gloo.

* ``tensor_parallel.random._set_cuda_rng_state`` restores RNG states through ``torch.cuda._lazy_call``,
  which on a CPU-only torch *queues the call forever*: the tracker would never switch states and every
  "forked" dropout mask would come from the default stream, silently. It sets the CPU generator instead.
  Its tracker's ``fork`` also warns "CPU RNG state changed within GPU RNG context" whenever the forked body
  draws random numbers; on the CPU that is the intended behaviour, so the warning is dropped while forking.
* ``pipeline_parallel.p2p_communication._batched_p2p_ops`` posts its sends and receives untagged. With
  pipeline size 2 the previous and the next stage are the same process; the interleaved (virtual
  pipeline) schedule then sends an activation and a gradient to the same peer in one batch, in the order
  (gradient, activation), while the peer receives (activation, gradient). gloo pairs untagged messages in
  posting order, so the two tensors (of equal shape) are swapped and the loss is silently wrong. Tagging
  the forward direction (activations: send-next / receive-prev) and the backward direction (gradients:
  send-prev / receive-next) differently makes each direction its own ordered channel.
* ``pipeline_parallel.schedules.deallocate_output_tensor`` swaps a sent activation's storage for a
  1-element tensor right after posting the send (Megatron-LM always asks for it). With
  ``overlap_p2p_comm`` (Megatron-LM's default for the interleaved schedule) the send is still in flight
  then. On NCCL the caching allocator does not reuse memory a pending send's stream still reads; gloo
  sends from a background thread that reads the freed memory, so the next stage sometimes receives
  garbage (NaN losses, at random). On the CPU the pseudo-free still happens (``custom_backward`` relies on
  it) but the tensor keeps a reference to its old storage, released with the tensor after backward.
* ``parallel_state.destroy_model_parallel`` forgets the groups ``initialize_model_parallel`` made but
  destroys only its ``*_GLOO`` ones (NCCL communicators are made lazily and cost nothing until used). A
  gloo group starts its threads when it is made: a process that sets the parallel state up again and
  again (Megatron's unit tests, ascendspeed's) kept every earlier state's groups alive, ~700 threads per
  rank after a dozen set-ups, all of them waking up. The groups made during ``initialize_model_parallel``
  are destroyed with the state, except those a live ``DeviceMesh`` names (Megatron-FSDP's): DTensors of
  one state can carry that mesh into the next, which resolves its groups by name (Megatron's GPT-to-hybrid
  checkpoint tests save and load Megatron-FSDP models of several layouts in one process); on NCCL no group is
  destroyed.
* ``models.common.embeddings.rope_utils.get_pos_emb_on_this_cp_rank`` (RoPE under context parallelism) builds
  its chunk indices in pinned host memory and copies them to CUDA, which a CPU-only torch refuses ("Found no
  NVIDIA driver"). It takes this rank's two chunks of the balanced layout on the embedding's own device.
* ``tensor_parallel.mappings.all_to_all`` (the MoE alltoall dispatcher's exchange over the expert-parallel
  group) receives its split sizes as numpy arrays (the dispatcher copies the token counts to the host);
  NCCL's binding of ``all_to_all_single`` takes them, gloo's wants lists of ints ("incompatible function
  arguments"). They are handed on as lists (the autograd function keeps them for backward too).
* ``parallel_state.get_nccl_options`` builds ``ProcessGroupNCCL.Options`` for the groups named in
  ``--nccl-communicator-config-path`` or in ``high_priority_stream_groups`` (Megatron-LM 0.15 puts ``dp_cp``
  there for ``--use-torch-fsdp2``); a CPU-only torch has no ``ProcessGroupNCCL``, and the groups are gloo's,
  which take no NCCL options: there are none.
* ``fusions.fused_indices_converter.fused_indices_to_multihot`` (the flex dispatcher's top-k indices to a
  multi-hot routing map, experimental) is a triton kernel that allocates on CUDA. Off CUDA the same
  contract runs as two torch scatters (``indices_to_multihot``); its backward is their gather.
"""
from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.distributed as dist

from ascendspeed.accelerator import cpu_runtime
from ascendspeed.accelerator.triton_guard import triton_on_cuda_only
from ascendspeed.patching import EXISTS, replace, wrap

#: gloo message tags of the two pipeline directions (0 stays the default of all other traffic).
ACTIVATION_TAG = 1
GRADIENT_TAG = 2


def set_cuda_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
    """Set the device RNG, which on the CPU is ``torch.default_generator``, now (not lazily)."""
    torch.default_generator.set_state(new_state)


class _DropCpuRngChangedWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_CPU_RNG_FILTER = _DropCpuRngChangedWarning()


def _wrap_fork(original):
    logger = logging.getLogger("megatron.core.tensor_parallel.random")

    @functools.wraps(original)
    @contextlib.contextmanager
    def fork(self, *args, **kwargs):
        logger.addFilter(_CPU_RNG_FILTER)
        try:
            with original(self, *args, **kwargs):
                yield
        finally:
            logger.removeFilter(_CPU_RNG_FILTER)

    return fork


def batched_p2p_ops(
    *,
    tensor_send_prev,
    tensor_recv_prev,
    tensor_send_next,
    tensor_recv_next,
    group,
    prev_pipeline_rank: int,
    next_pipeline_rank: int,
):
    """Megatron's batched pipeline exchange with activations and gradients on distinct tags."""
    dist = torch.distributed
    planned = (
        (dist.isend, tensor_send_prev, prev_pipeline_rank, GRADIENT_TAG),
        (dist.irecv, tensor_recv_prev, prev_pipeline_rank, ACTIVATION_TAG),
        (dist.isend, tensor_send_next, next_pipeline_rank, ACTIVATION_TAG),
        (dist.irecv, tensor_recv_next, next_pipeline_rank, GRADIENT_TAG),
    )
    ops = [dist.P2POp(op, tensor, peer, group, tag) for op, tensor, peer, tag in planned if tensor is not None]
    return dist.batch_isend_irecv(ops) if ops else []


def _wrap_deallocate_output_tensor(original):
    @functools.wraps(original)
    def deallocate_output_tensor(out, deallocate_pipeline_outputs=False):
        if out is not None and not isinstance(out, torch.Tensor):
            # megatron-core 0.17+ takes lists and dicts of tensors and recurses through this wrapper.
            return original(out, deallocate_pipeline_outputs)
        in_flight = out.data if (out is not None and deallocate_pipeline_outputs) else None
        original(out, deallocate_pipeline_outputs)
        if in_flight is not None:
            out.ascendspeed_storage_in_flight = in_flight

    return deallocate_output_tensor


def _split_sizes(sizes):
    """``None`` or a list of ints, from whatever sequence of counts the caller holds (array, tensor, list)."""
    if sizes is None or isinstance(sizes, list):
        return sizes
    return [int(size) for size in (sizes.tolist() if hasattr(sizes, "tolist") else sizes)]


def _wrap_all_to_all_v015(original):
    @functools.wraps(original)
    def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None):
        return original(group, input_, _split_sizes(output_split_sizes_), _split_sizes(input_split_sizes))

    return all_to_all


def _wrap_all_to_all(original):
    @functools.wraps(original)
    def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None, use_nccl_stream=False):
        return original(group, input_, _split_sizes(output_split_sizes_), _split_sizes(input_split_sizes),
                        use_nccl_stream)

    return all_to_all


def indices_to_multihot(indices: torch.Tensor, probs_indices: torch.Tensor, num_of_local_experts: int):
    """``fused_indices_to_multihot`` in torch: top-k ``indices`` [tokens, topk] (-1, or an expert this rank does not
    hold, means none) and their ``probs_indices`` to a bool routing map and the probabilities in its places, both
    [tokens, num_of_local_experts]. Differentiable in ``probs_indices`` (a gather, zero where nothing was routed)."""
    if indices.shape != probs_indices.shape:
        raise ValueError(f"indices {tuple(indices.shape)} and probs_indices {tuple(probs_indices.shape)} must have "
                         "the same shape")
    routed = (indices >= 0) & (indices < num_of_local_experts)
    columns = torch.where(routed, indices, num_of_local_experts).long()
    tokens = indices.size(0)
    multihot = indices.new_zeros(tokens, num_of_local_experts + 1, dtype=torch.bool).scatter_(1, columns, True)
    probs = probs_indices.new_zeros(tokens, num_of_local_experts + 1).scatter(1, columns, probs_indices)
    return multihot[:, :num_of_local_experts], probs[:, :num_of_local_experts]


def moe_patches():
    name = "gloo all-to-all: MoE split sizes as lists of ints (wrap)"
    return [
        wrap("megatron.core.fusions.fused_indices_converter:fused_indices_to_multihot",
             triton_on_cuda_only(indices_to_multihot), expect="(indices, probs_indices, num_of_local_experts)",
             name="cpu moe: wrap fused_indices_to_multihot (triton), off CUDA its routing map from torch scatters"),
        wrap("megatron.core.tensor_parallel.mappings:all_to_all", _wrap_all_to_all_v015,
             expect="(group, input_, output_split_sizes_=None, input_split_sizes=None)", megatron="<0.18",
             name=name),
        wrap("megatron.core.tensor_parallel.mappings:all_to_all", _wrap_all_to_all,
             expect="(group, input_, output_split_sizes_=None, input_split_sizes=None, use_nccl_stream=False)",
             megatron=">=0.18", name=name),
    ]


def pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """megatron-core's ``get_pos_emb_on_this_cp_rank`` on the embedding's device: of ``2 * cp`` equal chunks
    along ``seq_dim``, rank ``r`` takes chunks ``r`` and ``2 * cp - 1 - r``, in that order."""
    from ascendspeed.features.context_parallel import layout

    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    return layout.split_for_rank(pos_emb, seq_dim, cp_group.rank(), cp_group.size())


def rope_patches():
    return [
        replace("megatron.core.models.common.embeddings.rope_utils:get_pos_emb_on_this_cp_rank",
                pos_emb_on_this_cp_rank, expect="(pos_emb, seq_dim, cp_group)",
                name="cpu rope: this context-parallel rank's positions without pinned memory or .cuda()"),
    ]


def rng_patches():
    return [
        replace("megatron.core.tensor_parallel.random:_set_cuda_rng_state", set_cuda_rng_state,
                expect="(new_state, device=-1, graph_safe=False)",
                name="cpu rng: set the CPU generator instead of a lazily queued CUDA call"),
        wrap("megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork", _wrap_fork,
             expect="(self, name='model-parallel-rng')",
             name="cpu rng: the forked RNG is the CPU's, drop the warning that it changed"),
    ]


def p2p_patches():
    return [
        replace("megatron.core.pipeline_parallel.p2p_communication:_batched_p2p_ops", batched_p2p_ops,
                expect="(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group, "
                       "prev_pipeline_rank, next_pipeline_rank)",
                name="gloo p2p: tag activations and gradients apart (pipeline size 2 + virtual pipeline)"),
        wrap("megatron.core.pipeline_parallel.schedules:deallocate_output_tensor", _wrap_deallocate_output_tensor,
             expect="(out, deallocate_pipeline_outputs=False)",
             name="gloo p2p: keep sent activations' memory while gloo may still read it"),
    ]


def _live_process_groups() -> list:
    # torch keeps no public list of the groups a process has made; this is the map destroy_process_group
    # itself consults.
    return list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else []


def process_group_patches():
    """Destroy the groups of a model-parallel state with it; the record of them lives in these patches."""
    made_by_initialize: list = []

    def wrap_initialize(original):
        @functools.wraps(original)
        def initialize_model_parallel(*args, **kwargs):
            before = set(_live_process_groups())
            try:
                return original(*args, **kwargs)
            finally:
                made_by_initialize.extend(group for group in _live_process_groups() if group not in before)

        return initialize_model_parallel

    def wrap_destroy(original):
        @functools.wraps(original)
        def destroy_model_parallel(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            finally:
                live = set(_live_process_groups())  # Megatron destroyed its *_GLOO groups itself
                meshed = cpu_runtime.groups_named_by_device_meshes()
                for group in reversed(made_by_initialize):
                    if group in live and group.group_name not in meshed:
                        dist.destroy_process_group(group)
                made_by_initialize.clear()

        return destroy_model_parallel

    # Both wrappers pass every argument through, so the releases' differing signatures do not matter.
    return [
        wrap("megatron.core.parallel_state:initialize_model_parallel", wrap_initialize, expect=EXISTS,
             name="gloo groups: record the groups the model-parallel state makes"),
        wrap("megatron.core.parallel_state:destroy_model_parallel", wrap_destroy, expect="()",
             name="gloo groups: destroy them with the state (their threads end)"),
        replace("megatron.core.parallel_state:get_nccl_options", no_nccl_options, expect="(pg_name, nccl_comm_cfgs)",
                name="gloo groups: no NCCL communicator options"),
    ]


def no_nccl_options(pg_name, nccl_comm_cfgs):
    """The groups are gloo's, which take no NCCL options (a CPU-only torch has no ``ProcessGroupNCCL``)."""
    return None
