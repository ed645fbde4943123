"""How the ranks of a Communicator find each other.

A bootstrap knows this process's rank and the world size, and offers an all-gather of small
byte strings and a barrier, each bounded by a deadline. Chosen in this order:

1. the torch.distributed process group passed as ``group`` (or an mpi4py communicator, or a
   Bootstrap instance such as ``SingleBootstrap()`` for a private one-rank communicator);
2. the default torch.distributed group, when torch.distributed is initialized;
3. ``MPI.COMM_WORLD`` when the process was started by mpirun / mpiexec / srun (mpi4py);
4. torchrun-style environment variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), through a
   small TCP store (rank 0 serves it for the rendezvous; under torchrun, the agent's store);
5. a single rank.
"""

from __future__ import annotations

import json as _json
import os
import sys
import time
from typing import Any, List, Optional

from .errors import NvrarError, NvrarTimeoutError
from .settings import TIMEOUT_S

__all__ = ["Bootstrap", "SingleBootstrap", "create", "launcher_local_size", "mpi_launched",
           "preload_ucx_across_hosts"]

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def mpi_launched() -> bool:
    """True when an MPI launcher (mpirun, mpiexec, srun with PMI/PMIx) started this process. A
    torchrun worker is not, even inside a Slurm step."""
    if any(k in os.environ for k in _MPI_ENV):
        return True
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return False
    return "SLURM_STEP_ID" in os.environ and (_int_env("SLURM_NTASKS", 1) or 1) > 1


def _int_env(name: str, default: Optional[int] = None) -> Optional[int]:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    digits = ""
    for ch in raw:  # SLURM writes forms like "4(x2)"
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else default


def launcher_local_size() -> Optional[int]:
    """Ranks per node as the launcher states it, if it does."""
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        value = _int_env(name)
        if value:
            return value
    return None


def _launcher_world_size() -> Optional[int]:
    for name in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        value = _int_env(name)
        if value:
            return value
    return None


def preload_ucx_across_hosts() -> None:
    """Where the launcher says the ranks span hosts (its local size below its world size), load the
    libucx wheel's UCX before mpi4py loads MPI (nvrar._setup.preload_ucx says why)."""
    local, world = launcher_local_size(), _launcher_world_size()
    if local is not None and world is not None and local < world:
        from ._setup import preload_ucx

        preload_ucx()


