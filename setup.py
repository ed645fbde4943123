"""Build of the native module nvrar._C.

The CPU executor (C++17) is always built. The CUDA executor is added by the GPU build
(see docs and NVRAR_CUDA) when nvcc is present.
"""

import glob
import os

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ParallelCompile("NVRAR_BUILD_JOBS", default=0).install()

HOST_FLAGS = [
    "-O3",
    "-ffp-contract=off",  # no fused multiply-add: the same bits on every ISA and every rank
    "-fno-math-errno",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
]

cpu_sources = [
    "csrc/bindings.cpp",
    "csrc/cpu/shm_heap.cpp",
    "csrc/cpu/executor.cpp",
    "csrc/cpu/reduce_kernels.cpp",
    "csrc/cpu/cpu_only.cpp",
]

# Headers, so that editing one rebuilds the objects that include it.
HEADERS = sorted(glob.glob("csrc/**/*.h", recursive=True))

ext = Pybind11Extension(
    "nvrar._C",
    sources=cpu_sources,
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=HOST_FLAGS,
    libraries=["rt"],
    depends=HEADERS,
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
