"""The Communicator: a group of ranks that all-reduce together with the NVRAR protocol.

    comm = nvrar.Communicator()            # bootstraps from torch.distributed / MPI / env / single
    comm.all_reduce(x)                     # in place, numpy array or torch CPU tensor
    y = comm.empty((4096,), torch.bfloat16)  # lives in the symmetric heap: no stage-in copy
"""

from __future__ import annotations

import atexit
import bisect
import collections
import json
import logging
import os
import sys
import math
import socket
import threading
import weakref
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _arrays, env, selector
from . import bootstrap as _bootstrap
from .errors import NvrarError

__all__ = ["Communicator"]

# Per executor: the largest chunk of one round, and the zero-copy pool (bytes).
_DEFAULT_MAX_BYTES = {"cpu": 4 << 20, "cuda": 16 << 20}
# Settings that decide which bytes each round carries (chunking, variant, transport): every rank
# must use the same values, checked once at construction (key -> name in the error).
_AGREED = {"requested": "ranks_per_node", "max_bytes": "max_bytes", "heap_bytes": "heap_bytes", "algo": "algo",
           "ll_max": "NVRAR_LL_MAX_BYTES", "oneshot_max": "NVRAR_ONESHOT_MAX_BYTES"}
_DEFAULT_HEAP_BYTES = {"cpu": 32 << 20, "cuda": 64 << 20}
_log = logging.getLogger("nvrar")
_POOL_ALIGN = 256  # bytes; every empty() block starts on this boundary

_live: "weakref.WeakSet[Communicator]" = weakref.WeakSet()
# Executors a forked child dropped: kept referenced so that the child never runs their release
# (the segments and device memory are the parent's).
_left_to_parent: List[Any] = []
_SECRET_BYTES = 16  # the session secret rank 0 draws at setup (csrc/cpu/executor.h kSecretBytes)


@atexit.register
def _close_all() -> None:
    # At exit, GPU communicators skip the collective release (nvshmem_free): a peer that already
    # died would leave this process waiting in it; process teardown frees the memory anyway.
    for comm in list(_live):
        comm.close(_collective=comm._device == "cpu")


class _Block:
    """One empty() allocation: its array interface feeds numpy, its lifetime frees the bytes."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class _CudaBlock:
    """empty() on the GPU: a device allocation exposed through __cuda_array_interface__."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None}


_MAX_TIMEOUT_S = 1e6  # ~11.6 days: any longer deadline is a mistake, and overflows nanosecond clocks


def _check_timeout(value: float, what: str) -> float:
    if not value > 0 or math.isinf(value) or math.isnan(value) or value > _MAX_TIMEOUT_S:
        raise ValueError(f"{what} must be a positive number of seconds up to {_MAX_TIMEOUT_S:g}, got {value}")
    return value


