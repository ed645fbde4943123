"""What nvrar.torch keeps per (process group, device): the communicator, the policy, the counts;
the Work handle; and the bootstrap over a torch.distributed Store. Shared by nt.all_reduce,
patch() and the registered ``nvrar`` backend (nvrar/_torch_backend.py)."""

from __future__ import annotations

import threading
import warnings
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _arrays, env, selector, settings
from .bootstrap import Bootstrap, TorchBootstrap
from .communicator import Communicator
from .errors import NvrarError, NvrarTimeoutError

# Every torch.distributed.ReduceOp by its canonical name; nvrar serves sum/max/min/avg, the group's
# own backend the rest.
REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
DTYPE_NAMES = {getattr(torch, name): name for name in _arrays.DTYPE_CODES}  # torch dtype -> nvrar name


def op_name(op: Any) -> str:
    """Canonical lower-case name of a ReduceOp or op string ("sum", "product", ...)."""
    if isinstance(op, str):
        name = op.lower()
        if name.upper() not in REDUCE_OPS:
            raise ValueError(f"nvrar.torch: unknown reduction {op!r}; use a torch.distributed.ReduceOp or one of "
                             f"{', '.join(n.lower() for n in REDUCE_OPS)}")
        return name
    attr = getattr(op, "name", None)
    if attr is None:  # ReduceOp instances compare equal to their RedOpType member
        for member in REDUCE_OPS:
            if hasattr(dist.ReduceOp, member) and op == getattr(dist.ReduceOp, member):
                return member.lower()
        raise ValueError(f"nvrar.torch: unsupported reduction {op!r} (a PREMUL_SUM or custom op?)")
    if str(attr).upper() not in REDUCE_OPS:
        raise ValueError(f"nvrar.torch: unsupported reduction {op!r}")
    return str(attr).lower()


def default_timeout() -> float:
    value = env.get_float("NVRAR_TIMEOUT_S")
    return settings.TIMEOUT_S if value is None else value


class Work(dist.Work):
    """The handle of an all-reduce nvrar served (a ``torch.distributed.Work``).

    CPU: the reduction has finished (or failed) when the call that made this handle returned, so
    ``is_completed()`` is True; a failure is kept and raised by ``wait()`` (``exception()`` and
    ``is_success()`` report it). GPU: the reduction is enqueued on the current stream and a CUDA
    event recorded after it; ``is_completed()`` queries the event, ``wait()`` makes the current
    stream wait for it (as NCCL's work does). ``pending``: native works this handle also covers
    (a coalesced call split between nvrar and the native backend).
    """

    def __init__(self, tensors: Any, exc: Optional[BaseException] = None, event: Any = None,
                 pending: Sequence[Any] = ()) -> None:
        super().__init__()
        self._tensors = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        self._exc = exc
        self._event = event
        self._pending = list(pending)

    def wait(self, timeout: Any = None) -> bool:
        for w in self._pending:
            w.wait()
        if self._exc is not None:
            raise self._exc
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        if self._event is not None and not self._event.query():
            return False
        return all(w.is_completed() for w in self._pending)

    def is_success(self) -> bool:
        return self._exc is None and all(w.is_success() for w in self._pending if w.is_completed())

    def exception(self) -> Optional[BaseException]:
        return self._exc

    def result(self) -> List[torch.Tensor]:
        return self._tensors

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        try:
            self.wait()
            if self._event is not None:
                self._event.synchronize()
        except BaseException as exc:  # the future carries the failure
            fut.set_exception(exc)
            return fut
        fut.set_result(self._tensors)
        return fut


class StoreBootstrap(Bootstrap):
    """All-gather of small byte strings over a torch.distributed Store (the one a process group
    is created with), bounded by ``timeout``: needs no process group, so the ``nvrar`` backend can
    use it while torch is still creating the group, and from inside its own collectives."""

    kind = "torch-store"

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int, timeout: float) -> None:
        super().__init__(rank, world_size, timeout)
        self._store = store
        self._prefix = prefix
        self._round = 0

    def allgather(self, value: bytes) -> List[bytes]:
        self._round += 1
        keys = [f"{self._prefix}/{self._round}/{r}" for r in range(self.world_size)]
        self._store.set(keys[self.rank], value)
        try:
            self._store.wait(keys, timedelta(seconds=self.timeout))
        except Exception:  # torch raises DistStoreError (a RuntimeError) on timeout
            missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
            peer = missing[0] if missing else None
            raise NvrarTimeoutError(
                f"nvrar backend: rank {self.rank} waited {self.timeout:.0f} s in the setup exchange "
                f"{self._prefix} round {self._round} for rank(s) {missing}; they never arrived",
                rank=self.rank, peer=peer, phase="bootstrap", step=self._round, kind="timeout") from None
        return [bytes(self._store.get(k)) for k in keys]


