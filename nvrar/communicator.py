"""The Communicator: a group of ranks that all-reduce together with the NVRAR protocol.

    comm = nvrar.Communicator()            # bootstraps from torch.distributed / MPI / env / single
    comm.all_reduce(x)                     # in place, numpy array or torch CPU tensor
    y = comm.empty((4096,), torch.bfloat16)  # lives in the symmetric heap: no stage-in copy
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import sys
import weakref
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _arrays, _pool, _setup, env, selector
from . import settings as _config
from . import bootstrap as _bootstrap
from ._C import cpu_all_reduce as _cpu_all_reduce
from ._C import write_probe as _write_probe
from .errors import NvrarError

__all__ = ["Communicator"]

_live: "weakref.WeakSet[Communicator]" = weakref.WeakSet()
# Executors a forked child dropped: kept referenced so that the child never runs their release
# (the segments and device memory are the parent's).
_left_to_parent: List[Any] = []


@atexit.register
def _close_all() -> None:
    # At exit, GPU communicators skip the collective release (nvshmem_free): a peer that already
    # died would leave this process waiting in it; process teardown frees the memory anyway.
    for comm in list(_live):
        comm.close(_collective=comm._device == "cpu")


_FAST_OPS = _arrays.OP_CODES  # the per-call path: op names without a call
_FAST_ALGORITHMS = dict(_config.ALGORITHMS)  # ... and algorithm names ("one-shot", "two-shot", "auto")

# Forks seen by this process (os.register_at_fork bumps it in every child): the per-call fork
# check compares one integer where os.getpid() costs a system call. The executor checks again
# (pthread_atfork), for children forked outside Python.
_fork_gen = 0


def _count_fork() -> None:
    global _fork_gen
    _fork_gen += 1


os.register_at_fork(after_in_child=_count_fork)


def _cores() -> int:
    """Cores this process may run on (its affinity mask), as the executor counts them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


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
        max_bytes: largest chunk one protocol round reduces (bytes; ``NVRAR_MAX_BYTES``; 4 MiB
            on CPU, 16 MiB on GPU). Larger messages are reduced in chunks. Must be equal
            on every rank.
        timeout: deadline in seconds of every wait (``NVRAR_TIMEOUT_S``, 60).
        heap_bytes: size of the zero-copy pool behind :meth:`empty` (``NVRAR_HEAP_BYTES``; 32 MiB
            on CPU, 64 MiB on GPU).
        algorithm: "auto" (default, ``NVRAR_ALGORITHM``), "one-shot" or "two-shot" for every call.
            ``algo=`` is its deprecated spelling.
        device: "cpu" (default: the CPU executor, shared memory inside a host and UCX between
            hosts, ``nvrar[ucx]``) or "cuda" (the GPU executor over NVSHMEM: torch CUDA tensors and
            cupy arrays, any number of nodes).

    The defaults are those of :mod:`nvrar.settings`. Collective: every rank of the group must
    construct it, with the same settings.
    """

    def __init__(
        self,
        group: Any = None,
        *,
        ranks_per_node: Optional[int] = None,
        max_bytes: Optional[int] = None,
        timeout: Optional[float] = None,
        heap_bytes: Optional[int] = None,
        algorithm: Optional[str] = None,
        device: str = "cpu",
        algo: Optional[str] = None,
    ) -> None:
        self._ex: Any = None
        self._closed = False
        self._pid = os.getpid()  # a forked child must not use this communicator (_forked)
        self._fork_gen = _fork_gen
        self._checked = _arrays.CheckedTensors()  # torch tensors already checked (in place, no out=)
        if device not in _config.DEVICES:
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self._device = device
        self._cuda_device = -1
        algorithm = _config.algorithm_argument(algorithm, algo, "Communicator")
        # Arguments are checked here, before any communication: a bad argument is the caller's
        # own, on every rank alike. Settings from the environment may differ between ranks, so a
        # bad one is not raised here but exchanged below: then every rank raises, naming it.
        timeout = _config.check_arguments(timeout=timeout, max_bytes=max_bytes, heap_bytes=heap_bytes,
                                           ranks_per_node=ranks_per_node, algorithm=algorithm)
        st: Optional[_config.Settings]
        try:
            st = env.resolve(device, timeout=timeout, max_bytes=max_bytes, heap_bytes=heap_bytes,
                              ranks_per_node=ranks_per_node, algorithm=algorithm)
            env_error = ""
        except ValueError as exc:
            st, env_error = None, str(exc)
        kill_at, kill_error = _setup.kill_point()  # testing: NVRAR_TEST_KILL_AT, "" where unset
        env_error = env_error or kill_error
        boot_timeout = st.timeout_s if st is not None else (timeout or _config.TIMEOUT_S)
        _setup.die_at(kill_at, "bootstrap")
        boot = _bootstrap.create(group, boot_timeout)
        try:
            self._rank, self._world = boot.rank, boot.world_size
            G, secret = _setup.exchange(boot, st, env_error, single_host=device == "cpu", kill_at=kill_at)
            assert st is not None  # a rank without settings has raised in the exchange
            self._G = G
            self._algorithm = selector.algorithm_code(st.algorithm)
            self._timeout = st.timeout_s
            self._settings = st
            if device == "cpu":
                hosts = getattr(boot, "hosts", None)  # per rank, from the exchange
                on_host = hosts.count(hosts[self._rank]) if hosts else self._world
                explicit_cma = env.get_bytes("NVRAR_CMA_MIN_BYTES") is not None
                cma_min = _config.cpu_cma_min_bytes(st, on_host, _cores(), explicit_cma)
                if cma_min != st.cma_min_bytes:
                    st = dataclasses.replace(st, cma_min_bytes=cma_min)
                    self._settings = st
                # NOTE [cross-memory or staged] (csrc/cpu/executor.cpp): measured above cma_min, unless
                # pinned by the user (with more ranks than cores, smaller shards are always staged)
                self._ex = _setup.setup_cpu(boot, self._rank, self._world, G, st, secret, kill_at=kill_at,
                                            cma_adapt=not explicit_cma)
                if hosts and len(set(hosts)) > 1:  # what setup_cpu built the executor with
                    self._settings = st.across_hosts()
            else:
                self._ex, self._cuda_device = _setup.setup_gpu(boot, self._rank, self._world, G, st)
            _setup.die_at(kill_at, "before-close")
        except BaseException:
            if self._ex is not None:
                if device == "cpu":
                    self._ex.unlink_segment()
                self._ex.close()
                self._ex = None
            if device == "cpu":
                # A rank killed during this set-up (which may be why it failed) left its segment in
                # /dev/shm: gone before this rank raises, wherever the set-up failed.
                _setup.sweep_dead_segments()
            self._closed = True
            raise
        finally:
            if boot is not group:  # a Bootstrap the caller passed in stays the caller's
                boot.close()
        self._bootstrap_kind = boot.kind
        self._pool = _pool.PoolAllocator(self._ex.pool_bytes)
        self._pool_base = self._ex.pool_address
        # bound once: the per-call path stays short (on the CPU without pybind11's dispatch)
        self._all_reduce: Any = (functools.partial(_cpu_all_reduce, self._ex) if self._device == "cpu"
                                 else self._ex.all_reduce)
        _live.add(self)
        _setup.die_at(kill_at, "constructed")

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
        """The executor's device, "cpu" or "cuda" (the same as :attr:`backend`)."""
        return self._device

    @property
    def bootstrap(self) -> str:
        """How the ranks found each other: "torch", "mpi", "env" or "single"."""
        return self._bootstrap_kind

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (or construction failed): every call then raises."""
        return self._closed

    @property
    def settings(self) -> _config.Settings:
        """Every value this communicator's executor was built with (nvrar.settings.Settings)."""
        return self._settings

    def algorithm_for(self, nbytes: int, algorithm: Optional[str] = None, *, algo: Optional[str] = None) -> str:
        """The algorithm a call on ``nbytes`` bytes runs ("one-shot" or "two-shot"); where the CPU
        node leader chooses it by call times (NVRAR_ONESHOT_ADAPT_MAX_BYTES), the next such call's."""
        self._check_open("algorithm_for")
        algorithm = _config.algorithm_argument(algorithm, algo, "algorithm_for")
        code = self._algorithm if algorithm is None else selector.algorithm_code(algorithm)
        return selector.algorithm_name(self._ex.resolve(code, int(nbytes)))

    # -- the collective ------------------------------------------------------------------------
    def all_reduce(self, x: Any, op: Any = "sum", out: Any = None, *, algorithm: Optional[str] = None,
                   stream: Any = None, algo: Optional[str] = None) -> Any:
        """Reduce ``x`` over all ranks with ``op``; returns the result (``x``, or ``out``).

        Args:
            x: CPU communicator: a C-contiguous numpy array or torch CPU tensor; device="cuda": a
                contiguous torch CUDA tensor or cupy array on this rank's device. float32,
                float16, bfloat16 (torch) or int32. Reduced in place when ``out`` is None.
            op: "sum", "max", "min", "avg" or a torch.distributed.ReduceOp. avg divides the sum by
                the world size (int32: truncating).
            out: optional output of the same shape, dtype and kind as ``x``.
            algorithm: override the algorithm of this call ("one-shot", "two-shot", "auto");
                ``algo=`` is its deprecated spelling.
            stream: device="cuda" only: the stream to enqueue on (torch.cuda.Stream, cupy Stream
                or a cudaStream_t as an int); default the current stream of ``x``'s library.

        Every rank must call with the same count, dtype, op and algorithm; a mismatch raises
        NvrarError on the ranks involved. Results are bitwise identical on every rank. On the GPU
        the call is asynchronous: a failure of the kernel (timeout, mismatch) raises at the next
        call or in :meth:`check`.
        """
        if self._fork_gen != _fork_gen:
            raise self._forked("all_reduce")
        ex = self._ex
        if ex is None:
            raise NvrarError("all_reduce: the communicator is closed")
        if out is None and algo is None and stream is None:
            # The hot path of decode: in place, a tensor checked before, the default algorithm or
            # one named exactly. (CheckedTensors.get, inlined: a method call is a tenth of this
            # path on a slow host. Naming the algorithm took the checked path until 2026-12-04:
            # 3.4 us a one-rank 8 KB call against 1.3, AMD EPYC KVM guest.)
            e = self._checked._entries.get(id(x))
            if (e is not None and e[0]() is x and x.data_ptr() == e[1] and x.nbytes == e[2] and x.dtype is e[3]
                    and x.is_contiguous() and (not e[6] or _write_probe(e[1], e[2]))):
                try:
                    opc = _FAST_OPS[op]
                except (KeyError, TypeError):
                    opc = _arrays.op_code(op)
                if algorithm is None:
                    acode = self._algorithm
                else:
                    try:
                        acode = _FAST_ALGORITHMS[algorithm]
                    except (KeyError, TypeError):
                        acode = selector.algorithm_code(algorithm)
                self._all_reduce(e[1], e[1], e[4], e[5], opc, acode)
                return x
        if algo is not None:
            algorithm = _config.algorithm_argument(algorithm, algo, "all_reduce")
        if self._device == "cuda":
            return self._all_reduce_cuda(x, op, out, algorithm, stream)
        if stream is not None:
            raise ValueError("all_reduce: stream= applies to device='cuda' communicators")
        if isinstance(x, np.ndarray):
            ptr, count, code = _arrays.numpy_info(x, "x")
            if out is None:
                if not x.flags.writeable:
                    raise ValueError("all_reduce: x is read-only and no out= was given; pass a writeable array or out=")
                optr = ptr
            else:
                optr = _arrays.check_out_numpy(x, out, ptr, count)
        else:
            tensor = _arrays.torch_tensor_type()
            if tensor is None or not isinstance(x, tensor):
                raise TypeError(f"all_reduce: x must be a numpy.ndarray or a torch.Tensor, got {type(x).__name__}")
            ptr, count, code = _arrays.torch_info(x, "x", write=out is None)
            optr = ptr if out is None else _arrays.check_out_torch(x, out, ptr, count)
            if out is None:
                self._checked.add(x, ptr, count, code)
        try:
            opc = _FAST_OPS[op]
        except (KeyError, TypeError):
            opc = _arrays.op_code(op)
        acode = self._algorithm if algorithm is None else selector.algorithm_code(algorithm)
        self._all_reduce(ptr, optr, count, code, opc, acode)
        return x if out is None else out

    def all_reduce_add_rms_norm(self, x: Any, residual: Any, weight: Any, eps: float = 1e-6, *,
                                algorithm: Optional[str] = None) -> Tuple[Any, Any]:
        """Fused all-reduce + residual add + RMSNorm, in place (like vLLM's fused_add_rms_norm):
        ``residual += all_reduce_sum(x)``, then ``x = rms_norm(residual) * weight``; returns
        ``(x, residual)``. x and residual: shape (..., h); weight: (h,); one dtype (float32,
        float16, bfloat16), contiguous, on the communicator's device (CPU arrays or tensors; a
        "cuda" communicator's CUDA tensors). Sum, mean of squares and scaling in fp32, each output
        rounded once; the norm reads the rounded new residual. residual and weight must be the same
        on every rank; every rank ends with bitwise identical x and residual. Every rank must call
        with the same shape, dtype and eps. See nvrar/_fused.py and docs/fused.md.
        """
        from . import _fused

        return _fused.all_reduce_add_rms_norm(self, x, residual, weight, eps, algorithm)

    def _all_reduce_cuda(self, x: Any, op: Any, out: Any, algorithm: Optional[str], stream: Any) -> Any:
        tensor = _arrays.torch_tensor_type()
        if tensor is not None and isinstance(x, tensor):
            ptr, count, code = _arrays.torch_info(x, "x", device="cuda", index=self._cuda_device)
            optr = ptr if out is None else _arrays.check_out_torch(x, out, ptr, count, "cuda", self._cuda_device)
            if stream is None:
                import torch

                stream = torch.cuda.current_stream(x.device)
        elif _arrays.is_cupy(x):
            ptr, count, code = _arrays.cupy_info(x, "x", self._cuda_device)
            optr = ptr if out is None else _arrays.check_out_cupy(x, out, ptr, count, self._cuda_device)
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
        acode = self._algorithm if algorithm is None else selector.algorithm_code(algorithm)
        self._all_reduce(ptr, optr, count, code, opc, acode, _arrays.stream_handle(stream))
        return x if out is None else out

    def check(self, stream: Any = None) -> None:
        """GPU: synchronize ``stream`` (default: the current torch stream if torch is loaded,
        else the legacy default stream) and raise the failure a kernel recorded, if any. CPU:
        raise if the communicator failed."""
        self._check_open("check")
        if self._device == "cpu":
            if self._ex.failed:
                raise NvrarError(self._ex.failure)
            return
        if stream is None and "torch" in sys.modules:
            import torch

            stream = torch.cuda.current_stream(self._cuda_device)
        self._ex.check(_arrays.stream_handle(stream) if stream is not None else 0)

    # -- symmetric memory ----------------------------------------------------------------------
    def empty(self, shape: Union[int, Sequence[int]], dtype: Any = np.float32) -> Any:
        """An uninitialized array (numpy dtype) or tensor (torch dtype) in the symmetric heap.

        all_reduce reads such an input where it is, without the stage-in copy. The memory returns
        to the pool when the last reference to the array (and its views) is gone. Not collective:
        but ranks that want zero-copy on both sides simply allocate alike.
        """
        self._check_open("empty")
        return _pool.empty(self._pool, self._pool_base, shape, dtype, self._device, self._cuda_device,
                           functools.partial(self._release_block, ex=self._ex))

    def _release_block(self, pool: _pool.PoolAllocator, off: int, nbytes: int, ex: Any) -> None:
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