class Bootstrap:
    """Base class: rank, world size, all-gather and barrier with deadlines."""

    kind = "base"

    def __init__(self, rank: int, world_size: int, timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        # Every rank's host name, once the settings exchange ran (nvrar._setup.exchange): the CPU
        # executor reaches the ranks of other hosts over UCX.
        self.hosts: Optional[List[str]] = None
        # The exchange under way ("settings", "segment", ...), for the errors of allgather.
        self.exchange = ""

    @property
    def launcher_local_size(self) -> Optional[int]:
        """The launcher's ranks per node, when this bootstrap spans the launcher's whole world."""
        if self.world_size == _launcher_world_size():
            return launcher_local_size()
        return None

    def allgather(self, value: bytes) -> List[bytes]:
        raise NotImplementedError

    def allgather_json(self, obj: Any, what: str) -> List[Any]:
        """All-gather of a JSON-able value; a rank's value that does not decode raises NvrarError
        naming that rank and ``what`` (never a bare UnicodeDecodeError / JSONDecodeError)."""
        return [self._decode(r, v, what, json=True) for r, v in enumerate(self._gather(_json.dumps(obj).encode(), what))]

    def allgather_str(self, text: str, what: str) -> List[str]:
        """All-gather of a string, decoded like :meth:`allgather_json`."""
        return [self._decode(r, v, what, json=False) for r, v in enumerate(self._gather(text.encode(), what))]

    def _gather(self, value: bytes, what: str) -> List[bytes]:
        """allgather(value) as the exchange ``what``: a failure of the transport underneath
        (torch.distributed, mpi4py: a peer that died, a store that went away) raises NvrarError
        naming this rank, the exchange and the bootstrap, never the transport's bare exception."""
        self.exchange = what
        try:
            return self.allgather(value)
        except NvrarError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch's and MPI's errors come in many types
            raise NvrarError(
                f"bootstrap: rank {self.rank}: the {what} exchange over the {self.kind} bootstrap failed "
                f"({type(exc).__name__}: {exc}); a rank probably exited", rank=self.rank, phase="bootstrap",
            ) from exc
        finally:
            self.exchange = ""

    def _in_exchange(self, step: int) -> str:
        """Where an allgather is, for its errors: "the segment exchange, rendezvous round 3"."""
        return f"the {self.exchange} exchange, rendezvous round {step}" if self.exchange else f"rendezvous round {step}"

    def _decode(self, r: int, value: bytes, what: str, json: bool) -> Any:
        try:
            text = value.decode()
            return _json.loads(text) if json else text
        except (UnicodeDecodeError, ValueError) as exc:
            raise NvrarError(
                f"bootstrap: rank {self.rank} received from rank {r} a {what} that does not decode "
                f"({type(exc).__name__}: {exc}; first bytes {value[:32]!r}): a rank of another nvrar version, or "
                f"not an nvrar rank", rank=self.rank, peer=r, phase="bootstrap",
            ) from None

    def barrier(self) -> None:
        self.allgather(b"")

    def close(self) -> None:
        pass


class SingleBootstrap(Bootstrap):
    kind = "single"

    def __init__(self, timeout: float = TIMEOUT_S) -> None:
        super().__init__(0, 1, timeout)

    def allgather(self, value: bytes) -> List[bytes]:
        return [value]


class TorchBootstrap(Bootstrap):
    """Over a torch.distributed group (its own timeout bounds these calls)."""

    kind = "torch"

    def __init__(self, group: Any, timeout: float) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        super().__init__(dist.get_rank(group), dist.get_world_size(group), timeout)

    @property
    def launcher_local_size(self) -> Optional[int]:
        if self.world_size == self._dist.get_world_size():
            return super().launcher_local_size
        return None

    def allgather(self, value: bytes) -> List[bytes]:
        out: List[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, value, group=self._group)
        return [bytes(v) for v in out]


class MPIBootstrap(Bootstrap):
    """Over an mpi4py communicator, with non-blocking collectives polled against the deadline."""

    kind = "mpi"

    def __init__(self, comm: Any, timeout: float) -> None:
        self._comm = comm
        super().__init__(comm.Get_rank(), comm.Get_size(), timeout)

    def _wait(self, req: Any, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        delay = 1e-5
        while not req.Test():
            if time.monotonic() > deadline:
                where = f" of the {self.exchange} exchange" if self.exchange else ""
                raise NvrarTimeoutError(
                    f"bootstrap: rank {self.rank} waited {self.timeout:.0f} s in MPI {what}{where}; some rank never "
                    "arrived", rank=self.rank, phase="bootstrap", kind="timeout",
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def allgather(self, value: bytes) -> List[bytes]:
        import numpy as np

        n = self.world_size
        lens = np.empty(n, dtype=np.int64)
        self._wait(self._comm.Iallgather(np.array([len(value)], dtype=np.int64), lens), "all-gather of sizes")
        width = max(1, int(lens.max()))
        send = np.zeros(width, dtype=np.uint8)
        send[: len(value)] = np.frombuffer(value, dtype=np.uint8)
        recv = np.empty(n * width, dtype=np.uint8)
        self._wait(self._comm.Iallgather(send, recv), "all-gather")
        return [recv[i * width: i * width + int(lens[i])].tobytes() for i in range(n)]

    def barrier(self) -> None:
        self._wait(self._comm.Ibarrier(), "barrier")

    @property
    def launcher_local_size(self) -> Optional[int]:
        from mpi4py import MPI

        if self._comm == MPI.COMM_WORLD or self.world_size == _launcher_world_size():
            return super().launcher_local_size
        return None


class _TorchStoreAdapter:
    """torchrun's agent store (a torch TCPStore) behind the StoreClient interface."""

    def __init__(self, host: str, port: int, timeout: float, rank: int) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self._rank = rank
        try:
            self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout),
                                        wait_for_workers=False)
        except Exception as exc:  # torch raises RuntimeError/DistStoreError variants
            raise NvrarTimeoutError(f"bootstrap: rank {rank} could not reach torchrun's store at {host}:{port}: {exc}",
                                    rank=rank, peer=0, phase="bootstrap", kind="timeout") from None

    def set(self, key: bytes, value: bytes) -> None:
        self._store.set(key.decode(), value)  # type: ignore[arg-type]  # torch stores take bytes too

    def get(self, key: bytes, timeout: Optional[float] = None) -> Optional[bytes]:
        try:
            return bytes(self._store.get(key.decode()))
        except Exception:
            return None

    def close(self) -> None:
        pass


_MIN_SECRET = 16


def _session_key() -> Optional[bytes]:
    """The HMAC key of NVRAR_SESSION_SECRET, None when unset (see NOTE [store trust] in _store)."""
    from . import env
    from ._store import secret_key

    secret = env.get_str("NVRAR_SESSION_SECRET")
    if secret is None:
        return None
    if len(secret) < _MIN_SECRET:
        raise NvrarError(f"NVRAR_SESSION_SECRET has {len(secret)} characters; use at least {_MIN_SECRET} random ones "
                         "(e.g. python -c 'import secrets; print(secrets.token_hex(16))')")
    return secret_key(secret)


class StoreBootstrap(Bootstrap):
    """Over a key-value store: nvrar's own TCP store (see NOTE [store trust] in _store), or
    torchrun's agent store (whose trust is torchrun's)."""

    kind = "env"
    _sequence = 0  # rendezvous counter: every rank creates communicators in the same order

    def __init__(self, rank: int, world_size: int, host: str, port: int, timeout: float) -> None:
        super().__init__(rank, world_size, timeout)
        from ._store import StoreClient, StoreServer

        StoreBootstrap._sequence += 1
        # torchrun's agent store outlives worker restarts: a restarted generation must not read the
        # keys of the previous one.
        generation = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '')}"
        self._prefix = f"nvrar/{generation}/{StoreBootstrap._sequence}"
        self._round = 0
        self._server = None
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            self._client: Any = _TorchStoreAdapter(host, port, timeout, rank)
        else:
            session = self._prefix.encode()
            key = _session_key()
            if rank == 0:
                self._server = StoreServer(host, port, expected_clients=world_size, timeout=timeout, session=session,
                                           secret=key)
            try:
                self._client = StoreClient(host, port, timeout, rank, session=session, secret=key)
            except BaseException:
                if self._server is not None:
                    self._server.wait_closed(0.0)
                    self._server = None
                raise

    def allgather(self, value: bytes) -> List[bytes]:
        self._round += 1
        base = f"{self._prefix}/{self._round}/".encode()
        deadline = time.monotonic() + self.timeout
        out = []
        try:
            self._client.set(base + str(self.rank).encode(), value)
            for r in range(self.world_size):
                got = self._client.get(base + str(r).encode(), max(0.0, deadline - time.monotonic()))
                if got is None:
                    break
                out.append(got)
        except NvrarError as exc:  # the store refused us or went away (rank 0, serving it, died?)
            raise type(exc)(f"{exc} (rank {self.rank} was in {self._in_exchange(self._round)})", rank=exc.rank,
                            peer=exc.peer, phase=exc.phase, step=self._round, kind=exc.kind) from None
        if len(out) < self.world_size:
            r = len(out)
            refused = self._server.refused if self._server is not None else []
            raise NvrarTimeoutError(
                f"bootstrap: rank {self.rank} waited {self.timeout:.0f} s for rank {r} in "
                f"{self._in_exchange(self._round)}: rank {r} never arrived (dead, or launched with other "
                "RANK/WORLD_SIZE?)" + (f"; the store refused connections: {'; '.join(refused)}" if refused else ""),
                rank=self.rank, peer=r, phase="bootstrap", step=self._round, kind="timeout",
            )
        return out

    def close(self) -> None:
        self._client.close()
        if self._server is not None:
            self._server.wait_closed(self.timeout)
            self._server = None


