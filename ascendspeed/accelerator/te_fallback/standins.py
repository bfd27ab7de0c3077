"""The names megatron-core's specs use for Transformer Engine classes, and the patches that put stand-ins there.

A stand-in is what calling the TE class builds: ``TELinear(...)`` returns the local module of ``modules.py``
with TE's constructor contract (as upstream's own ``TENorm`` returns a TE norm from ``__new__``). The stand-ins
import nothing from Megatron when defined, so the patches can wait for their modules to load; the local modules
are imported when the first one is built, once megatron-core is fully loaded. ``isinstance(module, TELinear)``
holds for what a stand-in builds.

Initial weights follow TE's rule: TE's modules draw them inside the model-parallel RNG tracker only once it has
states (megatron-core passes ``get_rng_state_tracker`` only if ``get_cuda_rng_tracker().is_initialized()``), and
from the default generator before; megatron-core's local modules always fork it, and an empty tracker raises
"cuda rng state model-parallel-rng is not added". A stand-in built before any seeding draws as TE would.

Every target is checked against the upstream constructor as megatron-core wrote it: where TE is absent its TE
classes are mocks that keep the class body (``describe_signature`` reads their ``__init__``).
"""
from __future__ import annotations

import contextlib
import functools
import importlib

import torch

from ascendspeed.patching import ABSENT, Patch, describe_signature, replace, wrap

_MODULES = "ascendspeed.accelerator.te_fallback.modules"
_GROUPED = "ascendspeed.accelerator.te_fallback.grouped_linear"
#: What ``describe_signature`` says of a name megatron-core sets to None where TE is absent.
_NONE = describe_signature(None)


class _StandInType(type):
    """``isinstance``/``issubclass`` against a stand-in ask the local class it builds."""

    def __instancecheck__(cls, instance) -> bool:
        local = cls.local_class()
        return local is not None and isinstance(instance, local)

    def __subclasscheck__(cls, subclass) -> bool:
        local = cls.local_class()
        return type.__subclasscheck__(cls, subclass) or (local is not None and issubclass(subclass, local))


class _StandIn(metaclass=_StandInType):
    #: The module that defines the builder.
    module = _MODULES
    #: Name of the builder (a class or a function) in ``module``.
    builder = ""
    #: Name of the class in ``module`` whose instances the builder returns ("": the builder is that class).
    local: "str | None" = ""

    @classmethod
    def local_class(cls):
        """The class of what the stand-in builds (None: several, e.g. a torch LayerNorm or RMSNorm)."""
        if cls.local is None:
            return None
        return getattr(importlib.import_module(cls.module), cls.local or cls.builder)

    def __new__(cls, *args, **kwargs):
        # The builder has the upstream constructor's parameters: a wrong call fails there, naming them.
        with _initialised_as_te_does():
            return getattr(importlib.import_module(cls.module), cls.builder)(*args, **kwargs)


@contextlib.contextmanager
def _initialised_as_te_does():
    """While a stand-in is built: an RNG tracker without states forks nothing (the default generator draws)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    if tracker.is_initialized() or "fork" in vars(tracker):
        yield
        return
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        del tracker.fork


class TENorm(_StandIn):
    """``TENorm(config, hidden_size, eps=1e-5, has_residual=False)``: megatron-core's local norm."""

    builder = "local_te_norm"
    local = None


class TELinear(_StandIn):
    """``TELinear(input_size, output_size, *, parallel_mode, ...)``: column-/row-parallel or duplicated."""

    builder = "local_te_linear"
    local = "LocalTELinearBase"


class TELayerNormColumnParallelLinear(_StandIn):
    builder = "LocalTELayerNormColumnParallelLinear"


class TELayerNormColumnParallelLinearGathered(_StandIn):
    """The heterogeneous specs' block replacement: ``(config, tp_comm_buffer_name)``."""

    builder = "LocalTELayerNormColumnParallelLinearGathered"


