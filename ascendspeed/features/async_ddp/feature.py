"""Async DDP: ``--overlap-grad-reduce`` with buckets on every pipeline stage, from the first step, measured."""
from __future__ import annotations

import argparse

from ascendspeed.features.async_ddp import hooks, telemetry
from ascendspeed.features.base import Feature, FeatureArgumentError
from ascendspeed.patching import replace, wrap

DDP = "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel"
BUFFER_MODULE = "megatron.core.distributed.param_and_grad_buffer"
BUFFER = f"{BUFFER_MODULE}:_ParamAndGradBuffer"
GROUP = f"{BUFFER_MODULE}:_ParamAndGradBucketGroup"
SCHEDULES = "megatron.core.pipeline_parallel.schedules"

_TC = "megatron.core.transformer.transformer_config.TransformerConfig"
_DDPC = "megatron.core.distributed.distributed_data_parallel_config.DistributedDataParallelConfig"
_PGC = "Optional[megatron.core.process_groups_config.ProcessGroupCollection]"
_PG = "torch.distributed.distributed_c10d.ProcessGroup"
_PARAM = "torch.nn.parameter.Parameter"
_FORCE = "force_all_reduce: Optional[bool] = False"
_SCHEDULE = (
    "(*, forward_step_func, data_iterator: Union[Iterator, List[Iterator]], model: "
    "Union[torch.nn.modules.module.Module, List[torch.nn.modules.module.Module]], num_microbatches: int, "
    "seq_length: int, micro_batch_size: int, decoder_seq_length: Optional[int] = None, forward_only: bool = "
    "False, collect_non_loss_data: bool = False, first_val_step: Optional[bool] = None, adjust_tensor_shapes_fn: "
    "Optional[Callable] = None, p2p_communicator: Optional[megatron.core.pipeline_parallel.p2p_communication."
    f"P2PCommunicator] = None, pg_collection: {_PGC} = None, {_FORCE})"
)

SIGNATURES = {
    "ddp_init": f"(self, config: {_TC}, ddp_config: {_DDPC}, module: torch.nn.modules.module.Module, "
    f"disable_bucketing: bool = False, pg_collection: {_PGC} = None)",
    "buffer_init": f"(self, ddp_config: {_DDPC}, param_dtype: torch.dtype, grad_dtype: torch.dtype, params: "
    f"List[{_PARAM}], data_parallel_group: {_PG}, bucket_size: int, param_to_name: Dict[{_PARAM}, str], "
    f"gradient_scaling_factor: float, param_indices: List[int], nccl_ub: bool, pg_collection: {_PGC} = None)",
    "post_hook": f"(self, param: {_PARAM})",
    "zero_grad_buffer": "(self)",
    "register_grad_ready": f"(self, param: {_PARAM}, {_FORCE})",
    "grad_sync": f"(self, {_FORCE})",
    "reset": "(self)",
    "reduce_scatter": "(output, input, op=<RedOpType.SUM: 0>, group=None, async_op=False)",
    "schedule": _SCHEDULE,
}


