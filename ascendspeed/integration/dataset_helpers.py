"""Megatron's C++ dataset helpers (``megatron.core.datasets.helpers_cpp``) without ``make``.

Megatron-LM's ``initialize_megatron`` calls ``megatron.core.datasets.utils.compile_helpers`` on rank 0,
which runs ``make`` in the directory of ``megatron/core/datasets``. That fails twice over:

* the megatron-core *wheel* ships the compiled helpers but no Makefile, so ``make`` errors out and
  Megatron exits (``sys.exit(1)``) although nothing needs building;
* in a source checkout the Makefile names the library after ``python3-config`` and finds pybind11 through
  ``python3``, which need not be the interpreter running Megatron: the library then builds under a name
  this Python never imports.

``compile_helpers`` below replaces Megatron's (patch of feature ``megatron_lm``): it does nothing when a
helpers library this interpreter imports is already there and not older than ``helpers.cpp`` (the
staleness ``make`` checks, for checkouts, where ``helpers.cpp`` changes with the tree); otherwise it
compiles ``helpers.cpp`` itself with the Makefile's flags, this interpreter's extension suffix and
include paths, and pybind11's headers, into the same directory (where ``helpers.py`` imports it from).
Every failure is a ``DatasetHelpersError`` saying what is missing and how to fix it.
"""
from __future__ import annotations

import importlib.machinery
import logging
import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from typing import Optional

logger = logging.getLogger(__name__)

LIBRARY = "helpers_cpp"
SOURCE = "helpers.cpp"
#: The flags of megatron/core/datasets/Makefile (core_v0.16.1).
CXXFLAGS = ("-O3", "-Wall", "-shared", "-std=c++17", "-fPIC")


class DatasetHelpersError(RuntimeError):
    """Megatron's dataset helpers are missing and cannot be built; the message says how to fix it."""


def datasets_directory() -> str:
    """The directory of the ``megatron.core.datasets`` in use (a checkout's or the wheel's)."""
    import megatron.core.datasets as datasets

    return os.path.dirname(os.path.abspath(datasets.__file__))


def built_library(directory: str) -> Optional[str]:
    """The helpers library in ``directory`` that this interpreter would import, if any.

    Looks for the file names the import system tries (``helpers_cpp`` + an extension suffix of this
    interpreter), in its order, without importing: a library loaded now could not be replaced later.
    """
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(directory, LIBRARY + suffix)
        if os.path.isfile(path):
            return path
    return None


def is_up_to_date(directory: str) -> bool:
    """A library is there and, in a source checkout (a Makefile is present), is not older than the source.

    An installed wheel's files get arbitrary install-time modification times, and its library is built
    from the very source next to it, so there only the presence counts.
    """
    library = built_library(directory)
    if library is None:
        return False
    source = os.path.join(directory, SOURCE)
    if not os.path.isfile(os.path.join(directory, "Makefile")) or not os.path.isfile(source):
        return True
    return os.path.getmtime(library) >= os.path.getmtime(source)


def _compiler() -> list[str]:
    command = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    return shlex.split(command)


def _torch_pybind11_include():
    """torch ships pybind11's headers under its include directory; None when it does not."""
    try:
        import torch
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(torch.__file__), "include")
    return path if os.path.isfile(os.path.join(path, "pybind11", "pybind11.h")) else None


def _pybind11_include() -> str:
    try:
        import pybind11
    except ImportError:
        path = _torch_pybind11_include()
        if path is None:
            raise DatasetHelpersError(
                "building Megatron's dataset helpers (megatron/core/datasets/helpers.cpp) needs pybind11's "
                "headers: pip install pybind11"
            ) from None
        return path
    return pybind11.get_include()


def _include_directories() -> list[str]:
    paths = [_pybind11_include()]
    for key in ("include", "platinclude"):
        path = sysconfig.get_paths().get(key)
        if path and path not in paths:
            paths.append(path)
    return paths


def build(directory: str) -> str:
    """Compile ``directory/helpers.cpp`` into the library this interpreter imports; return its path.

    Written to a temporary file and renamed, so no process ever sees a half-written library.
    """
    source = os.path.join(directory, SOURCE)
    if not os.path.isfile(source):
        raise DatasetHelpersError(
            f"Megatron's dataset helpers are not built and their source {source} is missing: "
            f"reinstall megatron-core (pip install --force-reinstall megatron-core==0.16.1)"
        )
    if not os.access(directory, os.W_OK):
        raise DatasetHelpersError(
            f"Megatron's dataset helpers are not built and {directory} is not writable: build them once as "
            f"its owner (python -c 'import ascendspeed.integration.dataset_helpers as h; h.compile_helpers()')"
        )
    compiler = _compiler()
    if shutil.which(compiler[0]) is None:
        raise DatasetHelpersError(
            f"building Megatron's dataset helpers needs a C++ compiler; {compiler[0]!r} is not on PATH "
            f"(install g++, or name one with CXX=...)"
        )
    target = os.path.join(directory, LIBRARY + sysconfig.get_config_var("EXT_SUFFIX"))
    descriptor, partial = tempfile.mkstemp(prefix=f".{LIBRARY}-", suffix=".so", dir=directory)
    os.close(descriptor)
    includes = [f"-I{path}" for path in _include_directories()]
    command = [*compiler, *CXXFLAGS, *includes, source, "-o", partial]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise DatasetHelpersError(
                f"compiling Megatron's dataset helpers failed (exit {done.returncode}):\n"
                f"{shlex.join(command)}\n{(done.stdout + done.stderr)[-4000:]}"
            )
        os.chmod(partial, 0o755)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return target


def ensure_built(directory: Optional[str] = None) -> Optional[str]:
    """Build the helpers in ``directory`` (default: the megatron-core in use) unless up to date.

    Returns the path of the library built, or None when nothing needed building.
    """
    directory = directory or datasets_directory()
    if is_up_to_date(directory):
        logger.debug("Megatron's dataset helpers are up to date: %s", built_library(directory))
        return None
    path = build(directory)
    logger.info("built Megatron's dataset helpers: %s", path)
    return path


def compile_helpers() -> None:
    """Megatron's ``compile_helpers`` (run on rank 0 only), without ``make``."""
    ensure_built()


def patches():
    from ascendspeed.patching import replace

    return [replace("megatron.core.datasets.utils:compile_helpers", compile_helpers, expect="()",
                    name="megatron-lm: build the dataset helpers without make, only when missing or stale")]