class TEColumnParallelLinear(_StandIn):
    builder = "LocalTEColumnParallelLinear"


class TERowParallelLinear(_StandIn):
    builder = "LocalTERowParallelLinear"


class TEDotProductAttention(_StandIn):
    builder = "LocalTEDotProductAttention"


class TEColumnParallelGroupedLinear(_StandIn):
    """``TEColumnParallelGroupedLinear(num_gemms, input_size, output_size, *, ...)``: the grouped experts' fc1."""

    module = _GROUPED
    builder = "LocalTEColumnParallelGroupedLinear"


class TERowParallelGroupedLinear(_StandIn):
    """``TERowParallelGroupedLinear(num_gemms, input_size, output_size, *, ...)``: the grouped experts' fc2."""

    module = _GROUPED
    builder = "LocalTERowParallelGroupedLinear"


class TESpecProvider(_StandIn):
    """gpt_layer_specs' ``TESpecProvider()``: megatron-core's provider (its q/k norm a ``TENorm`` too, below)."""

    module = "megatron.core.extensions.transformer_engine_spec_provider"
    builder = "TESpecProvider"


for _stand_in in (TENorm, TELinear, TELayerNormColumnParallelLinear, TELayerNormColumnParallelLinearGathered,
                  TEColumnParallelLinear, TERowParallelLinear, TEDotProductAttention, TEColumnParallelGroupedLinear,
                  TERowParallelGroupedLinear, TESpecProvider):
    _stand_in.__module__ = __name__


# Upstream constructors, as megatron-core's TE classes declare them (stubbed: read from the class body).
_LINEAR = ("input_size, output_size, *, parallel_mode, config, init_method, bias, skip_bias_add, "
           "skip_weight_param_allocation, tp_comm_buffer_name=None, is_expert=False, symmetric_ar_type=None, "
           "tp_group=None")
_COLUMN = ("input_size, output_size, *, config, init_method, gather_output, bias, skip_bias_add, is_expert, "
           "skip_weight_param_allocation=False, tp_comm_buffer_name=None, tp_group=None")
_ROW = ("input_size, output_size, *, config, init_method, bias, input_is_parallel, skip_bias_add, is_expert, "
        "tp_comm_buffer_name=None, tp_group=None")
_ATTENTION = ("config, layer_number, attn_mask_type, attention_type, attention_dropout=None, softmax_scale=None, "
              "k_channels=None, v_channels=None")


#: Spec modules that import TE's classes by name (None, or absent before 0.16, where TE does not import):
#: (target, stand-in, what the name holds before megatron-core 0.16).
_SPEC_MODULE_STAND_INS = (
    ("megatron.core.models.T5.t5_spec:TEColumnParallelLinear", TEColumnParallelLinear, ABSENT),
    ("megatron.core.models.T5.t5_spec:TEDotProductAttention", TEDotProductAttention, ABSENT),
    ("megatron.core.models.T5.t5_spec:TELayerNormColumnParallelLinear", TELayerNormColumnParallelLinear, ABSENT),
    ("megatron.core.models.T5.t5_spec:TENorm", TENorm, ABSENT),
    ("megatron.core.models.T5.t5_spec:TERowParallelLinear", TERowParallelLinear, ABSENT),
    ("megatron.core.models.bert.bert_layer_specs:TEDotProductAttention", TEDotProductAttention, _NONE),
    ("megatron.core.models.bert.bert_layer_specs:TELayerNormColumnParallelLinear", TELayerNormColumnParallelLinear, _NONE),
    ("megatron.core.models.bert.bert_layer_specs:TERowParallelLinear", TERowParallelLinear, _NONE),
    ("megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs:TEDotProductAttention", TEDotProductAttention, ABSENT),
    ("megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs:TELayerNormColumnParallelLinear", TELayerNormColumnParallelLinear, ABSENT),
    ("megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs:TENorm", TENorm, ABSENT),
    ("megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs:TERowParallelLinear", TERowParallelLinear, ABSENT),
    ("megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs:TELayerNormColumnParallelLinearGathered", TELayerNormColumnParallelLinearGathered, ABSENT),
)


