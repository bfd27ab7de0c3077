"""The Megatron-LM flags features read but do not own, declared once with Megatron-LM's choices and types.

Under Megatron-LM its own parser defines them. ``enable_features`` (megatron-core users) and
``python -m ascendspeed.megatron_adaptor --list`` have no such parser: they declare the flags from here
(each feature's ``megatron_arguments`` gives the default), then let features extend them as they extend
Megatron-LM's parser (``--position-embedding-type alibi``), so a value is checked against the same
choices and type wherever it comes from.
"""
from __future__ import annotations

import argparse
from typing import Any, Mapping

#: Megatron-LM's own choices of ``--position-embedding-type``; features add theirs with ``add_choices``
#: (alibi: "alibi").
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn", "mrope", "relative", "none")

#: Megatron-LM's choices, before features add theirs.
CHOICES: Mapping[str, tuple[str, ...]] = {
    "position_embedding_type": POSITION_EMBEDDING_TYPES,
    "normalization": ("LayerNorm", "RMSNorm"),
    "attention_backend": ("flash", "fused", "unfused", "local", "auto"),
}

#: Megatron-LM's ``--attention-backend`` values that ask for a fused attention kernel (``auto``, its default,
#: lets the implementation choose); ``unfused`` and ``local`` ask for the materialised scores.
FUSED_ATTENTION_BACKENDS = ("auto", "flash", "fused")


def attention_backend_name(backend) -> str:
    """The name of an ``AttnBackend`` (Megatron-LM's parsed flag) or of its string form (the entry's)."""
    return getattr(backend, "name", str(backend))


#: The types of flags whose default is None (the others take the type of their default); None or absent:
#: not checked.
TYPES_OF_NONE_DEFAULTS: Mapping[str, Any] = {
    "ddp_bucket_size": int,
    "rotary_seq_len_interpolation_factor": int,
    "activation_func_clamp_value": float,
    "data_parallel_size": int,
    "num_attention_heads": int,
    "seq_length": int,
    "attention_dropout": float,
    "fp8": str,
    "window_size": None,
    "num_experts": int,
}


def add_megatron_arguments(parser: argparse.ArgumentParser, defaults: Mapping[str, Any]) -> None:
    """Declare each ``dest -> default`` of ``defaults`` the parser does not define yet as Megatron-LM's flag."""
    defined = {action.dest for action in parser._actions}
    for dest, default in defaults.items():
        if dest in defined:
            continue
        defined.add(dest)
        flag = "--" + dest.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, dest=dest, action="store_false" if default else "store_true")
        elif isinstance(default, list):
            parser.add_argument(flag, dest=dest, nargs="+", type=type(default[0]), default=default)
        else:
            kind = type(default) if default is not None else TYPES_OF_NONE_DEFAULTS.get(dest)
            parser.add_argument(flag, dest=dest, type=kind, default=default, choices=CHOICES.get(dest))
