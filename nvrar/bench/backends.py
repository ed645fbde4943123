"""The all-reduce implementations the benchmark measures side by side.

Each backend allocates its own buffers, runs one blocking all-reduce per call, and reports why it
cannot run (``skip_reason``) instead of failing: a peer that is not installed is skipped, never an
error. CPU peers: MPI_Allreduce (mpi4py), torch.distributed gloo and DeepSpeed's shm
inference_all_reduce (optional: pip install deepspeed). GPU peers: torch.distributed
NCCL and NVSHMEM's own reduction (nvshmem4py)."""

from __future__ import annotations

import os
import socket
import sys
from typing import Any, List, Optional

import numpy as np

from .. import _arrays
from ..bootstrap import mpi_launched

__all__ = ["Backend", "NvrarBackend", "MPIBackend", "GlooBackend", "DeepSpeedBackend", "deepspeed_kernel_level",
           "release_deepspeed_segment", "NCCLBackend", "NvshmemBackend", "DTYPES"]

# name -> (numpy dtype or None, torch dtype name, element size)
DTYPES = {
    "float32": (np.float32, "float32", 4),
    "float16": (np.float16, "float16", 2),
    "bfloat16": (None, "bfloat16", 2),
    "int32": (np.int32, "int32", 4),
}


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, DTYPES[name][1])


