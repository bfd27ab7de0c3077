"""Bytes autograd saves for backward, shared by the benchmarks' memory columns."""
from __future__ import annotations


def saved_bytes(function) -> int:
    """Bytes of the distinct storages autograd saves while ``function()`` runs, each storage counted once."""
    import torch

    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return sum(storages.values())
