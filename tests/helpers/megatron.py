"""Tiny megatron-core GPT models for tests, and the plumbing to compare parallel layouts with a reference.

Importing this module changes nothing: the adaptor is installed by the test session and in each rank
(``tests.helpers.distributed``), so on a machine without a GPU megatron-core runs on the CPU. Use it inside ``run_distributed`` workers (megatron needs
``torch.distributed``), after ``initialize_parallel``. A model-parallel comparison::

    shape = TinyGPT()                                   # 2 layers, hidden 32, 4 heads, vocab 64, seq 16
    initialize_parallel()                               # megatron parallel state + seeded RNGs
    reference = build_gpt_model(shape.config())         # the unsharded, single-process reference
    full = full_parameters(reference)                   # {name: tensor}, names of the unsharded layout
    batch = make_batch(shape, batch_size=8)             # deterministic tokens/labels/masks
    reference_forward_backward(reference, batch, shape) # plain autograd, micro-batch by micro-batch
    expected = gradients([reference])
    destroy_parallel(); initialize_parallel(tp=2)
    chunks = build_model_chunks(shape.config())         # this rank's shard(s), one per virtual stage
    load_full_parameters(chunks, full)                  # the same initial weights, sliced for this rank
    losses = run_forward_backward(chunks, batch, shape) # megatron's schedule for the current layout
    for name, param in named_parameters_full(chunks):   # unsharded names ...
        shard_like(expected[name], param, name, chunks[0].config)  # ... and this rank's slice of a full tensor

Data parallel training: ``wrap_ddp`` (megatron DDP, Float16Module for bf16/fp16, the schedule hooks),
``make_optimizer`` (``get_megatron_optimizer``, Adam), ``data_parallel_slice`` (this rank's share of a
global batch), ``train_step``; ``gather_reduced_gradients`` completes ``main_grad`` under the distributed
optimizer. ``reference_gpt_loss`` is a GPT written from scratch in plain torch, an independent reference.
``relative_error``/``max_relative_error`` compare (``||a - b|| / ||b||``).

Names: ``full_parameters``/``named_parameters_full``/``gradients`` always use the unsharded, non-pipelined
names (``decoder.layers.<global index>...``), whatever the tensor/pipeline layout of the model they read.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import tempfile
from typing import Dict, Iterable, List, Optional

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

SEED = 1234


@dataclasses.dataclass
class TinyGPT:
    """The size of a test GPT and of its batches; ``config()`` turns it into a ``TransformerConfig``."""

    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 4
    vocab_size: int = 64
    seq_length: int = 16
    micro_batch_size: int = 2

    def config(self, **overrides) -> TransformerConfig:
        """fp32, no dropout, parallel sizes from the current parallel state; ``overrides`` win."""
        vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        settings = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
            virtual_pipeline_model_parallel_size=vpp,
            pipeline_dtype=torch.float32,
            params_dtype=torch.float32,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            gradient_accumulation_fusion=False,
            apply_rope_fusion=False,
        )
        settings.update(overrides)
        return TransformerConfig(**settings)


def initialize_parallel(tp: int = 1, pp: int = 1, vpp: Optional[int] = None, seed: int = SEED) -> None:
    """Megatron's parallel state over the already initialised ``torch.distributed`` world, then seeds."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def one_process_world():
    """A one-process gloo world with megatron's parallel state, for tests that run in the pytest process."""
    with tempfile.TemporaryDirectory() as rendezvous:
        torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}/store", rank=0, world_size=1)
        initialize_parallel(tp=1)
        try:
            yield
        finally:
            destroy_parallel()
            torch.distributed.destroy_process_group()


def build_gpt_model(config: TransformerConfig, shape: Optional[TinyGPT] = None, vp_stage: Optional[int] = None,
                    layer_spec=None, **gpt_kwargs) -> GPTModel:
    """A GPTModel (local spec: no Transformer Engine) for this rank's pipeline stage ``vp_stage``.

    Weights come from torch's and the model-parallel RNG: call ``initialize_parallel`` (which seeds them)
    right before building to get the same weights in every process.
    """
    shape = shape or TinyGPT()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    stage = vp_stage if vpp is not None else None
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec or get_gpt_layer_local_spec(),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
        vp_stage=stage,
        **gpt_kwargs,
    )


