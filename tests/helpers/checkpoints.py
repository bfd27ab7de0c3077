"""Reading a Megatron distributed checkpoint (``torch_dist``) in one process, for tests that look inside."""
from pathlib import Path


def stored_tensors(directory: Path) -> dict:
    """Every tensor the checkpoint in ``directory`` stores, by its global key, whole (all ranks' shards)."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        whole = Path(scratch) / "whole.pt"
        dcp_to_torch_save(str(directory), str(whole))
        state = torch.load(whole, weights_only=False)
    return {key: value for key, value in state.items() if torch.is_tensor(value)}
