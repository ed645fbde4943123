"""nvrar as a drop-in for torch.distributed's all-reduce in tensor-parallel layers.

    import nvrar.torch as nt                    # registers the torch.distributed backend "nvrar"
    dist.init_process_group("nvrar")            # a group whose every all-reduce follows nvrar's policy
    with nt.patch():                            # or keep "gloo"/"nccl": while patched, all-reduces go to nvrar
        model(x)
    nt.all_reduce(tensor)                       # torch.distributed.all_reduce's signature
    torch.ops.nvrar.all_reduce_(t, "sum", "")   # custom ops: torch.compile(fullgraph=True), CUDA graphs
    y = torch.ops.nvrar.all_reduce(t, "sum", "")

Every all-reduce goes through one decision, nvrar.selector.select(): an algorithm of nvrar, or the
group's native backend (gloo on CPU, NCCL on GPU) for what nvrar does not serve better (sizes
outside the tuned window, unsupported dtypes or ops). The decision depends only on what is
identical on every rank of a valid call, and the tuning table is checked to be identical on every
rank when a group is first used, so every rank always takes the same path.

Two doors, one policy and one count (``stats()``):
* the ``nvrar`` backend (nvrar/_torch_backend.py): torch.distributed.all_reduce, the functional
  collectives (``_c10d_functional.all_reduce``, ``all_reduce_``, ``all_reduce_coalesced``),
  DTensor and compiled graphs reach it; every other collective is the native backend's.
* ``patch()``: for code that keeps its "gloo"/"nccl" groups. It swaps torch.distributed.all_reduce,
  and, in torch's registry of groups by name (which the functional collectives resolve), every
  group existing at entry for a wrapper whose all-reduces follow the policy; undone on exit.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _register_process_group, _unregister_process_group

from . import _torch_backend, selector
from ._torch_backend import NvrarProcessGroup
from ._torch_state import DTYPE_NAMES as _DTYPE_NAMES
from ._torch_state import REDUCE_OPS as _REDUCE_OPS  # noqa: F401 - kept for importers
from ._torch_state import GroupState as _Group  # noqa: F401 - kept for importers
from ._torch_state import Work
from ._torch_state import groups as _groups
from ._torch_state import lock as _lock
from ._torch_state import op_name as _op_name
from ._torch_state import state_for_group
from .communicator import Communicator
from .errors import NvrarError

__all__ = ["all_reduce", "all_reduce_add_rms_norm", "patch", "communicator", "decide", "stats", "reset", "Work", "BACKEND",
           "NvrarProcessGroup"]

BACKEND = _torch_backend.NAME
_torch_backend.register()

# The original torch.distributed.all_reduce: the native path, also while patch() is active.
_native_all_reduce = dist.all_reduce


def _resolve(group: Any) -> Any:
    if group is None or group is dist.GroupMember.WORLD:
        if not dist.is_initialized():
            raise NvrarError("nvrar.torch: torch.distributed is not initialized (call init_process_group first)")
        return dist.group.WORLD
    return group


def _state(group: Any, device: str) -> _Group:
    if isinstance(group, NvrarProcessGroup):
        return group._state(device)
    return state_for_group(group, device)


def communicator(group: Any = None, device: str = "cpu") -> Communicator:
    """The nvrar Communicator behind ``group`` (created on first use; collective)."""
    st = _state(_resolve(group), device)
    if st.comm is None:
        raise NvrarError(f"nvrar.torch: no nvrar communicator for this group on {device}: {st.native_only}")
    return st.comm


def _native_op(name: str) -> Any:
    return getattr(dist.ReduceOp, name.upper())


def decide(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None) -> str:
    """What ``all_reduce(tensor, op, group)`` would run: an nvrar algorithm or "native".
    Collective the first time a group and device are used (it creates the communicator)."""
    st = _state(_resolve(group), tensor.device.type)
    dtype = _DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype))
    return st.decide(dtype, _op_name(op), tensor.numel() * tensor.element_size())


def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False):
    """torch.distributed.all_reduce, served by nvrar where the policy says so.

    In place; returns None, or a work handle with ``wait()`` when ``async_op=True``. Under
    torch.compile this records the custom op ``torch.ops.nvrar.all_reduce_``. On a group of the
    ``nvrar`` backend this is torch.distributed.all_reduce (the group decides).
    """
    name = _op_name(op)
    if torch.compiler.is_compiling():
        # Recorded as the custom op; its implementation decides (nvrar or native) at run time.
        torch.ops.nvrar.all_reduce_(tensor, name, _group_name(group))
        return _TracedWork(tensor) if async_op else None
    group = _resolve(group)
    if isinstance(group, NvrarProcessGroup):
        return _native_all_reduce(tensor, _native_op(name), group=group, async_op=async_op)
    st = _state(group, tensor.device.type)
    choice = st.decide_tensor(tensor, name)
    if choice == selector.NATIVE:
        st.counts["native"] += 1
        return _native_all_reduce(tensor, _native_op(name), group=group, async_op=async_op)
    work = st.run(tensor, name, choice)
    if async_op:
        return work
    work.wait()
    return None


class _TracedWork:
    """async_op=True under torch.compile: the op is in the graph, in program order, and has run
    (or raised) when the code after it runs; a plain object that Dynamo can trace."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def result(self) -> List[torch.Tensor]:
        return [self._tensor]


