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
