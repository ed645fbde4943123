"""Build of the native modules.

* nvrar._C: the CPU executor and the plan (C++17), always built.
* nvrar._cuda: the GPU executor (CUDA kernels over NVSHMEM), built when nvcc and NVSHMEM are
  present (the build backend in _build_backend/ puts the NVSHMEM wheel into the build
  environment when it finds nvcc). NVRAR_CUDA=0 skips it; NVRAR_CUDA=1 makes its absence an error.
  NVRAR_CUDA_ARCHS (default "80;90") lists the compute capabilities to compile for.

The CUDA sources are compiled with nvcc as relocatable device code, device-linked against
libnvshmem_device.a, and linked by the host compiler into a module whose only exported symbol is
its init function (no other library can pick up our NVSHMEM device state).
"""

import glob
import importlib.util
import os
import shlex
import subprocess
import sys
import time

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
from pybind11.setup_helpers import build_ext as pybind_build_ext
from setuptools import setup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_build_backend"))
from nvrar_build import find_nvcc  # noqa: E402 - the build backend's own detection

ParallelCompile("NVRAR_BUILD_JOBS", default=0).install()

HOST_FLAGS = [
    "-O3",
    "-ffp-contract=off",  # no fused multiply-add: the same bits on every ISA and every rank
    "-fno-math-errno",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
]
# Headers, so that editing one rebuilds the objects that include it.
HEADERS = sorted(glob.glob("csrc/**/*.h", recursive=True) + glob.glob("csrc/**/*.cuh", recursive=True))
CUDA_ARCHS = [a for a in os.environ.get("NVRAR_CUDA_ARCHS", "80;90").split(";") if a]
BUILD_LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build", "nvrar-cuda-build.log")


def find_nvshmem():
    """Root of an NVSHMEM installation (include/, lib/), or None."""
    home = os.environ.get("NVSHMEM_HOME")
    if home:
        return home
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")  # a namespace package: no __init__.py
    except ModuleNotFoundError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def nvshmem_version(home):
    fields = {}
    with open(os.path.join(home, "include", "non_abi", "nvshmem_version.h")) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[0] == "#define" and parts[2].isdigit():
                fields[parts[1]] = int(parts[2])
    return tuple(fields[f"NVSHMEM_VENDOR_{k}_VERSION"] for k in ("MAJOR", "MINOR", "PATCH"))


class BuildExt(pybind_build_ext):
    """Compiles .cu sources with nvcc (-rdc), device-links them, and hands the objects to the
    host compiler's link."""

    def build_extension(self, ext):
        cu = [s for s in ext.sources if s.endswith(".cu")]
        if cu:
            ext.sources = [s for s in ext.sources if not s.endswith(".cu")]
            ext.extra_objects = self._nvcc(ext, cu) + list(ext.extra_objects or [])
        super().build_extension(ext)
        if cu:
            with open(BUILD_LOG, "a") as log:
                log.write(f"linked {self.get_ext_fullpath(ext.name)}\n")

    def _run(self, cmd):
        """Run one CUDA build step; the command and its time also go to build/nvrar-cuda-build.log
        (pip hides a build's output; CI prints this file)."""
        start = time.time()
        line = " ".join(shlex.quote(c) for c in cmd)
        print("nvrar build: " + line, flush=True)
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        print(result.stdout, end="", flush=True)
        with open(BUILD_LOG, "a") as log:
            log.write(f"$ {line}\n{result.stdout}[{time.time() - start:.1f} s, exit {result.returncode}]\n")
        if result.returncode != 0:
            raise subprocess.CalledProcessError(result.returncode, cmd)
        print(f"nvrar build: {time.time() - start:.1f} s", flush=True)

    def _nvcc(self, ext, sources):
        os.makedirs(os.path.dirname(BUILD_LOG), exist_ok=True)
        with open(BUILD_LOG, "w") as log:
            log.write(f"nvrar GPU executor build, {time.strftime('%Y-%m-%d %H:%M:%S')}, archs {CUDA_ARCHS}\n")
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in CUDA_ARCHS]
        tmp = os.path.join(self.build_temp, "cuda")
        os.makedirs(tmp, exist_ok=True)
        objs = []
        for src in sources:
            obj = os.path.join(tmp, os.path.basename(src) + ".o")
            deps = [src] + HEADERS
            if self.force or not os.path.exists(obj) or max(os.path.getmtime(d) for d in deps) > os.path.getmtime(obj):
                self._run([ext.nvcc, "-std=c++17", "-O3", "-rdc=true", "-t", "0", *gencode,
                           "-Xcompiler", "-fPIC,-fvisibility=hidden", "-Xptxas", "-O3",
                           f"-DNVRAR_CUDA_ARCHS=\"{';'.join(CUDA_ARCHS)}\"",
                           *[f"-I{d}" for d in ext.include_dirs], "-c", src, "-o", obj])
            objs.append(obj)
        dlink = os.path.join(tmp, "nvrar_cuda_dlink.o")
        self._run([ext.nvcc, "-dlink", *gencode, "-Xcompiler", "-fPIC", *objs, f"-L{ext.nvshmem_lib}",
                   "-lnvshmem_device", "-o", dlink])
        return objs + [dlink]


