"""nvrar as a drop-in for torch.distributed's all-reduce in tensor-parallel layers.

    import nvrar.torch as nt
    nt.all_reduce(tensor)                       # torch.distributed.all_reduce's signature
    with nt.patch():                            # unchanged model code: dist.all_reduce -> nvrar
        model(x)
    torch.ops.nvrar.all_reduce_(t, "sum", "")   # custom ops: torch.compile(fullgraph=True), CUDA graphs
    y = torch.ops.nvrar.all_reduce(t, "sum", "")

Every call goes through one decision, nvrar.selector.select(): a variant of nvrar, or the
group's native backend (gloo on CPU, NCCL on GPU) for what nvrar does not serve better (sizes
outside the tuned window, unsupported dtypes or ops). The decision depends only on what is
identical on every rank of a valid call, and the tuning table is checked to be identical on every
rank when a group is first used, so every rank always takes the same path.

Why patch() rather than a registered torch.distributed backend: patch() keeps the group's own
backend for everything (every other collective, and the sizes nvrar does not win), needs no new
backend string in init_process_group, is scoped (a context manager or decorator, undone on exit),
and does not depend on the Python ProcessGroup-backend extension points, which change between
torch releases.
"""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from . import selector
from .communicator import Communicator
from .errors import NvrarError

__all__ = ["all_reduce", "patch", "communicator", "decide", "stats", "reset", "Work"]

# Every torch.distributed.ReduceOp by its canonical name; nvrar serves sum/max/min/avg, the group's
# own backend the rest.
_REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.int32: "int32"}

# The original torch.distributed.all_reduce: the native path, also while patch() is active.
_native_all_reduce = dist.all_reduce