class Backend:
    """One measured implementation. ``algorithm`` names the algorithm ("auto", "ring", ...)."""

    name = "base"
    algorithm = "default"
    buffers = "ordinary"
    skip_reason: Optional[str] = None

    def supports(self, dtype: str, op: str) -> Optional[str]:
        """None if (dtype, op) can run, else the reason it cannot."""
        return None

    def alloc(self, count: int, dtype: str) -> Any:
        raise NotImplementedError

    def fill(self, buf: Any, values: np.ndarray) -> None:
        raise NotImplementedError

    def read(self, buf: Any) -> np.ndarray:
        raise NotImplementedError

    def call(self, buf: Any, op: str) -> None:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait until every call issued so far has completed (GPU backends)."""

    def close(self) -> None:
        """Release what the backend still holds; every rank calls it, in the same order, before the
        communicators close (a release may be collective)."""

    @property
    def label(self) -> str:
        return f"{self.name}/{self.algorithm}"


class _HostArrays(Backend):
    """numpy arrays where the dtype allows, torch CPU tensors for bfloat16."""

    def alloc(self, count: int, dtype: str) -> Any:
        npd = DTYPES[dtype][0]
        if npd is not None:
            return np.zeros(count, dtype=npd)
        import torch

        return torch.zeros(count, dtype=torch_dtype(dtype))

    def fill(self, buf: Any, values: np.ndarray) -> None:
        if isinstance(buf, np.ndarray):
            buf[...] = values.astype(buf.dtype)
        else:
            import torch

            buf.copy_(torch.from_numpy(values.astype(np.float32)).to(buf.dtype))

    def read(self, buf: Any) -> np.ndarray:
        if isinstance(buf, np.ndarray):
            return buf.astype(np.float64)
        return buf.float().cpu().numpy().astype(np.float64)


class NvrarBackend(_HostArrays):
    name = "nvrar"

    def __init__(self, comm: Any, algorithm: str, symmetric: bool) -> None:
        self.comm = comm
        self.algorithm = algorithm
        self.symmetric = symmetric  # buffers from comm.empty(): zero-copy input and output
        self.buffers = "symmetric" if symmetric else "ordinary"
        self._algorithm = None if algorithm == "auto" else algorithm
        self.device = comm.device

    @property
    def label(self) -> str:
        return f"{self.name}/{self.algorithm}" + ("/sym" if self.symmetric else "")

    def alloc(self, count: int, dtype: str) -> Any:
        if self.device == "cuda":
            import torch

            if self.symmetric:
                buf = self.comm.empty(count, torch_dtype(dtype))
                buf.zero_()
                return buf
            return torch.zeros(count, dtype=torch_dtype(dtype), device=f"cuda:{torch.cuda.current_device()}")
        if not self.symmetric:
            return super().alloc(count, dtype)
        npd = DTYPES[dtype][0]
        buf = self.comm.empty(count, npd if npd is not None else torch_dtype(dtype))
        buf[...] = 0
        return buf

    def fill(self, buf: Any, values: np.ndarray) -> None:
        if self.device == "cuda":
            import torch

            buf.copy_(torch.from_numpy(values.astype(np.float32)).to(buf.dtype))
        else:
            super().fill(buf, values)

    def call(self, buf: Any, op: str) -> None:
        self.comm.all_reduce(buf, op, algorithm=self._algorithm)

    def synchronize(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            self.comm.check()


class MPIBackend(_HostArrays):
    """MPI_Allreduce through mpi4py, in place. ``name``: "mpi" (the MPI library of the launcher,
    pip's Open MPI from a bare start), or "mpich" / "impi" in a job of a bare start that runs
    the ranks under that library's mpiexec (nvrar.bench.mpilibs); such a job checks that mpi4py
    loaded that library."""

    name = "mpi"
    algorithm = "MPI_Allreduce"
    version = ""  # short: the first line of MPI_Get_library_version() up to its first comma
    library_version = ""  # MPI_Get_library_version(), whole

    def __init__(self, name: str = "mpi") -> None:
        self.name = name
        self._mpi: Any = None  # the mpi4py.MPI module once it imports
        if not mpi_launched():
            self.skip_reason = "not launched by mpirun/srun (the bare launcher uses mpirun when it is installed)"
            return
        try:
            from mpi4py import MPI
        except ImportError:
            self.skip_reason = "mpi4py is not installed (pip install mpi4py)"
            return
        self._mpi = MPI
        self._comm = MPI.COMM_WORLD
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
        self.library_version = MPI.Get_library_version().replace("\x00", "").strip()  # Open MPI ends it with a NUL
        self.version = " ".join(self.library_version.splitlines()[0].split(",")[0].split())
        from .mpilibs import PEERS

        peer = PEERS.get(name)
        if peer is not None and (peer.marker not in self.library_version
                                 or any(f in self.library_version for f in peer.foreign)):
            self.skip_reason = (f"mpi4py loaded {self.version!r}, not {peer.title} (MPI4PY_LIBMPI="
                                f"{os.environ.get('MPI4PY_LIBMPI', '')})")

    def supports(self, dtype: str, op: str) -> Optional[str]:
        if op not in self._ops:
            return f"MPI has no {op} reduction"
        if DTYPES[dtype][0] in (None, np.float16):
            return f"MPI has no standard {dtype} type"
        return None

    def call(self, buf: Any, op: str) -> None:
        self._comm.Allreduce(self._mpi.IN_PLACE, buf, op=self._ops[op])


class _TorchDist(Backend):
    """A torch.distributed process group (gloo on CPU, NCCL on GPU)."""

    device = "cpu"

    def __init__(self, group: Any, skip: Optional[str]) -> None:
        self.group = group
        self.skip_reason = skip
        if skip is None:
            import torch.distributed as dist

            self._dist = dist
            self._ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
                         "avg": dist.ReduceOp.AVG}

    def alloc(self, count: int, dtype: str) -> Any:
        import torch

        return torch.zeros(count, dtype=torch_dtype(dtype), device=self.device)

    def fill(self, buf: Any, values: np.ndarray) -> None:
        import torch

        buf.copy_(torch.from_numpy(values.astype(np.float32)).to(buf.dtype))

    def read(self, buf: Any) -> np.ndarray:
        return buf.float().cpu().numpy().astype(np.float64)

    def call(self, buf: Any, op: str) -> None:
        self._dist.all_reduce(buf, self._ops[op], group=self.group)


class GlooBackend(_TorchDist):
    name = "gloo"
    algorithm = "torch.distributed"

    def supports(self, dtype: str, op: str) -> Optional[str]:
        if op == "avg":
            return "gloo has no avg reduction"
        return None


class DeepSpeedBackend(_TorchDist):
    """DeepSpeed's shared-memory all-reduce for CPU inference (deepspeed.comm.inference_all_reduce,
    its JIT-built deepspeed_shm_comm op), on the torch.distributed group the benchmark set up.
    Skipped, with the reason, where DeepSpeed is not installed or its shm op cannot run here."""

    name = "deepspeed"
    algorithm = "shm"

    def __init__(self, skip: Optional[str]) -> None:
        super().__init__(None, skip)
        if skip is not None:
            return
        self.skip_reason = self._setup()

    def _setup(self) -> Optional[str]:
        import torch
        import torch.distributed as dist

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            import deepspeed
            import deepspeed.comm as dc
        except Exception as exc:  # ImportError, or an accelerator that fails to load
            return f"DeepSpeed is not installed or does not import (pip install deepspeed): {type(exc).__name__}: {exc}"
        # Its shm op is used only where every rank is local (LOCAL_SIZE == world size), and the
        # ranks name their segments after MASTER_ADDR/MASTER_PORT: the same on every rank.
        world, rank = dist.get_world_size(), dist.get_rank()
        hosts: List[Any] = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())
        if len(set(hosts)) > 1:  # its setup would wait, forever and holding the GIL, for the others' segments
            return (f"DeepSpeed's shm all-reduce needs every rank on one host; these ranks run on {len(set(hosts))} "
                    "hosts")
        token = [f"{os.getpid()}" if rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        os.environ.update(LOCAL_SIZE=str(world), LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(token[0]))
        try:
            deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        except Exception as exc:
            return f"deepspeed.init_distributed failed: {type(exc).__name__}: {exc}"
        if not (hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_")):
            return "DeepSpeed's shm op (deepspeed_shm_comm) did not build or load here; it would fall back to gloo"
        self._dc = dc
        self._level = deepspeed_kernel_level()
        release_deepspeed_segment(dc, rank, dist.barrier)
        return None

    def supports(self, dtype: str, op: str) -> Optional[str]:
        if op != "sum":
            return "DeepSpeed's shm all-reduce sums only"
        if dtype == "int32":
            return "DeepSpeed's shm all-reduce has no int32 kernel"
        if dtype != "float32" and self._level < 2:
            return f"DeepSpeed's shm {dtype} kernel needs avx512bw (it would fall back to gloo)"
        if self._level < 1:
            return "DeepSpeed's shm kernels need avx2 (it would fall back to gloo)"
        return None

    def call(self, buf: Any, op: str) -> None:
        self._dc.inference_all_reduce(buf, self._dc.ReduceOp.SUM)


def deepspeed_kernel_level() -> int:
    """The vector level of DeepSpeed's shm kernels once deepspeed.init_distributed ran (0: none
    can run here, 1: float32 (avx2), 2: also 16-bit types (avx512bw))."""
    import deepspeed.comm.comm as dcomm  # its backend object (cdb) lives there once initialized

    return int(getattr(getattr(dcomm, "cdb", None), "shm_vector_kernel_level", 0) or 0)


def release_deepspeed_segment(dc: Any, rank: int, barrier: Any) -> None:
    """DeepSpeed never removes its shm segments (69 MB per rank in /dev/shm, every run). Once
    every rank has made a call (its op maps every rank's segment before its first), the names
    can go and the mappings stay: nothing is left behind, however the run ends. No call where
    the kernels cannot run here (without avx2 they fault; the rows are skipped then);
    ``barrier``: the ranks' barrier. After deepspeed.init_distributed, with MASTER_ADDR and
    MASTER_PORT as DeepSpeed read them."""
    import torch

    if deepspeed_kernel_level() >= 1:
        dc.inference_all_reduce(torch.zeros(16, dtype=torch.float32), dc.ReduceOp.SUM)
    barrier()
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}_{rank}"
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except OSError:
        pass  # no such segment (another DeepSpeed's naming): nothing of this run's to remove


class NCCLBackend(_TorchDist):
    name = "nccl"
    algorithm = "torch.distributed"
    device = "cuda"

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()


class NvshmemBackend(Backend):
    """NVSHMEM's own all-reduce on the world team, on symmetric buffers, in the NVSHMEM instance
    that nvrar's GPU communicator initialized (or joined): through nvshmem4py
    (nvshmem.core.reduce on the stream, on nvshmem.core.tensor buffers) where it is installed and
    initialized, else through nvrar's own binding of nvshmemx_<type>_<op>_reduce_on_stream."""

    name = "nvshmem"
    algorithm = "reduce_on_stream"

    def __init__(self, device: str, comm: Any = None, shared_gpu: bool = False) -> None:
        self.comm = comm
        self._core: Any = None
        self._held: list = []
        if device != "cuda":
            self.skip_reason = "needs a GPU"
            return
        from .._gpu import load, nvshmem4py, nvshmem4py_initialized

        mod, err = load()
        if mod is None:
            self.skip_reason = err
            return
        self._mod = mod
        status = mod.nvshmem_init_status()
        if status == 3:  # NVSHMEM_STATUS_LIMITED_MPG
            self.skip_reason = ("several ranks share a GPU without MPS: NVSHMEM forbids its collectives there "
                                "(start nvidia-cuda-mps-control -d to compare against them)")
            return
        core, _ = nvshmem4py()
        if core is not None and nvshmem4py_initialized(core):
            self._core = core
            self.algorithm = "nvshmem4py.reduce"

    def alloc(self, count: int, dtype: str) -> Any:
        if self._core is not None:
            # nvshmem4py's collectives take its own tensors only; the previous size's pair is freed
            # first (collective, in the same order on every rank), the last one by close().
            self.close()
            self._held = [self._core.tensor((count,), dtype=torch_dtype(dtype)) for _ in range(2)]
            src, dst = self._held
        else:
            src = self.comm.empty(count, torch_dtype(dtype))
            dst = self.comm.empty(count, torch_dtype(dtype))
        src.zero_()
        dst.zero_()
        return (src, dst)

    def close(self) -> None:
        """Free the nvshmem4py tensors held (collective): left to NVSHMEM's finalize, every rank
        printed "Some NVSHMEM Symmetric memory was not freed explicitly" at the end of a run."""
        if self._core is not None:
            for t in self._held:
                self._core.free_tensor(t)
        self._held = []

    def fill(self, buf: Any, values: np.ndarray) -> None:
        import torch

        buf[0].copy_(torch.from_numpy(values.astype(np.float32)).to(buf[0].dtype))

    def read(self, buf: Any) -> np.ndarray:
        return buf[1].float().cpu().numpy().astype(np.float64)

    def call(self, buf: Any, op: str) -> None:
        import torch

        src, dst = buf
        if self._core is not None:
            stream = self._core.NvshmemStream(torch.cuda.current_stream())
            self._core.reduce(self._core.Teams.TEAM_WORLD, dst, src, op, stream=stream)
            return
        self._mod.nvshmem_reduce(dst.data_ptr(), src.data_ptr(), src.numel(), _arrays.torch_dtype_code(src.dtype),
                                 _arrays.op_code(op), torch.cuda.current_stream().cuda_stream)

    def supports(self, dtype: str, op: str) -> Optional[str]:
        return "NVSHMEM reductions have no avg" if op == "avg" else None

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()


def available_cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def gpu_model() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(torch.cuda.current_device())
    except Exception:
        return "unknown GPU"


def visible_gpus() -> int:
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch  # noqa: F401
        except ImportError:
            return 0
        torch = sys.modules["torch"]
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