def _spec_module_patches() -> list[Patch]:
    patches = []
    for target, stand_in, before_0_16 in _SPEC_MODULE_STAND_INS:
        module = target.split(":")[0].rsplit(".", 1)[1]
        name = f"TE fallback: {module} builds its TE spec on the stand-ins"
        patches += [replace(target, stand_in, expect=expect, megatron=versions, name=name)
                    for expect, versions in ((before_0_16, "<0.16"), (_NONE, ">=0.16"))]
    # the BERT TE spec refuses to build unless its copy of HAVE_TE is set; its classes are the stand-ins above
    patches.append(replace("megatron.core.models.bert.bert_layer_specs:HAVE_TE", True,
                           expect=describe_signature(False),
                           name="TE fallback: bert_layer_specs builds its TE spec on the stand-ins"))
    return patches


def wrap_clip_vit_init(original):
    """``CLIPViTModel``'s norms default to ``TENorm`` where TE imports and to ``torch.nn.LayerNorm`` elsewhere,
    which ``build_module`` cannot build (it passes ``config=``): there the ``TENorm`` stand-in takes its place."""

    @functools.wraps(original)
    def __init__(self, transformer_config, transformer_layer_spec, ln_pre_impl=TENorm, ln_post_impl=TENorm,
                 *args, **kwargs):
        ln_pre_impl = TENorm if ln_pre_impl is torch.nn.LayerNorm else ln_pre_impl
        ln_post_impl = TENorm if ln_post_impl is torch.nn.LayerNorm else ln_post_impl
        original(self, transformer_config, transformer_layer_spec, ln_pre_impl, ln_post_impl, *args, **kwargs)

    return __init__


def wrap_torch_norm_new(original):
    """``WrappedTorchNorm``, the local spec's norm (the only spec where TE is absent), with the modes of TE's norm
    that megatron-core refuses for it: sequence parallelism and zero-centred gamma build the norm the ``TENorm``
    stand-in builds (megatron-core's multi-token-prediction layer asks for it so under SP)."""

    @functools.wraps(original)
    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                normalization="LayerNorm"):
        norm = importlib.import_module(_MODULES).local_norm_for_te_modes(config, hidden_size, eps)
        if norm is not None:
            return norm
        return original(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)

    return __new__


def wrap_spec_provider_layer_norm(original):
    """The q/k norm is a ``TENorm`` like the others: megatron-core's ``TESpecProvider.layer_norm(for_qk=True)``
    picks apex's ``FusedLayerNorm`` below TE 1.9 (TE's norm then hurt convergence), and without TE the version
    reads 0, so every q/k norm became apex's, which has no RMSNorm and needs apex."""

    @functools.wraps(original)
    def layer_norm(self, rms_norm=False, for_qk=False, *args, **kwargs):
        return original(self, rms_norm, False, *args, **kwargs)

    return layer_norm


def _name(name: str) -> str:
    return f"TE fallback: replace {name} with megatron-core's local modules"