class Work:
    """The handle returned with ``async_op=True``. On the CPU the all-reduce has completed when
    the call returns; on the GPU it is enqueued on the current stream, which later work on that
    stream is ordered after (as with NCCL after ``wait()``). ``wait()`` is still required by the
    torch.distributed contract."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self) -> list:
        return [self._tensor]

    def exception(self) -> None:
        return None


class _Group:
    """What nvrar keeps per (process group, device kind): the communicator and the policy."""

    def __init__(self, group: Any, device: str) -> None:
        self.group = group
        self.device = device
        self.counts = {"nvrar": 0, "native": 0}
        self.comm: Optional[Communicator] = None
        self.table = None
        self.world = dist.get_world_size(group)
        self.G = 1
        self.native_only = ""  # why nvrar cannot serve this group and device ("": it can)
        if device not in ("cpu", "cuda"):
            self.native_only = f"nvrar does not serve tensors on {device}"
            return
        try:
            self.comm = Communicator(group=group, device=device)
        except NvrarError as exc:
            # Setup verdicts are exchanged between the ranks before anything can fail alone, so
            # every rank lands here together, and the group's own backend serves it from now on.
            self.native_only = str(exc)
            warnings.warn(f"nvrar.torch: nvrar cannot serve this group on {device} ({exc}); its own backend will",
                          RuntimeWarning, stacklevel=4)
            return
        self.G = self.comm.ranks_per_node
        self.table = self._agreed_table()

    def _agreed_table(self) -> Optional[selector.Table]:
        """The tuning table, if every rank loaded the same one; else none on every rank."""
        from .tuning import load_table

        try:
            table = load_table(self.device, self.world, self.G)
            mine = table.fingerprint() if table is not None else "none"
        except Exception as exc:  # any unreadable table: never leave the other ranks waiting below
            table, mine = None, f"error: {type(exc).__name__}: {exc}"
        prints = [None] * self.world
        dist.all_gather_object(prints, mine, group=self.group)
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


_groups: Dict[Tuple[Any, str], _Group] = {}
_lock = threading.Lock()


def _resolve(group: Any) -> Any:
    if group is None or group is dist.GroupMember.WORLD:
        if not dist.is_initialized():
            raise NvrarError("nvrar.torch: torch.distributed is not initialized (call init_process_group first)")
        return dist.group.WORLD
    return group


def _state(group: Any, device: str) -> _Group:
    key = (group, device)
    st = _groups.get(key)
    if st is None:
        with _lock:
            st = _groups.get(key)
            if st is None:
                st = _groups[key] = _Group(group, device)
    return st


def communicator(group: Any = None, device: str = "cpu") -> Communicator:
    """The nvrar Communicator behind ``group`` (created on first use; collective)."""
    st = _state(_resolve(group), device)
    if st.comm is None:
        raise NvrarError(f"nvrar.torch: no nvrar communicator for this group on {device}: {st.native_only}")
    return st.comm


def _op_name(op: Any) -> str:
    """Canonical lower-case name of a ReduceOp or op string ("sum", "product", ...)."""
    if isinstance(op, str):
        name = op.lower()
        if name.upper() not in _REDUCE_OPS:
            raise ValueError(f"nvrar.torch: unknown reduction {op!r}; use a torch.distributed.ReduceOp or one of "
                             f"{', '.join(n.lower() for n in _REDUCE_OPS)}")
        return name
    name = getattr(op, "name", None)
    if name is None:  # ReduceOp instances compare equal to their RedOpType member
        for member in _REDUCE_OPS:
            if hasattr(dist.ReduceOp, member) and op == getattr(dist.ReduceOp, member):
                return member.lower()
        raise ValueError(f"nvrar.torch: unsupported reduction {op!r} (a PREMUL_SUM or custom op?)")
    if name.upper() not in _REDUCE_OPS:
        raise ValueError(f"nvrar.torch: unsupported reduction {op!r}")
    return name.lower()


def _native_op(name: str) -> Any:
    return getattr(dist.ReduceOp, name.upper())


def decide(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None) -> str:
    """What ``all_reduce(tensor, op, group)`` would run: an nvrar variant or "native".
    Collective the first time a group and device are used (it creates the communicator)."""
    st = _state(_resolve(group), tensor.device.type)
    dtype = _DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype))
    return st.decide(dtype, _op_name(op), tensor.numel() * tensor.element_size())


def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False):
    """torch.distributed.all_reduce, served by nvrar where the policy says so.

    In place; returns None, or a work handle with ``wait()`` when ``async_op=True``. Under
    torch.compile this records the custom op ``torch.ops.nvrar.all_reduce_``.
    """
    name = _op_name(op)
    if torch.compiler.is_compiling():
        # Recorded as the custom op; its implementation decides (nvrar or native) at run time.
        torch.ops.nvrar.all_reduce_(tensor, name, _group_name(group))
        return Work(tensor) if async_op else None
    group = _resolve(group)
    st = _state(group, tensor.device.type)
    dtype = _DTYPE_NAMES.get(tensor.dtype)
    choice = st.decide(dtype or str(tensor.dtype), name, tensor.numel() * tensor.element_size())
    if choice == selector.NATIVE:
        st.counts["native"] += 1
        return _native_all_reduce(tensor, _native_op(name), group=group, async_op=async_op)
    st.counts["nvrar"] += 1
    algo = None if choice == "auto" else choice
    if tensor.is_contiguous():
        st.comm.all_reduce(tensor, name, algo=algo)
    else:  # same decision on every rank; only the memory layout differs
        tmp = tensor.contiguous()
        st.comm.all_reduce(tmp, name, algo=algo)
        tensor.copy_(tmp)
    return Work(tensor) if async_op else None


def stats(group: Any = None, device: str = "cpu") -> Dict[str, int]:
    """Calls served by nvrar and by the native backend so far on ``group``."""
    st = _groups.get((_resolve(group), device))
    return dict(st.counts) if st is not None else {"nvrar": 0, "native": 0}


def reset() -> None:
    """Close every communicator nvrar.torch created (before destroy_process_group)."""
    with _lock:
        for st in _groups.values():
            if st.comm is not None:
                st.comm.close()
        _groups.clear()


# -- custom ops: torch.compile and CUDA graphs ---------------------------------------------------

def _group_name(group: Any) -> str:
    return "" if group is None or group is dist.GroupMember.WORLD else group.group_name


def _group_from_name(name: str) -> Any:
    if name == "":
        return None
    return dist.distributed_c10d._resolve_process_group(name)


@torch.library.custom_op("nvrar::all_reduce_", mutates_args=("tensor",))
def _all_reduce_inplace(tensor: torch.Tensor, op: str, group_name: str) -> None:
    all_reduce(tensor, op, _group_from_name(group_name))


@_all_reduce_inplace.register_fake
def _(tensor: torch.Tensor, op: str, group_name: str) -> None:
    return None


@torch.library.custom_op("nvrar::all_reduce", mutates_args=())
def _all_reduce_functional(tensor: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    out = tensor.clone(memory_format=torch.contiguous_format)
    all_reduce(out, op, _group_from_name(group_name))
    return out


@_all_reduce_functional.register_fake
def _(tensor: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


# -- patch(): unchanged model code ---------------------------------------------------------------

class patch:
    """Route ``torch.distributed.all_reduce`` calls to nvrar while active (context manager or
    decorator). Calls nvrar does not serve (per the policy) and every other collective go to the
    group's own backend, unchanged. Nesting is allowed."""

    _depth = 0
    _lock = threading.Lock()
    _saved: Tuple[Any, Any] = (None, None)

    def __enter__(self) -> "patch":
        with patch._lock:
            if patch._depth == 0:
                # Whatever is installed now comes back on exit (another library's patch included).
                patch._saved = (dist.all_reduce, dist.distributed_c10d.all_reduce)
                dist.all_reduce = all_reduce
                dist.distributed_c10d.all_reduce = all_reduce
            patch._depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        with patch._lock:
            patch._depth -= 1
            if patch._depth == 0:
                dist.all_reduce, dist.distributed_c10d.all_reduce = patch._saved

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with patch():
                return fn(*args, **kwargs)

        return wrapped