def stats(group: Any = None, device: str = "cpu") -> Dict[str, int]:
    """All-reduces served by nvrar and by the native backend so far on ``group`` (whichever door
    they came through: dist.all_reduce, nt.all_reduce, functional collectives, DTensor, compiled)."""
    st = _groups.get((_resolve(group), device))
    return dict(st.counts) if st is not None else {"nvrar": 0, "native": 0}


def reset() -> None:
    """Close every communicator nvrar.torch created (before destroy_process_group; collective:
    the next all-reduce of a group creates a new one)."""
    with _lock:
        for st in _groups.values():
            st.close()
        _groups.clear()


# -- custom ops: torch.compile and CUDA graphs ---------------------------------------------------

def _group_name(group: Any) -> str:
    return "" if group is None or group is dist.GroupMember.WORLD else group.group_name


def _group_from_name(name: str) -> Any:
    if name == "":
        return None
    return dist.distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]  # a GroupName is a str


# The in-place op returns its (mutated) argument, as in-place ops do: Tensor(a!) -> Tensor(a!)
# (torch.library.custom_op cannot express an aliased return, hence define/impl). The inplace tag
# lets torch.compile functionalize it (auto_functionalized).
torch.library.define("nvrar::all_reduce_", "(Tensor(a!) tensor, str op, str group_name) -> Tensor(a!)",
                     tags=(torch.Tag.inplace,))