def patches() -> list[Patch]:
    gpt = "TE fallback: gpt_layer_specs' TE spec provider and TENorm"
    mla = "TE fallback: multi-latent attention recognises TELinear and TEColumnParallelLinear"
    absorbed_mla = "TE fallback: absorbed multi-latent attention recognises TELinear and TEColumnParallelLinear"
    grouped = "TE fallback: --moe-grouped-gemm experts on ascendspeed's grouped linears"
    return [
        replace("megatron.core.extensions.transformer_engine:TENorm", TENorm,
                expect="(config, hidden_size, eps=1e-05)",
                megatron="<0.17", name=_name("TENorm")),
        replace("megatron.core.extensions.transformer_engine:TENorm", TENorm,
                expect="(config, hidden_size, eps=1e-05, has_residual=False)",
                megatron=">=0.17", name=_name("TENorm")),
        replace("megatron.core.extensions.transformer_engine:TELinear", TELinear,
                expect=f"({_LINEAR})",
                megatron="<0.18", name=_name("TELinear")),
        replace("megatron.core.extensions.transformer_engine:TELinear", TELinear,
                expect=f"({_LINEAR}, name=None)",
                megatron=">=0.18,<0.19", name=_name("TELinear")),
        replace("megatron.core.extensions.transformer_engine:TELinear", TELinear,
                expect=f"({_LINEAR}, name=None, gtp_remat_group=None)",
                megatron=">=0.19", name=_name("TELinear")),
        replace("megatron.core.extensions.transformer_engine:TELayerNormColumnParallelLinear",
                TELayerNormColumnParallelLinear,
                expect=f"({_COLUMN})",
                megatron="<0.16", name=_name("TELayerNormColumnParallelLinear")),
        replace("megatron.core.extensions.transformer_engine:TELayerNormColumnParallelLinear",
                TELayerNormColumnParallelLinear,
                expect=f"({_COLUMN}, stride=1)",
                megatron=">=0.16,<0.18", name=_name("TELayerNormColumnParallelLinear")),
        replace("megatron.core.extensions.transformer_engine:TELayerNormColumnParallelLinear",
                TELayerNormColumnParallelLinear,
                expect=f"({_COLUMN}, stride=1, name=None)",
                megatron=">=0.18", name=_name("TELayerNormColumnParallelLinear")),
        replace("megatron.core.extensions.transformer_engine:TEColumnParallelLinear", TEColumnParallelLinear,
                expect=f"({_COLUMN})",
                megatron="<0.16", name=_name("TEColumnParallelLinear")),
        replace("megatron.core.extensions.transformer_engine:TEColumnParallelLinear", TEColumnParallelLinear,
                expect=f"({_COLUMN}, stride=1)",
                megatron=">=0.16,<0.18", name=_name("TEColumnParallelLinear")),
        replace("megatron.core.extensions.transformer_engine:TEColumnParallelLinear", TEColumnParallelLinear,
                expect=f"({_COLUMN}, stride=1, name=None)",
                megatron=">=0.18", name=_name("TEColumnParallelLinear")),
        replace("megatron.core.extensions.transformer_engine:TERowParallelLinear", TERowParallelLinear,
                expect=f"({_ROW})",
                megatron="<0.18", name=_name("TERowParallelLinear")),
        replace("megatron.core.extensions.transformer_engine:TERowParallelLinear", TERowParallelLinear,
                expect=f"({_ROW}, name=None)",
                megatron=">=0.18", name=_name("TERowParallelLinear")),
        replace("megatron.core.extensions.transformer_engine:TEDotProductAttention", TEDotProductAttention,
                expect=f"({_ATTENTION}, cp_comm_type='p2p', pg_collection=None)",
                megatron="<0.16", name=_name("TEDotProductAttention")),
        replace("megatron.core.extensions.transformer_engine:TEDotProductAttention", TEDotProductAttention,
                expect=f"({_ATTENTION}, num_splits=None, cp_comm_type='p2p', pg_collection=None)",
                megatron=">=0.16", name=_name("TEDotProductAttention")),
        # TE's grouped linears are None where TE is absent (megatron-core defines them only for TE >= 1.9); the
        # spec provider, which picks TEGroupedMLP when they are not None, imports them from here afterwards.
        replace("megatron.core.extensions.transformer_engine:TEColumnParallelGroupedLinear",
                TEColumnParallelGroupedLinear, expect=_NONE, name=grouped),
        replace("megatron.core.extensions.transformer_engine:TERowParallelGroupedLinear",
                TERowParallelGroupedLinear, expect=_NONE, name=grouped),
        # gpt_layer_specs binds TESpecProvider and TENorm only where TE imports: before 0.17 the names are
        # missing, from 0.17 they are None.
        replace("megatron.core.models.gpt.gpt_layer_specs:TESpecProvider", TESpecProvider,
                expect=ABSENT, megatron="<0.17", name=gpt),
        replace("megatron.core.models.gpt.gpt_layer_specs:TENorm", TENorm, expect=ABSENT, megatron="<0.17", name=gpt),
        replace("megatron.core.models.gpt.gpt_layer_specs:TESpecProvider", TESpecProvider,
                expect=_NONE, megatron=">=0.17", name=gpt),
        replace("megatron.core.models.gpt.gpt_layer_specs:TENorm", TENorm, expect=_NONE, megatron=">=0.17", name=gpt),
        wrap("megatron.core.extensions.transformer_engine_spec_provider:TESpecProvider.layer_norm",
             wrap_spec_provider_layer_norm, expect="(self, rms_norm=False, for_qk=False)",
             megatron="<0.17", name="TE fallback: the TE spec provider's q/k norm is TENorm"),
        wrap("megatron.core.extensions.transformer_engine_spec_provider:TESpecProvider.layer_norm",
             wrap_spec_provider_layer_norm,
             expect="(self, rms_norm=False, for_qk=False, has_residual=False)",
             megatron=">=0.17", name="TE fallback: the TE spec provider's q/k norm is TENorm"),
        # moe_module_specs' get_moe_module_spec(use_te=True) (the hybrid specs' MoE layers) builds a
        # TESpecProvider, bound before 0.16 only where TE imports.
        replace("megatron.core.models.gpt.moe_module_specs:TESpecProvider", TESpecProvider, expect=ABSENT,
                megatron="<0.16", name="TE fallback: moe_module_specs' TE spec provider"),
        wrap("megatron.core.models.vision.clip_vit_model:CLIPViTModel.__init__", wrap_clip_vit_init,
             expect="(self, transformer_config, transformer_layer_spec, "
                    "ln_pre_impl=<class 'torch.nn.modules.normalization.LayerNorm'>, "
                    "ln_post_impl=<class 'torch.nn.modules.normalization.LayerNorm'>, add_class_token=True, "
                    "class_token_len=1, patch_dim=14, img_h=336, img_w=336, model_subtype='clip', "
                    "pg_collection=None, vp_stage=None)",
             name="TE fallback: CLIPViTModel's TE-less default norms are the TENorm stand-in"),
        # multi_latent_attention picks the down projections' parallel mode by comparing the spec's class with
        # its TELinear / TEColumnParallelLinear names: None from 0.17 where TE is absent (copies of the mocks,
        # swept, before).
        replace("megatron.core.transformer.multi_latent_attention:TELinear", TELinear, expect=_NONE,
                megatron=">=0.17", name=mla),
        replace("megatron.core.transformer.multi_latent_attention:TEColumnParallelLinear", TEColumnParallelLinear,
                expect=_NONE, megatron=">=0.17", name=mla),
        # the absorbed MLA of DeepSeek sparse attention (hybrid pattern "D") does the same in its own module
        replace("megatron.core.transformer.experimental_attention_variant.absorbed_mla:TELinear", TELinear,
                expect=_NONE, megatron=">=0.19", name=absorbed_mla),
        replace("megatron.core.transformer.experimental_attention_variant.absorbed_mla:TEColumnParallelLinear",
                TEColumnParallelLinear, expect=_NONE, megatron=">=0.19", name=absorbed_mla),
        wrap("megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__", wrap_torch_norm_new,
             expect="(cls, config, hidden_size, eps=1e-05, persist_layer_norm=False, zero_centered_gamma=False, "
                    "normalization='LayerNorm')",
             name="TE fallback: the local spec's norm with sequence parallelism and zero-centred gamma, as TENorm"),
        *_spec_module_patches(),
    ]