def log_on_first_data_parallel_rank(line: str) -> None:
    """Print a telemetry line once per pipeline stage (data- and tensor-parallel rank 0)."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            if parallel_state.get_data_parallel_rank() != 0 or parallel_state.get_tensor_model_parallel_rank() != 0:
                return
            if parallel_state.get_pipeline_model_parallel_world_size() > 1:
                line = f"{line} | pp stage {parallel_state.get_pipeline_model_parallel_rank()}"
        elif torch.distributed.get_rank() != 0:
            return
    print(line, flush=True)


class AsyncDDPFeature(Feature):
    name = "async_ddp"
    megatron_arguments = {
        "overlap_grad_reduce": False,
        "use_distributed_optimizer": False,
        "ddp_bucket_size": None,
        "overlap_param_gather_with_optimizer_step": False,
        "num_distributed_optimizer_instances": 1,
    }

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("ascendspeed async DDP")
        group.add_argument(
            "--no-overlap-grad-reduce-all-stages", action="store_false", dest="overlap_grad_reduce_all_stages",
            help="With --overlap-grad-reduce, restore megatron-core's bucketing policy: one bucket on pipeline "
            "stages after the first and on virtual-pipeline chunks after the first, launched after backward "
            "(honouring --no-align-grad-reduce). By default every stage and chunk keeps its buckets and "
            "launches each one from the gradient hooks as it fills.",
        )
        group.add_argument(
            "--log-grad-reduce-overlap", action="store_true",
            help="Time every gradient bucket collective (ready, started, completed from the collective's future) "
            "and print per-iteration communication time, exposed communication time and hidden fraction.",
        )

    def is_enabled(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, "overlap_grad_reduce", False) or getattr(args, "log_grad_reduce_overlap", False))

    def validate(self, args: argparse.Namespace) -> None:
        if not self.is_enabled(args):
            return
        bucket_size = getattr(args, "ddp_bucket_size", None)
        if bucket_size is not None and bucket_size <= 0:
            raise FeatureArgumentError(f"--ddp-bucket-size must be positive (elements), got {bucket_size}")
        if getattr(args, "overlap_grad_reduce", False) and getattr(args, "num_distributed_optimizer_instances", 1) > 1:
            raise FeatureArgumentError(
                "ascendspeed async DDP does not support --num-distributed-optimizer-instances > 1 with "
                "--overlap-grad-reduce (it needs CUDA side streams); use one instance"
            )

    def settings(self, args: argparse.Namespace) -> hooks.OverlapSettings:
        recorder = None
        if getattr(args, "log_grad_reduce_overlap", False):
            recorder = telemetry.TELEMETRY
            recorder.log = log_on_first_data_parallel_rank
        all_stages = bool(getattr(args, "overlap_grad_reduce_all_stages", True))
        return hooks.OverlapSettings(
            all_stages=all_stages,
            keep_chunk_buckets=not getattr(args, "overlap_param_gather_with_optimizer_step", False),
            telemetry=recorder,
        )

    def patches(self, args: argparse.Namespace):
        settings = self.settings(args)
        sig = SIGNATURES
        patches = [
            wrap(f"{DDP}.__init__", hooks.wrap_ddp_init(settings), expect=sig["ddp_init"]),
            wrap(f"{BUFFER}.__init__", hooks.wrap_buffer_init, expect=sig["buffer_init"]),
            replace(f"{DDP}._make_backward_post_hook", hooks.make_backward_post_hook(settings),
                    expect=sig["post_hook"]),
            replace(f"{GROUP}.register_grad_ready", hooks.register_grad_ready, expect=sig["register_grad_ready"]),
            wrap(f"{GROUP}.start_grad_sync", hooks.wrap_start_grad_sync(settings), expect=sig["grad_sync"]),
            replace(f"{GROUP}.finish_grad_sync", hooks.make_finish_grad_sync(settings), expect=sig["grad_sync"]),
            replace(f"{GROUP}.reset", hooks.make_reset(), expect=sig["reset"]),
            wrap(f"{BUFFER_MODULE}:dist_reduce_scatter_func", hooks.wrap_reduce_scatter,
                 expect=sig["reduce_scatter"], sweep=False),
        ]
        if settings.all_stages or settings.telemetry is not None:
            for name in ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
                         "forward_backward_pipelining_with_interleaving"):
                patches.append(wrap(f"{SCHEDULES}:{name}", hooks.wrap_schedule(settings), expect=sig["schedule"]))
        if settings.telemetry is not None:
            patches.append(wrap(f"{DDP}.zero_grad_buffer", hooks.wrap_zero_grad_buffer(settings),
                                expect=sig["zero_grad_buffer"]))
        return patches


def ddp_config_from_args(args: argparse.Namespace, **overrides):
    """The ``DistributedDataParallelConfig`` the flags describe, for entries that build DDP themselves."""
    from megatron.core.distributed import DistributedDataParallelConfig

    settings = dict(
        overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),
        use_distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
        bucket_size=getattr(args, "ddp_bucket_size", None),
    )
    settings.update(overrides)
    return DistributedDataParallelConfig(**settings)