ext_modules = [
    Pybind11Extension(
        "nvrar._C",
        sources=["csrc/bindings.cpp", "csrc/bindings_common.cpp", "csrc/cpu/shm_heap.cpp", "csrc/cpu/executor.cpp",
                 "csrc/cpu/reduce_kernels.cpp", "csrc/cpu/fused.cpp"],
        include_dirs=["csrc"],
        cxx_std=17,
        extra_compile_args=HOST_FLAGS,
        libraries=["rt"],
        depends=HEADERS,
    )
]
install_requires = ["numpy>=1.22"]

want_cuda = os.environ.get("NVRAR_CUDA", "").strip()
nvcc = None if want_cuda == "0" else find_nvcc()
nvshmem = find_nvshmem() if nvcc else None
if nvcc and nvshmem:
    cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    major, minor, patch = nvshmem_version(nvshmem)
    # The device library linked in must not be newer than the host library loaded at run time.
    install_requires.append(f"nvidia-nvshmem-cu13>={major}.{minor}.{patch},<{major + 1}")
    cuda_ext = Pybind11Extension(
        "nvrar._cuda",
        sources=["csrc/cuda/bindings_cuda.cpp", "csrc/bindings_common.cpp", "csrc/cuda/runtime.cu",
                 "csrc/cuda/allreduce.cu"],
        include_dirs=["csrc", os.path.join(nvshmem, "include"), os.path.join(cuda_home, "include")],
        library_dirs=[os.path.join(nvshmem, "lib"), os.path.join(cuda_home, "lib64")],
        libraries=["nvshmem_device", ":libnvshmem_host.so.3", "cudart_static", "dl", "rt", "pthread"],
        extra_compile_args=HOST_FLAGS,
        extra_link_args=[
            "-Wl,-rpath,$ORIGIN/../nvidia/nvshmem/lib",  # the nvidia-nvshmem-cu13 wheel beside us
            "-Wl,--exclude-libs,libnvshmem_device.a",
            "-Wl,--exclude-libs,libcudart_static.a",
            "-Wl,--version-script=" + os.path.abspath("csrc/cuda/exports.map"),
        ],
        cxx_std=17,
        depends=HEADERS,
    )
    cuda_ext.nvcc = nvcc
    cuda_ext.nvshmem_lib = os.path.join(nvshmem, "lib")
    ext_modules.append(cuda_ext)
    print(f"nvrar build: GPU executor with nvcc {nvcc}, NVSHMEM {major}.{minor}.{patch} at {nvshmem}, "
          f"archs {CUDA_ARCHS}", flush=True)
elif want_cuda == "1":
    raise SystemExit(f"NVRAR_CUDA=1 but {'NVSHMEM' if nvcc else 'nvcc'} was not found")
elif nvcc:
    # Happens while setuptools asks setup.py for its build requirements, before the backend's
    # NVSHMEM requirement is installed; the real build sees NVSHMEM.
    print("nvrar build: nvcc found but NVSHMEM not (yet) available: CPU executor only", flush=True)

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildExt}, install_requires=install_requires)
