"""Megatron's dataset helpers without ``make`` (``ascendspeed/integration/dataset_helpers.py``).

Runs with the installed megatron-core wheel alone: the wheel ships ``helpers_cpp`` and ``helpers.cpp``
but no Makefile, the case Megatron-LM's own ``compile_helpers`` fails on.
"""
import os
import shutil
import stat
import sys
import sysconfig
import textwrap

import pytest

import ascendspeed.megatron_adaptor  # noqa: F401
from ascendspeed.integration import dataset_helpers
from ascendspeed.patching import MANAGER

EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")


@pytest.fixture
def checkout(tmp_path):
    """A directory laid out like a source checkout's megatron/core/datasets: source and Makefile."""
    shutil.copy(os.path.join(dataset_helpers.datasets_directory(), "helpers.cpp"), tmp_path)
    (tmp_path / "Makefile").write_text("default:\n\tfalse\n")
    return tmp_path


@pytest.fixture
def fake_compiler(tmp_path, monkeypatch):
    """A CXX that records its arguments and writes the ``-o`` file, so the logic is tested in milliseconds."""
    log = tmp_path / "compiler.log"
    script = tmp_path / "fake-cxx"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        open({str(log)!r}, "a").write(" ".join(sys.argv[1:]) + "\\n")
        open(sys.argv[sys.argv.index("-o") + 1], "w").write("library")
    """))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(script))
    return log


def test_megatron_compile_helpers_is_replaced_and_needs_no_make(monkeypatch):
    """The wheel's helpers are there: nothing is built, nothing is run (Megatron's would run make and exit)."""
    import megatron.core.datasets.utils as utils

    assert utils.compile_helpers is dataset_helpers.compile_helpers
    assert MANAGER.original("megatron.core.datasets.utils:compile_helpers") is not dataset_helpers.compile_helpers
    monkeypatch.setattr("subprocess.run", lambda *a, **k: pytest.fail(f"ran {a}"))
    utils.compile_helpers()
    from megatron.core.datasets import helpers  # noqa: F401 - the import Megatron's datasets do


def test_wheel_layout_counts_presence_only(tmp_path):
    (tmp_path / "helpers.cpp").write_text("// newer than the library")
    library = tmp_path / f"helpers_cpp{EXT_SUFFIX}"
    library.write_text("")
    os.utime(library, (1, 1))
    assert dataset_helpers.is_up_to_date(str(tmp_path))


def test_checkout_builds_when_missing_then_not_again(checkout, fake_compiler):
    built = dataset_helpers.ensure_built(str(checkout))
    assert built == str(checkout / f"helpers_cpp{EXT_SUFFIX}") and os.path.isfile(built)
    arguments = fake_compiler.read_text()
    assert "-O3 -Wall -shared -std=c++17 -fPIC" in arguments
    assert os.path.isfile(os.path.join(dataset_helpers._pybind11_include(), "pybind11", "pybind11.h"))
    assert not [name for name in os.listdir(checkout) if name.startswith(".helpers_cpp")], "temporary left"
    assert dataset_helpers.ensure_built(str(checkout)) is None
    assert len(fake_compiler.read_text().splitlines()) == 1


def test_checkout_rebuilds_a_stale_library(checkout, fake_compiler):
    library = checkout / f"helpers_cpp{EXT_SUFFIX}"
    library.write_text("old")
    os.utime(library, (1, 1))
    assert dataset_helpers.ensure_built(str(checkout)) == str(library)
    assert library.read_text() == "library"


def test_compiler_failure_is_a_clear_error(checkout, monkeypatch):
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(dataset_helpers.DatasetHelpersError, match="compiling Megatron's dataset helpers failed"):
        dataset_helpers.ensure_built(str(checkout))
    assert [name for name in os.listdir(checkout) if "helpers_cpp" in name] == []


def test_missing_compiler_and_missing_source_are_clear_errors(checkout, tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(dataset_helpers.DatasetHelpersError, match="needs a C\\+\\+ compiler"):
        dataset_helpers.ensure_built(str(checkout))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(dataset_helpers.DatasetHelpersError, match="pip install --force-reinstall megatron-core"):
        dataset_helpers.ensure_built(str(empty))


def test_without_pybind11_torch_headers_are_used(monkeypatch):
    monkeypatch.setitem(sys.modules, "pybind11", None)
    assert os.path.isfile(os.path.join(dataset_helpers._pybind11_include(), "pybind11", "pybind11.h"))


def test_missing_pybind11_is_a_clear_error(checkout, fake_compiler, monkeypatch):
    monkeypatch.setitem(sys.modules, "pybind11", None)
    monkeypatch.setattr(dataset_helpers, "_torch_pybind11_include", lambda: None)
    with pytest.raises(dataset_helpers.DatasetHelpersError, match="pip install pybind11"):
        dataset_helpers.ensure_built(str(checkout))


@pytest.mark.skipif(shutil.which("c++") is None and not os.environ.get("CXX"), reason="no C++ compiler")
def test_real_build_imports_and_works(checkout):
    """The library built from the wheel's helpers.cpp loads in this interpreter and computes (about 10 s)."""
    import importlib.util

    import numpy

    path = dataset_helpers.ensure_built(str(checkout))
    spec = importlib.util.spec_from_file_location("helpers_cpp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # two datasets, weights 0.5/0.5, four samples: alternating, as Megatron's blend expects
    index = numpy.zeros(4, dtype=numpy.int16)
    sample = numpy.zeros(4, dtype=numpy.int64)
    module.build_blending_indices(index, sample, numpy.array([0.5, 0.5]), 2, 4, False)
    assert index.tolist() == [0, 1, 0, 1] and sample.tolist() == [0, 0, 1, 1]