def _cuda_device(rank: int, G: int, count: int) -> int:
    """This rank's CUDA device: torch's current device when torch has set one up, else the
    launcher's local rank (LOCAL_RANK, SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK), else rank mod G."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    for name in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"):
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value) % count
    return (rank % G) % count


class _PoolAllocator:
    """First-fit allocator over the zero-copy pool (offsets in bytes).

    Blocks come back through weakref finalizers, which can run inside any allocation (a garbage
    collection) -- also inside alloc() itself, with the lock held. So a finalizer never takes the
    lock: it queues the block (deque.append is atomic) and the next alloc() or drain() returns it.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: List[Tuple[int, int]] = [(0, size)]  # sorted (offset, length)
        self._lock = threading.Lock()
        self._returned: "collections.deque[Tuple[int, int]]" = collections.deque()
        self._allocated = 0  # blocks handed out, ever
        self._released = 0   # blocks returned, ever (under the lock)

    @staticmethod
    def _rounded(nbytes: int) -> int:
        return max(_POOL_ALIGN, (nbytes + _POOL_ALIGN - 1) // _POOL_ALIGN * _POOL_ALIGN)

    def _drain_locked(self) -> None:
        while self._returned:
            off, need = self._returned.popleft()
            bisect.insort(self._free, (off, need))
            self._released += 1
        merged: List[Tuple[int, int]] = []
        for o, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        self._free = merged

    def alloc(self, nbytes: int) -> Optional[int]:
        need = self._rounded(nbytes)
        with self._lock:
            self._drain_locked()
            for i, (off, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = (off + need, length - need)
                    self._allocated += 1
                    return off
        return None

    def release(self, off: int, nbytes: int) -> None:
        """From a finalizer: lock-free."""
        self._returned.append((off, self._rounded(nbytes)))

    def live(self) -> int:
        """Blocks still out (drains what came back, if the lock is free now)."""
        if self._lock.acquire(blocking=False):
            try:
                self._drain_locked()
            finally:
                self._lock.release()
        return self._allocated - self._released - len(self._returned)

    def largest_free(self) -> int:
        with self._lock:
            self._drain_locked()
            return max((n for _, n in self._free), default=0)


def _resolve_dtype(dtype: Any) -> Tuple[str, Any, int, int]:
    """(kind, library dtype, code, itemsize) for empty()."""
    torch_mod = None
    try:
        import sys

        torch_mod = sys.modules.get("torch")
        if torch_mod is None and isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
            import torch as torch_mod  # noqa: F811 - bfloat16 needs torch
    except ImportError:
        torch_mod = None
    if torch_mod is not None:
        if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
            dtype = torch_mod.bfloat16
        if isinstance(dtype, torch_mod.dtype):
            code = _arrays.torch_dtype_code(dtype)
            if code is None:
                raise TypeError(f"empty: dtype {dtype} is not supported; supported: {_arrays.SUPPORTED}")
            return "torch", dtype, code, _arrays.ELEMENT_SIZE[code]
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        raise TypeError("empty: bfloat16 needs torch (pip install torch); numpy has no bfloat16")
    try:
        npd = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"empty: {dtype!r} is not a dtype; supported: {_arrays.SUPPORTED}") from None
    code = _arrays.numpy_dtype_code(npd)
    if code is None:
        raise TypeError(f"empty: dtype {npd} is not supported; supported: {_arrays.SUPPORTED}")
    return "numpy", npd, code, npd.itemsize


class Communicator:
    """A communicator over which every rank calls the same collectives in the same order.

    Args:
        group: a torch.distributed process group, an mpi4py communicator, or an
            ``nvrar.bootstrap.Bootstrap`` (e.g. ``SingleBootstrap()``). Default: the default
            torch.distributed group when initialized, else MPI.COMM_WORLD under mpirun/srun, else
            torchrun-style environment variables, else a single rank.
        ranks_per_node: ranks per node (G). Default: the launcher's local size, or the number of
            ranks on this host. A smaller value emulates several nodes on one host, so that the
            inter-node recursive doubling runs for real.
        max_bytes: largest chunk one protocol round reduces (bytes; ``NVRAR_MAX_BYTES``, 4 MiB).
            Larger messages are reduced in chunks. Must be equal on every rank.
        timeout: deadline in seconds of every wait (``NVRAR_TIMEOUT_S``, 60).
        heap_bytes: size of the zero-copy pool behind :meth:`empty` (``NVRAR_HEAP_BYTES``, 32 MiB).
        algo: "auto" (default, ``NVRAR_ALGO``), "one-shot" or "two-shot" for every call.
        device: "cpu" (default: the shared-memory executor, ranks on one host) or "cuda" (the GPU
            executor over NVSHMEM: torch CUDA tensors and cupy arrays, any number of nodes).

    Collective: every rank of the group must construct it, with the same settings.
    """

    def __init__(
        self,
        group: Any = None,
        *,
        ranks_per_node: Optional[int] = None,
        max_bytes: Optional[int] = None,
        timeout: Optional[float] = None,
        heap_bytes: Optional[int] = None,
        algo: Optional[str] = None,
        device: str = "cpu",
    ) -> None:
        self._ex: Any = None
        self._closed = False
        self._pid = os.getpid()  # a forked child must not use this communicator (_forked)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self._device = device
        # Arguments are checked here, before any communication: a bad argument is the caller's
        # own, on every rank alike. Settings from the environment may differ between ranks, so a
        # bad one is not raised here but exchanged below: then every rank raises, naming it.
        if timeout is not None:
            timeout = _check_timeout(float(timeout), "timeout")
        if max_bytes is not None and int(max_bytes) < 256:
            raise ValueError(f"max_bytes must be at least 256, got {max_bytes}")
        if heap_bytes is not None and int(heap_bytes) < 0:
            raise ValueError(f"heap_bytes must be >= 0, got {heap_bytes}")
        if ranks_per_node is not None and (not isinstance(ranks_per_node, int) or ranks_per_node < 1):
            raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
        if algo is not None:
            selector.variant_code(algo)
        try:
            settings = self._settings(device, max_bytes, heap_bytes, timeout, ranks_per_node, algo)
            env_error = ""
        except ValueError as exc:
            settings, env_error = None, str(exc)
        boot_timeout = settings["timeout"] if settings else (timeout or 60.0)
        boot = _bootstrap.create(group, boot_timeout)
        try:
            self._rank, self._world = boot.rank, boot.world_size
            mine = {
                "host": socket.gethostname(),
                "launcher": boot.launcher_local_size,
                "error": env_error,
                "settings": {k: settings[k] for k in _AGREED} if settings else None,
                # The session secret every rank's segment carries and every attaching rank checks.
                "secret": os.urandom(_SECRET_BYTES).hex() if boot.rank == 0 else "",
            }
            infos = boot.allgather_json(mine, "settings")
            bad = [(r, i["error"]) for r, i in enumerate(infos) if i["error"]]
            if bad:
                raise ValueError("Communicator: bad settings on " + "; ".join(f"rank {r}: {e}" for r, e in bad))
            G = self._agree(infos, single_host=device == "cpu")
            self._G = G
            self._variant = selector.variant_code(settings["algo"])
            self._timeout = settings["timeout"]
            if device == "cpu":
                self._setup_cpu(boot, G, settings, bytes.fromhex(infos[0]["secret"]))
            else:
                self._setup_gpu(boot, G, settings)
        except BaseException:
            if self._ex is not None:
                if device == "cpu":
                    self._ex.unlink_segment()
                self._ex.close()
                self._ex = None
            self._closed = True
            raise
        finally:
            if boot is not group:  # a Bootstrap the caller passed in stays the caller's
                boot.close()
        self._bootstrap_kind = boot.kind
        self._pool = _PoolAllocator(self._ex.pool_bytes)
        self._pool_base = self._ex.pool_address
        self._all_reduce = self._ex.all_reduce  # bound once: the per-call path stays short
        _live.add(self)

    @staticmethod
    def _settings(device: str, max_bytes: Optional[int], heap_bytes: Optional[int], timeout: Optional[float],
                  ranks_per_node: Optional[int], algo: Optional[str]) -> dict:
        """Every setting, arguments first, then NVRAR_* variables, then defaults (ValueError if bad)."""
        if timeout is None:
            timeout = env.get_float("NVRAR_TIMEOUT_S")
            timeout = 60.0 if timeout is None else _check_timeout(timeout, "NVRAR_TIMEOUT_S")
        if max_bytes is None:
            max_bytes = env.get_bytes("NVRAR_MAX_BYTES")
            max_bytes = _DEFAULT_MAX_BYTES[device] if max_bytes is None else max_bytes
            if max_bytes < 256:
                raise ValueError(f"NVRAR_MAX_BYTES must be at least 256, got {max_bytes}")
        if heap_bytes is None:
            heap_bytes = env.get_bytes("NVRAR_HEAP_BYTES")
            heap_bytes = _DEFAULT_HEAP_BYTES[device] if heap_bytes is None else heap_bytes
        requested = ranks_per_node if ranks_per_node is not None else env.get_int("NVRAR_RANKS_PER_NODE")
        if requested is not None and requested < 1:
            raise ValueError(f"NVRAR_RANKS_PER_NODE must be >= 1, got {requested}")
        algo = algo if algo is not None else (env.get_str("NVRAR_ALGO") or "auto")
        selector.variant_code(algo)
        out = {"timeout": timeout, "max_bytes": int(max_bytes), "heap_bytes": int(heap_bytes),
               "requested": requested, "algo": algo}
        if device == "cpu":
            out["jitter_us"] = env.get_float("NVRAR_JITTER_US") or 0.0
            out["jitter_seed"] = env.get_int("NVRAR_JITTER_SEED") or 0
            cma = env.get_int("NVRAR_CMA")
            out["cma"] = cma is None or cma != 0
            out["cma_min"] = selector.cma_min_bytes("cpu", 1)
            out["ll_max"] = selector.ll_max_bytes("cpu")
        else:
            out["ll_max"] = selector.ll_max_bytes("cuda")
        out["oneshot_max"] = env.get_bytes("NVRAR_ONESHOT_MAX_BYTES")  # the override (None: by layout)
        return out

    def _setup_cpu(self, boot: Any, G: int, st: dict, secret: bytes) -> None:
        from . import _C

        if len(secret) != _SECRET_BYTES:
            raise NvrarError(f"Communicator: rank 0 sent a session secret of {len(secret)} bytes, "
                             f"expected {_SECRET_BYTES}")
        oneshot = selector.oneshot_max_bytes("cpu", self._world, G)
        # Creating the segment can fail on one rank alone (/dev/shm full): the verdicts travel
        # with the names, so that every rank raises at construction and none waits for another.
        created = {"segment": "", "error": ""}
        try:
            self._ex = _C.CpuExecutor(rank=self._rank, world=self._world, ranks_per_node=G,
                                      max_bytes=st["max_bytes"], pool_bytes=st["heap_bytes"],
                                      oneshot_max_bytes=oneshot, timeout_s=st["timeout"], jitter_us=st["jitter_us"],
                                      jitter_seed=st["jitter_seed"], cma=st["cma"], cma_min_bytes=st["cma_min"],
                                      cma_piece_bytes=selector.cma_piece_bytes("cpu", G),
                                      ll_max_bytes=st["ll_max"], secret=secret)
            created["segment"] = self._ex.segment_name
        except NvrarError as exc:
            created["error"] = str(exc)
        everyone = boot.allgather_json(created, "segment")
        failed = [(r, s["error"]) for r, s in enumerate(everyone) if s["error"]]
        if failed:
            raise NvrarError("Communicator setup failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed))
        names = [s["segment"] for s in everyone]
        status = {"error": "", "cma": False}
        try:
            self._ex.attach(names)
            status["cma"] = bool(self._ex.probe_cma())
        except NvrarError as exc:
            status["error"] = str(exc)
        statuses = boot.allgather_json(status, "attach status")
        self._ex.unlink_segment()  # every rank has mapped every segment (or failed trying)
        failed = [(r, s["error"]) for r, s in enumerate(statuses) if s["error"]]
        if failed:
            raise NvrarError("Communicator setup failed on " + "; ".join(f"rank {r}: {s}" for r, s in failed))
        # Cross-memory access only if every rank can reach every other (all decide alike).
        self._ex.enable_cma(all(s["cma"] for s in statuses))

    def _setup_gpu(self, boot: Any, G: int, st: dict) -> None:
        from . import _gpu

        # Everything that can fail locally is checked, and the verdicts exchanged, before the
        # collective NVSHMEM setup: a rank must not leave the others waiting in it.
        mod, err = _gpu.load()
        launch = selector.gpu_launch("cuda", G)
        oneshot, ll = selector.oneshot_max_bytes("cuda", self._world, G), st["ll_max"]
        status = {"error": f"device='cuda': {err}" if mod is None else "", "device": -1}
        if mod is not None:
            n, why = mod.device_count()
            if n == 0:
                status["error"] = f"device='cuda' needs a CUDA device: {why}"
            else:
                status["device"] = _cuda_device(self._rank, G, n)
        statuses = boot.allgather_json(status, "device status")
        failed = [(r, s["error"]) for r, s in enumerate(statuses) if s["error"]]
        if failed:
            raise NvrarError("Communicator setup failed on " + "; ".join(f"rank {r}: {s}" for r, s in failed))
        uid = boot.allgather(mod.unique_id() if self._rank == 0 else b"")[0]
        self._cuda_device = status["device"]
        self._ex = mod.GpuExecutor(rank=self._rank, world=self._world, ranks_per_node=G, device=status["device"],
                                   max_bytes=st["max_bytes"], pool_bytes=st["heap_bytes"], oneshot_max_bytes=oneshot,
                                   ll_max_bytes=ll, timeout_s=st["timeout"], max_blocks=launch["max_blocks"],
                                   threads=launch["threads"], block_bytes=launch["block_bytes"], uid=uid)
        for line in mod.env_set_by_nvrar():
            _log.info("nvrar: set %s (not set by the user)", line)

    def _agree(self, infos: Sequence[dict], single_host: bool = True) -> int:
        """Ranks per node, identical on every rank (every rank evaluates the same list)."""
        W = len(infos)
        for key, name in _AGREED.items():
            values = {json.dumps(i["settings"][key]) for i in infos}
            if len(values) > 1:
                per_rank = ", ".join(f"rank {r}: {i['settings'][key]}" for r, i in enumerate(infos))
                raise ValueError(f"Communicator: ranks disagree on {name} ({per_rank}); pass the same value everywhere")
        hosts = [i["host"] for i in infos]
        if single_host and len(set(hosts)) > 1:
            raise NvrarError(
                "Communicator: the CPU executor needs every rank on one host (shared memory), but ranks run on "
                f"{sorted(set(hosts))}; multi-node runs need device='cuda'"
            )
        G = infos[0]["settings"]["requested"]
        if G is None:
            launcher = {i["launcher"] for i in infos}
            G = launcher.pop() if len(launcher) == 1 and None not in launcher else hosts.count(hosts[0])
            if G is None or W % G != 0:
                G = W
        if G > W or W % G != 0:
            raise ValueError(f"ranks_per_node={G} must divide the world size {W}")
        # Node-major numbering: the ranks of one (real) node must form whole emulated nodes.
        for start in range(0, W, G):
            if len(set(hosts[start:start + G])) > 1:
                raise NvrarError(f"Communicator: ranks {start}..{start + G - 1} form one node but run on hosts "
                                 f"{sorted(set(hosts[start:start + G]))}; number ranks node by node (rank = node * "
                                 f"ranks_per_node + local rank)")
        return int(G)

    # -- properties ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def ranks_per_node(self) -> int:
        return self._G

    @property
    def num_nodes(self) -> int:
        return self._world // self._G

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def max_bytes(self) -> int:
        return int(self._ex.max_bytes) if self._ex is not None else 0

    @property
    def backend(self) -> str:
        """Executor in use: "cpu" or "cuda"."""
        return self._device

    @property
    def device(self) -> str:
        return self._device

    @property
    def bootstrap(self) -> str:
        """How the ranks found each other: "torch", "mpi", "env" or "single"."""
        return self._bootstrap_kind

    @property
    def closed(self) -> bool:
        return self._closed

    def algorithm_for(self, nbytes: int, algo: Optional[str] = None) -> str:
        """The variant a call on ``nbytes`` bytes runs ("one-shot" or "two-shot")."""
        self._check_open("algorithm_for")
        code = self._ex.resolve(self._variant if algo is None else selector.variant_code(algo), int(nbytes))
        return {v: k for k, v in selector.VARIANTS.items()}[code]

    # -- the collective ------------------------------------------------------------------------
    def all_reduce(self, x: Any, op: Any = "sum", out: Any = None, *, algo: Optional[str] = None,
                   stream: Any = None) -> Any:
        """Reduce ``x`` over all ranks with ``op``; returns the result (``x``, or ``out``).

        Args:
            x: CPU communicator: a C-contiguous numpy array or torch CPU tensor; device="cuda": a
                contiguous torch CUDA tensor or cupy array on this rank's device. float32,
                float16, bfloat16 (torch) or int32. Reduced in place when ``out`` is None.
            op: "sum", "max", "min", "avg" or a torch.distributed.ReduceOp. avg divides the sum by
                the world size (int32: truncating).
            out: optional output of the same shape, dtype and kind as ``x``.
            algo: override the variant of this call ("one-shot", "two-shot", "auto").
            stream: device="cuda" only: the stream to enqueue on (torch.cuda.Stream, cupy Stream
                or a cudaStream_t as an int); default the current stream of ``x``'s library.

        Every rank must call with the same count, dtype, op and algo; a mismatch raises
        NvrarError on the ranks involved. Results are bitwise identical on every rank. On the GPU
        the call is asynchronous: a failure of the kernel (timeout, mismatch) raises at the next
        call or in :meth:`check`.
        """
        if self._pid != os.getpid():
            raise self._forked("all_reduce")
        ex = self._ex
        if ex is None:
            raise NvrarError("all_reduce: the communicator is closed")
        if self._device == "cuda":
            return self._all_reduce_cuda(x, op, out, algo, stream)
        if stream is not None:
            raise ValueError("all_reduce: stream= applies to device='cuda' communicators")
        if isinstance(x, np.ndarray):
            ptr, count, code = _arrays.numpy_info(x, "x")
            if out is None:
                if not x.flags.writeable:
                    raise ValueError("all_reduce: x is read-only and no out= was given; pass a writeable array or out=")
                optr = ptr
            else:
                optr = self._check_out_numpy(x, out, ptr, count)
        else:
            tensor = _arrays.torch_tensor_type()
            if tensor is None or not isinstance(x, tensor):
                raise TypeError(f"all_reduce: x must be a numpy.ndarray or a torch.Tensor, got {type(x).__name__}")
            ptr, count, code = _arrays.torch_info(x, "x", write=out is None)
            optr = ptr if out is None else self._check_out_torch(x, out, ptr, count)
        try:
            opc = _FAST_OPS[op]
        except (KeyError, TypeError):
            opc = _arrays.op_code(op)
        variant = self._variant if algo is None else selector.variant_code(algo)
        self._all_reduce(ptr, optr, count, code, opc, variant)
        return x if out is None else out

    def _all_reduce_cuda(self, x: Any, op: Any, out: Any, algo: Optional[str], stream: Any) -> Any:
        tensor = _arrays.torch_tensor_type()
        if tensor is not None and isinstance(x, tensor):
            ptr, count, code = _arrays.torch_info(x, "x", device="cuda", index=self._cuda_device)
            optr = ptr if out is None else self._check_out_torch(x, out, ptr, count)
            if stream is None:
                import torch

                stream = torch.cuda.current_stream(x.device)
        elif _arrays.is_cupy(x):
            ptr, count, code = _arrays.cupy_info(x, "x", self._cuda_device)
            if out is None:
                optr = ptr
            else:
                if not _arrays.is_cupy(out) or out.shape != x.shape or out.dtype != x.dtype:
                    raise TypeError("all_reduce: out must be a cupy array of x's shape and dtype")
                optr, _, _ = _arrays.cupy_info(out, "out", self._cuda_device)
                self._overlap_check(ptr, optr, count * x.itemsize)
            if stream is None:
                import cupy

                stream = cupy.cuda.get_current_stream()
        else:
            raise TypeError(f"all_reduce: a device='cuda' communicator takes torch CUDA tensors or cupy arrays, "
                            f"got {type(x).__name__}")
        try:
            opc = _FAST_OPS[op]
        except (KeyError, TypeError):
            opc = _arrays.op_code(op)
        variant = self._variant if algo is None else selector.variant_code(algo)
        self._all_reduce(ptr, optr, count, code, opc, variant, _arrays.stream_handle(stream))
        return x if out is None else out

    def check(self, stream: Any = None) -> None:
        """GPU: synchronize ``stream`` (default: the current torch stream, if torch is loaded)
        and raise the failure a kernel recorded, if any. CPU: raise if the communicator failed."""
        self._check_open("check")
        if self._device == "cpu":
            if self._ex.failed:
                raise NvrarError(self._ex.failure)
            return
        if stream is None and "torch" in sys.modules:
            import torch

            stream = torch.cuda.current_stream(self._cuda_device)
        self._ex.check(_arrays.stream_handle(stream) if stream is not None else 0)

    @staticmethod
    def _overlap_check(ptr: int, optr: int, nbytes: int) -> None:
        if optr != ptr and optr < ptr + nbytes and ptr < optr + nbytes:
            raise ValueError("all_reduce: out partially overlaps x; use out=None for in place, or a separate buffer")

    def _check_out_numpy(self, x: np.ndarray, out: Any, ptr: int, count: int) -> int:
        if not isinstance(out, np.ndarray):
            raise TypeError(f"all_reduce: out must be a numpy.ndarray like x, got {type(out).__name__}")
        if out.shape != x.shape:
            raise ValueError(f"all_reduce: out has shape {out.shape} but x has shape {x.shape}")
        if out.dtype != x.dtype:
            raise TypeError(f"all_reduce: out has dtype {out.dtype} but x has dtype {x.dtype}")
        if not out.flags.writeable:
            raise ValueError("all_reduce: out is read-only")
        optr, _, _ = _arrays.numpy_info(out, "out")
        self._overlap_check(ptr, optr, count * x.itemsize)
        return optr

    def _check_out_torch(self, x: Any, out: Any, ptr: int, count: int) -> int:
        tensor = _arrays.torch_tensor_type()
        if not isinstance(out, tensor):
            raise TypeError(f"all_reduce: out must be a torch.Tensor like x, got {type(out).__name__}")
        if out.shape != x.shape:
            raise ValueError(f"all_reduce: out has shape {tuple(out.shape)} but x has shape {tuple(x.shape)}")
        if out.dtype != x.dtype:
            raise TypeError(f"all_reduce: out has dtype {out.dtype} but x has dtype {x.dtype}")
        if self._device == "cuda":
            optr, _, _ = _arrays.torch_info(out, "out", device="cuda", index=self._cuda_device)
        else:
            optr, _, _ = _arrays.torch_info(out, "out", write=True)
        self._overlap_check(ptr, optr, count * x.element_size())
        return optr

    # -- symmetric memory ----------------------------------------------------------------------
    def empty(self, shape: Union[int, Sequence[int]], dtype: Any = np.float32) -> Any:
        """An uninitialized array (numpy dtype) or tensor (torch dtype) in the symmetric heap.

        all_reduce reads such an input where it is, without the stage-in copy. The memory returns
        to the pool when the last reference to the array (and its views) is gone. Not collective:
        but ranks that want zero-copy on both sides simply allocate alike.
        """
        self._check_open("empty")
        shape_t = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape_t):
            raise ValueError(f"empty: negative dimension in shape {shape_t}")
        kind, dt, _, itemsize = _resolve_dtype(dtype)
        nbytes = math.prod(shape_t) * itemsize  # exact: a product that overflows int64 is just too large
        off = self._pool.alloc(nbytes)
        if off is None:
            raise NvrarError(
                f"empty: shape {shape_t} of {dt} needs {nbytes} bytes, and the symmetric heap has no free block of "
                f"that size (pool {self._pool.size} bytes, "
                f"largest free {self._pool.largest_free()}); pass heap_bytes= or set NVRAR_HEAP_BYTES"
            )
        ex = self._ex
        if self._device == "cuda":
            block = _CudaBlock(self._pool_base + off, nbytes)
            weakref.finalize(block, self._release_block, self._pool, off, nbytes, ex)
            if kind == "numpy":  # a numpy dtype on a GPU communicator: a cupy array
                import cupy

                with cupy.cuda.Device(self._cuda_device):
                    return cupy.asarray(block).view(dt).reshape(shape_t)
            import torch

            raw = torch.as_tensor(block, device=f"cuda:{self._cuda_device}")
            return raw.view(dt).reshape(shape_t)
        block = _Block(self._pool_base + off, nbytes)
        weakref.finalize(block, self._release_block, self._pool, off, nbytes, ex)
        raw = np.asarray(block)
        if kind == "numpy":
            return raw.view(dt).reshape(shape_t)
        import torch

        return torch.from_numpy(raw).view(dt).reshape(shape_t)

    def _release_block(self, pool: _PoolAllocator, off: int, nbytes: int, ex: Any) -> None:
        pool.release(off, nbytes)
        if self._pid != os.getpid():
            return  # a forked child's copy of the pool: the memory stays the parent's
        if self._closed and self._device == "cpu" and pool.live() == 0 and ex is not None:
            ex.close()  # close() deferred the unmapping until the last block died

    # -- lifetime ------------------------------------------------------------------------------
    def _check_open(self, what: str = "this call") -> None:
        if self._pid != os.getpid():
            raise self._forked(what)
        if self._ex is None:
            raise NvrarError("the communicator is closed")

    def _forked(self, what: str) -> NvrarError:
        return NvrarError(f"nvrar: {what}: this Communicator was created by process {self._pid}; a forked child "
                          f"(pid {os.getpid()}) cannot use it: create a new Communicator in the child")

    def close(self, *, _collective: bool = True) -> None:
        """Release this rank's resources. Idempotent; also run at interpreter exit.

        CPU: memory from :meth:`empty` stays valid until its arrays are gone. GPU: collective
        (every rank must call it; it frees the symmetric memory, empty() buffers included).
        """
        if self._closed:
            return
        self._closed = True
        ex, self._ex = self._ex, None
        _live.discard(self)
        if ex is None:
            return
        if self._pid != os.getpid():
            # A forked child: the segments, peers and device memory are the parent's. Drop the
            # communicator here without releasing anything (nor letting a destructor do it).
            _left_to_parent.append(ex)
            return
        if self._device == "cuda":
            if _collective:
                ex.close()
            else:
                ex.abandon()
        elif getattr(self, "_pool", None) is None or self._pool.live() == 0:
            ex.close()
        else:
            ex.mark_closed()  # peers see it at once; the memory goes with the last empty() block

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("open" if self._device == "cuda" else f"epoch {self._ex.epoch}")
        return (f"Communicator(rank={getattr(self, '_rank', '?')}, world_size={getattr(self, '_world', '?')}, "
                f"ranks_per_node={getattr(self, '_G', '?')}, backend={self._device}, {state})")


_FAST_OPS = {"sum": _arrays.OP_SUM, "max": _arrays.OP_MAX, "min": _arrays.OP_MIN, "avg": _arrays.OP_AVG}