def _is_mpi_comm(obj: Any) -> bool:
    return type(obj).__module__.startswith("mpi4py")


def create(group: Any, timeout: float) -> Bootstrap:
    """Pick the bootstrap for ``group`` following the order in the module docstring."""
    if isinstance(group, Bootstrap):
        return group
    if group is not None:
        if _is_mpi_comm(group):
            return MPIBootstrap(group, timeout)
        return TorchBootstrap(group, timeout)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return TorchBootstrap(dist.group.WORLD, timeout)
    if mpi_launched():
        preload_ucx_across_hosts()  # before mpi4py loads an MPI that bundles its own UCX
        try:
            from mpi4py import MPI
        except ImportError:
            raise NvrarError(
                f"this process was started by an MPI launcher (world size {_launcher_world_size()}), but mpi4py "
                "is not installed; `pip install mpi4py` (or nvrar[mpi]), or launch with torchrun-style "
                "RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT"
            ) from None
        return MPIBootstrap(MPI.COMM_WORLD, timeout)
    raw_world = os.environ.get("WORLD_SIZE", "")
    world = _strict_int("WORLD_SIZE", raw_world, 1) if raw_world.strip() else None
    if world is not None and world > 1:
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k, "").strip()]
        if missing:
            raise NvrarError(f"WORLD_SIZE={world} is set but {', '.join(missing)} is not; cannot bootstrap")
        rank = _strict_int("RANK", os.environ["RANK"], 0)
        if rank >= world:
            raise NvrarError(f"RANK={rank} is out of range for WORLD_SIZE={world} (0..{world - 1})")
        port = _strict_int("MASTER_PORT", os.environ["MASTER_PORT"], 1)
        if port > 65535:
            raise NvrarError(f"MASTER_PORT={port} is not a TCP port (1..65535)")
        return StoreBootstrap(rank, world, os.environ["MASTER_ADDR"].strip(), port, timeout)
    return SingleBootstrap(timeout)


def _strict_int(name: str, raw: str, minimum: int) -> int:
    """A launcher variable that must be a whole number >= minimum, or an NvrarError naming it."""
    text = raw.strip()
    try:
        value = int(text, 10)
    except ValueError:
        raise NvrarError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise NvrarError(f"{name}={raw!r} must be >= {minimum}")
    return value
