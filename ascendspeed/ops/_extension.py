"""Loading of the C++ operator library ``ascendspeed._C``."""
import functools
import importlib

import torch

_BUILD_HINT = (
    "the C++ extension ascendspeed._C is not built. From the repository root run "
    "`pip install --no-build-isolation -e .` (or `python setup.py build_ext --inplace`), "
    "with torch==2.13.0 already installed"
)


@functools.lru_cache(maxsize=None)
def load_extension():
    """Import ``ascendspeed._C`` once; its import registers the ``torch.ops.ascendspeed`` operators."""
    try:
        importlib.import_module("ascendspeed._C")
    except ImportError as exc:
        raise RuntimeError(f"ascendspeed: {_BUILD_HINT} ({exc})") from exc
    return torch.ops.ascendspeed


def composite_kernel_devices() -> tuple[str, ...]:
    """Devices whose kernels of an operator are its torch-op composition (no C++ kernel of ours there): CUDA
    always; the NPU only where torch_npu imports (it names the device "npu")."""
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return ("cuda",)
    return ("cuda", "npu")