class GroupState:
    """What nvrar keeps per (process group, device kind): the communicator and the policy.
    Created collectively (every rank of the group at the same call)."""

    def __init__(self, device: str, world: int, make_bootstrap: Callable[[], Bootstrap], label: str) -> None:
        self.device = device
        self.world = world
        self.label = label
        self.counts = {"nvrar": 0, "native": 0}
        self.comm: Optional[Communicator] = None
        self.table: Optional[selector.Table] = None
        self.G = 1
        self.native_only = ""  # why nvrar cannot serve this group and device ("": it can)
        if device not in ("cpu", "cuda"):
            self.native_only = f"nvrar does not serve tensors on {device}"
            return
        boot = make_bootstrap()
        try:
            self.comm = Communicator(group=boot, device=device)
        except NvrarError as exc:
            # Setup verdicts are exchanged between the ranks before anything can fail alone, so
            # every rank lands here together, and the group's own backend serves it from now on.
            self.native_only = str(exc)
            warnings.warn(f"nvrar.torch: nvrar cannot serve {label} on {device} ({exc}); its own backend will",
                          RuntimeWarning, stacklevel=4)
            return
        self.G = self.comm.ranks_per_node
        self.table = self._agreed_table(boot)

    def _agreed_table(self, boot: Bootstrap) -> Optional[selector.Table]:
        """The tuning table, if every rank loaded the same one; else none on every rank."""
        from .tuning import load_table

        try:
            table = load_table(self.device, self.world, self.G)
            mine = table.fingerprint() if table is not None else "none"
        except Exception as exc:  # any unreadable table: never leave the other ranks waiting below
            table, mine = None, f"error: {type(exc).__name__}: {exc}"
        prints = [b.decode() for b in boot.allgather(mine.encode())]
        if len(set(prints)) > 1:
            warnings.warn(f"nvrar.torch: ranks loaded different tuning tables ({sorted(set(prints))}); "
                          "every rank uses the built-in policy instead. Point NVRAR_TUNING_FILE at one file.",
                          RuntimeWarning, stacklevel=3)
            return None
        if mine.startswith("error"):
            warnings.warn(f"nvrar.torch: tuning table unusable ({mine}); using the built-in policy",
                          RuntimeWarning, stacklevel=3)
        return table

    def decide(self, dtype: str, op: str, nbytes: int) -> str:
        if self.native_only:
            return selector.NATIVE
        return selector.select(self.device, self.world, self.G, dtype, op, nbytes, self.table)

    def decide_tensor(self, tensor: torch.Tensor, op: str) -> str:
        return self.decide(DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype)), op,
                           tensor.numel() * tensor.element_size())

    def run(self, tensor: torch.Tensor, op: str, choice: str) -> Work:
        """Reduce ``tensor`` in place with nvrar (``choice``: an algorithm) and count it. A failure
        is kept in the returned Work (raised by its wait())."""
        self.counts["nvrar"] += 1
        algorithm = None if choice == "auto" else choice
        exc: Optional[BaseException] = None
        try:
            if self.comm is None:
                raise NvrarError(f"nvrar.torch: no communicator for {self.label} on {self.device}")
            if tensor.is_contiguous():
                self.comm.all_reduce(tensor, op, algorithm=algorithm)
            else:  # same decision on every rank; only the memory layout differs
                tmp = tensor.contiguous()
                self.comm.all_reduce(tmp, op, algorithm=algorithm)
                tensor.copy_(tmp)
        except Exception as e:  # noqa: BLE001 - surfaces from Work.wait()
            exc = e
        event = None
        if tensor.device.type == "cuda" and exc is None:
            event = torch.cuda.Event()
            event.record()
        return Work(tensor, exc, event)

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()


# (process group, device) -> its state; the nvrar backend's groups register theirs here too.
groups: Dict[Tuple[Any, str], GroupState] = {}
lock = threading.RLock()


def state_of(key: Tuple[Any, str], make: Callable[[], GroupState]) -> GroupState:
    """The state registered under ``key``, made by ``make()`` the first time (once, under the lock)."""
    st = groups.get(key)
    if st is None:
        with lock:
            st = groups.get(key)
            if st is None:
                st = groups[key] = make()
    return st


def state_for_group(group: Any, device: str) -> GroupState:
    """The state of a process group nvrar reaches from outside (nt.all_reduce, patch()): its
    ranks exchange through the group itself."""
    return state_of((group, device), lambda: GroupState(
        device, dist.get_world_size(group), lambda: TorchBootstrap(group, default_timeout()),
        f"group {getattr(group, 'group_name', '?')}"))
