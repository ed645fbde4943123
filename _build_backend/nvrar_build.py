"""In-tree PEP 517 build backend: setuptools' own, plus the NVSHMEM wheel in the isolated build
environment when a CUDA toolkit is present (so that `pip install .` on a machine with nvcc builds
the GPU executor, and one without nvcc never downloads NVSHMEM).

NVRAR_CUDA=0 builds the CPU executor alone; NVSHMEM_HOME points at an NVSHMEM installation to use
instead of the wheel.

UCX's headers come from the libucx-cu12 wheel, put into the build environment too (only its
headers are used: nvrar._C opens libucp at run time, csrc/cpu/ucx.h). NVRAR_UCX=0 leaves it out
(the module then raises for communicators across hosts); UCX_HOME points at a UCX installation.
"""

import os
import shutil

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403 - every other hook is setuptools'

# Build against the oldest host library users are likely to run with: torch 2.14 pins 3.4.5, and
# a module built against a newer NVSHMEM fails to load with an older host library (the reverse
# works).
NVSHMEM_BUILD_REQUIREMENT = "nvidia-nvshmem-cu13==3.4.5"


def find_nvcc():
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.isfile(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    return shutil.which("nvcc")


def _cuda_requirements():
    if os.environ.get("NVRAR_CUDA", "").strip() == "0" or not find_nvcc() or os.environ.get("NVSHMEM_HOME"):
        return []
    return [NVSHMEM_BUILD_REQUIREMENT]


UCX_BUILD_REQUIREMENT = "libucx-cu12>=1.15"


def _ucx_requirements():
    if os.environ.get("NVRAR_UCX", "").strip() == "0" or os.environ.get("UCX_HOME"):
        return []
    return [UCX_BUILD_REQUIREMENT]


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _cuda_requirements() + _ucx_requirements()


def get_requires_for_build_editable(config_settings=None):
    return (_setuptools.get_requires_for_build_editable(config_settings) + _cuda_requirements()
            + _ucx_requirements())
