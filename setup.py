"""Build ascendspeed and its C++ operator library ``ascendspeed._C``.

Every ``*.cpp`` under ``ascendspeed/csrc/`` is compiled into one torch extension, so a new kernel is
just a new source file. Build with ``pip install --no-build-isolation -e .`` (build isolation would
download a different torch than the pinned one).

The library uses libtorch and CPython's stable ABI only (``py_limited_api``): one ``_C.abi3.so`` serves
every Python with the same torch. ``ASCENDSPEED_BUILD_C=0`` installs the package without building it, for
an environment that reuses the library already built in the tree (scripts/bootstrap.sh checks that it was
built from these sources for this torch).
"""
import glob
import os

from setuptools import find_packages, setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as exc:  # pragma: no cover - exercised only on a machine without torch
    raise SystemExit(
        "ascendspeed builds against an installed torch: run `pip install torch==2.13.0` first, "
        "then `pip install --no-build-isolation -e .`"
    ) from exc

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = sorted(
    os.path.relpath(path, HERE)
    for path in glob.glob(os.path.join(HERE, "ascendspeed", "csrc", "**", "*.cpp"), recursive=True)
)

setup(
    name="ascendspeed",
    version="0.1.0",
    description="Accelerator plugin for Megatron-LM: ALiBi, fused SwiGLU, overlapped DDP gradient reduction",
    packages=find_packages(include=["ascendspeed", "ascendspeed.*"]),
    package_data={"ascendspeed": ["training/data/*.txt.gz", "training/data/README.md"]},
    python_requires=">=3.10",
    install_requires=["torch==2.13.0", "megatron-core>=0.15,<0.20", "numpy"],
    extras_require={
        "test": ["pytest"],
        "bench": ["matplotlib"],
        "npu": ["torch_npu"],
    },
    ext_modules=[] if os.environ.get("ASCENDSPEED_BUILD_C") == "0" else [
        CppExtension(
            name="ascendspeed._C",
            sources=SOURCES,
            # at::parallel_for is inlined into the extension: without -fopenmp it runs single-threaded.
            # Operators are included one by one (ATen/ops/<name>.h): ATen/ATen.h, which the define refuses,
            # parses every operator's declaration in each file. No debug information (Python's CFLAGS ask for
            # -g): it doubles the compile time of torch's templates; ASCENDSPEED_DEBUG_INFO=1 keeps it.
            extra_compile_args=["-O3", "-std=c++17", "-fopenmp", "-DTORCH_ASSERT_ONLY_METHOD_OPERATORS",
                                *([] if os.environ.get("ASCENDSPEED_DEBUG_INFO") == "1" else ["-g0"])],
            extra_link_args=["-fopenmp"],
            py_limited_api=True,
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