@torch.library.impl("nvrar::all_reduce_", "CompositeExplicitAutograd")
def _all_reduce_inplace(tensor: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    all_reduce(tensor, op, _group_from_name(group_name))
    return tensor


@torch.library.register_fake("nvrar::all_reduce_")
def _(tensor: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    return tensor


@torch.library.custom_op("nvrar::all_reduce", mutates_args=())
def _all_reduce_functional(tensor: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    out = tensor.clone(memory_format=torch.contiguous_format)
    all_reduce(out, op, _group_from_name(group_name))
    return out


@_all_reduce_functional.register_fake
def _(tensor: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


# -- fused all-reduce + residual add + RMSNorm --------------------------------------------------

def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                            group: Any = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual += all_reduce_sum(x)``, ``x = rms_norm(residual) * weight``; returns
    ``(x, residual)`` (Communicator.all_reduce_add_rms_norm). Under torch.compile this records
    ``torch.ops.nvrar.all_reduce_add_rms_norm_``. Where nvrar does not serve the group (another
    device, a group nvrar cannot set up, non-contiguous tensors), the group's own all-reduce runs,
    then the same fp32 add and norm in torch, on every rank alike (that path rounds the mean of
    squares in torch's order: within a few ulp of nvrar's, not bitwise equal to it)."""
    if torch.compiler.is_compiling():
        torch.ops.nvrar.all_reduce_add_rms_norm_(x, residual, weight, float(eps), _group_name(group))
        return x, residual
    g = _resolve(group)
    st = _state(g, x.device.type)
    comm = st.comm
    if (comm is not None and comm.device == "cpu" and x.is_contiguous() and residual.is_contiguous()
            and weight.is_contiguous()):
        st.counts["nvrar"] += 1
        return comm.all_reduce_add_rms_norm(x, residual, weight, eps)
    # Fallback. On a group of the nvrar backend the group's all-reduce is nvrar's own all-reduce.
    st.counts["native"] += 1
    summed = x.contiguous()  # collectives take contiguous tensors; a copy if x is not
    _native_all_reduce(summed, dist.ReduceOp.SUM, group=g)
    r = (residual.float() + summed.float()).to(residual.dtype)
    rf = r.float()
    out = rf * torch.rsqrt(rf.pow(2).mean(dim=-1, keepdim=True) + float(eps)) * weight.float()
    residual.copy_(r)
    x.copy_(out.to(x.dtype))
    return x, residual


torch.library.define("nvrar::all_reduce_add_rms_norm_",
                     "(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, str group_name) -> ()")


@torch.library.impl("nvrar::all_reduce_add_rms_norm_", "CompositeExplicitAutograd")
def _all_reduce_add_rms_norm_impl(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                  group_name: str) -> None:
    all_reduce_add_rms_norm(x, residual, weight, eps, _group_from_name(group_name))


@torch.library.register_fake("nvrar::all_reduce_add_rms_norm_")
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group_name: str) -> None:
    return None


# -- patch(): unchanged model code ---------------------------------------------------------------

def _swap_groups() -> List[Tuple[str, Any, Any]]:
    """Put an NvrarProcessGroup wrapper in torch's registry of groups by name (what the
    functional collectives, DTensor and compiled graphs resolve) for every group there now."""
    swapped: List[Tuple[Any, Any, Any]] = []
    c10d = dist.distributed_c10d
    for gone in [pg for pg in _wrappers if pg not in c10d._world.pg_names]:  # destroyed groups
        del _wrappers[gone]
    for pg, name in list(c10d._world.pg_names.items()):
        if isinstance(pg, NvrarProcessGroup) or not pg._device_types:
            continue
        wrapper = _wrappers.get(pg)
        if wrapper is None:
            wrapper = _wrappers[pg] = _torch_backend.wrap(pg)
        _unregister_process_group(name)
        _register_process_group(name, wrapper)
        # Code that looks a group up by name (DeviceMesh.get_group) gets the wrapper: it must
        # answer get_rank() / get_world_size() / get_backend() as the group does.
        for table in _ALIAS_TABLES:
            if pg in getattr(c10d._world, table):
                getattr(c10d._world, table)[wrapper] = getattr(c10d._world, table)[pg]
        swapped.append((name, pg, wrapper))
    return swapped


# torch.distributed's per-group tables (pinned in tests/test_torch.py)
_ALIAS_TABLES = ("pg_group_ranks", "pg_map", "pg_backend_config")


def _restore_groups(swapped: List[Tuple[Any, Any, Any]]) -> None:
    c10d = dist.distributed_c10d
    for name, pg, wrapper in swapped:
        _unregister_process_group(name)
        _register_process_group(name, pg)
        for table in _ALIAS_TABLES:
            getattr(c10d._world, table).pop(wrapper, None)


_wrappers: Dict[Any, NvrarProcessGroup] = {}


class patch:
    """Route the all-reduces of unchanged code to nvrar while active (context manager or
    decorator; nestable):

    * ``torch.distributed.all_reduce`` (any group) is swapped for :func:`all_reduce`;
    * the functional collectives ``_c10d_functional.all_reduce``, ``all_reduce_`` and
      ``all_reduce_coalesced`` (DTensor's Partial -> Replicate, compiled graphs) of every group
      that exists at entry: torch resolves them by group name, and the registry then names a
      wrapper whose all-reduces follow the policy (its other collectives: the group's backends).

    Calls nvrar does not serve (per the policy) and every other collective go to the group's own
    backend, unchanged. Groups created while patched get the dist.all_reduce routing only.
    """

    _depth = 0
    _lock = threading.Lock()
    _saved: Tuple[Any, Any] = (None, None)
    _swapped: List[Tuple[str, Any, Any]] = []

    def __enter__(self) -> "patch":
        with patch._lock:
            if patch._depth == 0:
                # Whatever is installed now comes back on exit (another library's patch included).
                patch._saved = (dist.all_reduce, dist.distributed_c10d.all_reduce)
                patch._swapped = _swap_groups() if dist.is_initialized() else []
                dist.all_reduce = all_reduce
                dist.distributed_c10d.all_reduce = all_reduce
            patch._depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        with patch._lock:
            patch._depth -= 1
            if patch._depth == 0:
                dist.all_reduce, dist.distributed_c10d.all_reduce = patch._saved
                _restore_groups(patch._swapped)
                patch._swapped = []

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with patch():
                return fn(*args, **kwargs)

        return wrapped