def build_model_chunks(config: TransformerConfig, shape: Optional[TinyGPT] = None, **kwargs) -> List[GPTModel]:
    """This rank's model: one GPTModel per virtual pipeline stage (a one-element list without VPP)."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    return [build_gpt_model(config, shape, vp_stage=stage, **kwargs) for stage in range(vpp)]


def wrap_ddp(chunks: List[torch.nn.Module], use_distributed_optimizer: bool = False, **ddp_settings) -> list:
    """Megatron DDP around each chunk (Float16Module first when the config is bf16/fp16), and the config
    hooks megatron's schedules call: ``finalize_model_grads`` (the DP reduction) and ``no_sync``."""
    config = unwrap(chunks[0]).config
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer, **ddp_settings)
    wrapped = []
    for index, chunk in enumerate(chunks):
        module = Float16Module(config, chunk) if (config.bf16 or config.fp16) else chunk
        wrapped.append(DistributedDataParallel(config, ddp_config, module, disable_bucketing=index > 0))
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [ddp.no_sync for ddp in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return wrapped


def make_optimizer(ddp_chunks: list, lr: float = 1e-3, **settings):
    """``get_megatron_optimizer`` with Adam, no weight decay and no clipping unless ``settings`` say so
    (then a plain ``torch.optim.Adam`` with the same ``lr`` is its reference); bf16/fp16 follow the model."""
    config = unwrap(ddp_chunks[0]).config
    options = dict(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=0.0, bf16=config.bf16, fp16=config.fp16,
                   use_distributed_optimizer=ddp_chunks[0].ddp_config.use_distributed_optimizer)
    options.update(settings)
    return get_megatron_optimizer(OptimizerConfig(**options), ddp_chunks)


def train_step(ddp_chunks: list, optimizer, batch: dict, shape: Optional[TinyGPT] = None) -> List[torch.Tensor]:
    """Zero grads, forward/backward this rank's ``batch`` through megatron's schedule, optimizer step.
    Returns the micro-batch losses (last pipeline stage)."""
    for ddp in ddp_chunks:
        ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = run_forward_backward(ddp_chunks, batch, shape)
    optimizer.step()
    return losses


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not isinstance(model, GPTModel) and hasattr(model, "module"):
        model = model.module
    return model


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def full_name(model: torch.nn.Module, name: str) -> str:
    """The unsharded, non-pipelined name of parameter ``name`` of ``model``: local layer index -> global."""
    gpt = unwrap(model)
    match = _LAYER.match(name)
    if not match:
        return name
    layer = gpt.decoder.layers[int(match.group(1))]
    return f"decoder.layers.{layer.layer_number - 1}." + name[match.end():]


def named_parameters_full(chunks: Iterable[torch.nn.Module]):
    """``(full name, parameter)`` for every parameter of this rank's model chunks."""
    for chunk in chunks:
        gpt = unwrap(chunk)
        for name, param in gpt.named_parameters():
            yield full_name(gpt, name), param


def full_parameters(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Detached copies of the parameters of an unsharded (TP=1, PP=1) model, by name."""
    return {name: param.detach().clone() for name, param in named_parameters_full([model])}


def shard_like(full: torch.Tensor, param: torch.Tensor, name: str, config: TransformerConfig) -> torch.Tensor:
    """This rank's tensor-parallel slice of the unsharded ``full`` tensor that ``param`` shards."""
    if not getattr(param, "tensor_model_parallel", False) or full.shape == param.shape:
        return full
    size = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    dim = param.partition_dim
    if config.gated_linear_unit and ".mlp.linear_fc1." in name:
        halves = full.chunk(2, dim=dim)
        return torch.cat([half.chunk(size, dim=dim)[rank] for half in halves], dim=dim)
    return full.chunk(size, dim=dim)[rank]


def load_full_parameters(chunks: Iterable[torch.nn.Module], full: Dict[str, torch.Tensor]) -> None:
    """Copy the unsharded weights ``full`` into this rank's (sharded, pipelined) model chunks."""
    chunks = list(chunks)
    config = unwrap(chunks[0]).config
    with torch.no_grad():
        for name, param in named_parameters_full(chunks):
            param.copy_(shard_like(full[name], param, name, config))


def make_batch(shape: Optional[TinyGPT] = None, batch_size: Optional[int] = None, seed: int = 0) -> dict:
    """A deterministic language-model batch: ``tokens``, ``labels`` (tokens shifted), ``position_ids``,
    ``attention_mask`` (causal, True = masked) and ``loss_mask`` (a few positions masked out)."""
    shape = shape or TinyGPT()
    batch_size = batch_size or shape.micro_batch_size
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(0, shape.vocab_size, (batch_size, shape.seq_length + 1), generator=generator)
    loss_mask = torch.ones(batch_size, shape.seq_length)
    loss_mask[:, ::5] = 0.0
    causal = torch.triu(torch.ones(shape.seq_length, shape.seq_length, dtype=torch.bool), diagonal=1)
    return {
        "tokens": text[:, :-1].contiguous(),
        "labels": text[:, 1:].contiguous(),
        "position_ids": torch.arange(shape.seq_length).unsqueeze(0).expand(batch_size, -1).contiguous(),
        "attention_mask": causal.view(1, 1, shape.seq_length, shape.seq_length),
        "loss_mask": loss_mask,
    }


def split_batch(batch: dict, parts: int) -> List[dict]:
    """``batch`` cut along the sample dimension into ``parts`` equal batches (the mask is shared)."""
    pieces = {key: (value.chunk(parts) if key != "attention_mask" else [value] * parts) for key, value in batch.items()}
    return [{key: pieces[key][i] for key in batch} for i in range(parts)]


def data_parallel_slice(batch: dict) -> dict:
    """This data-parallel rank's share of a global batch."""
    size = parallel_state.get_data_parallel_world_size()
    return split_batch(batch, size)[parallel_state.get_data_parallel_rank()]


def masked_mean_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    return (per_token_loss.float().reshape(-1) * loss_mask.reshape(-1)).sum() / loss_mask.sum()


def forward_step(data_iterator, model):
    """A ``forward_step_func`` for megatron's schedules: GPT forward with labels, masked mean loss."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

    def loss_func(per_token_loss):
        loss = masked_mean_loss(per_token_loss, batch["loss_mask"])
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def run_forward_backward(chunks: List[torch.nn.Module], batch: dict, shape: Optional[TinyGPT] = None,
                         forward_only: bool = False) -> List[torch.Tensor]:
    """One forward/backward of ``batch`` (this rank's share) in micro-batches of ``shape.micro_batch_size``,
    through ``get_forward_backward_func()`` for the current parallel layout. Returns the micro-batch
    losses (on the last pipeline stage; empty elsewhere). Gradients are those of the mean loss."""
    shape = shape or TinyGPT()
    num_microbatches = batch["tokens"].shape[0] // shape.micro_batch_size
    micro_batches = split_batch(batch, num_microbatches)
    iterators = [iter(micro_batches) for _ in chunks]
    results = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=num_microbatches,
        seq_length=shape.seq_length,
        micro_batch_size=shape.micro_batch_size,
        forward_only=forward_only,
    )
    return [result["lm loss"] for result in results]


def reference_forward_backward(model: torch.nn.Module, batch: dict, shape: Optional[TinyGPT] = None) -> List[float]:
    """Plain autograd on one unsharded model, no schedule: ``.grad`` of the mean micro-batch loss."""
    shape = shape or TinyGPT()
    num_microbatches = batch["tokens"].shape[0] // shape.micro_batch_size
    losses = []
    for micro in split_batch(batch, num_microbatches):
        output = model(micro["tokens"], micro["position_ids"], micro["attention_mask"], labels=micro["labels"])
        loss = masked_mean_loss(output, micro["loss_mask"])
        (loss / num_microbatches).backward()
        losses.append(loss.detach())
    return losses


def reference_gpt_loss(params: Dict[str, torch.Tensor], batch: dict, config: TransformerConfig) -> torch.Tensor:
    """The masked mean loss of a GPT written from scratch in plain torch, from unsharded ``params``: an
    independent check of megatron's local-spec GPTModel (learned absolute positions, pre-LayerNorm,
    grouped-query attention with megatron's fused QKV layout, GELU or GLU MLP, untied output layer).

    Differentiate it with ``torch.autograd.grad`` for reference gradients.
    """
    import torch.nn.functional as F

    heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    head_dim = config.kv_channels or config.hidden_size // heads
    eps = config.layernorm_epsilon

    def norm(x, prefix):
        return F.layer_norm(x, x.shape[-1:], params[prefix + ".weight"], params[prefix + ".bias"], eps)

    def linear(x, prefix):
        return F.linear(x, params[prefix + ".weight"], params.get(prefix + ".bias"))

    tokens, positions = batch["tokens"], batch["position_ids"]
    batch_size, seq = tokens.shape
    x = params["embedding.word_embeddings.weight"][tokens] + params["embedding.position_embeddings.weight"][positions]
    for layer in range(config.num_layers):
        prefix = f"decoder.layers.{layer}"
        qkv = linear(norm(x, prefix + ".input_layernorm"), prefix + ".self_attention.linear_qkv")
        qkv = qkv.view(batch_size, seq, groups, (heads // groups + 2) * head_dim)
        q, k, v = qkv.split([heads // groups * head_dim, head_dim, head_dim], dim=-1)
        q = q.reshape(batch_size, seq, heads, head_dim).transpose(1, 2)
        k = k.repeat_interleave(heads // groups, dim=2).transpose(1, 2)
        v = v.repeat_interleave(heads // groups, dim=2).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2)) / head_dim ** 0.5
        scores = scores.masked_fill(batch["attention_mask"], -10000.0)
        probs = scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(v.dtype)
        context = (probs @ v).transpose(1, 2).reshape(batch_size, seq, heads * head_dim)
        x = x + linear(context, prefix + ".self_attention.linear_proj")
        hidden = linear(norm(x, prefix + ".pre_mlp_layernorm"), prefix + ".mlp.linear_fc1")
        if config.gated_linear_unit:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = config.activation_func(gate) * up
        else:
            hidden = config.activation_func(hidden)
        x = x + linear(hidden, prefix + ".mlp.linear_fc2")
    logits = F.linear(norm(x, "decoder.final_layernorm"), params["output_layer.weight"])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                                reduction="none")
    return masked_mean_loss(per_token, batch["loss_mask"])


def gradients(chunks: Iterable[torch.nn.Module]) -> Dict[str, torch.Tensor]:
    """Each parameter's gradient by full name: ``main_grad`` under megatron DDP, else ``.grad``."""
    result = {}
    for name, param in named_parameters_full(chunks):
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        result[name] = grad.detach().clone()
    return result


def gather_reduced_gradients(ddp_model) -> None:
    """With the distributed optimizer each rank holds only its shard of the reduced gradients; gather the
    others so every ``main_grad`` is complete (call after the grads are synced, before comparing them)."""
    group = parallel_state.get_data_parallel_group()
    size = torch.distributed.get_world_size(group)
    rank = torch.distributed.get_rank(group)
    for buffer in list(ddp_model.buffers) + list(ddp_model.expert_parallel_buffers):
        for bucket in buffer.buckets:
            local = bucket.grad_data.chunk(size)[rank].clone()
            torch.distributed.all_gather_into_tensor(bucket.grad_data, local, group=group)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (0 when both are zero)."""
    actual, expected = actual.double(), expected.double()
    scale = expected.norm().item()
    difference = (actual - expected).norm().item()
    return difference / scale if scale else difference


def max_relative_error(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> float:
    """The worst ``relative_error`` over the tensors named in ``actual``."""
    return max(relative_error(actual[name], expected[name]) for name in actual)
