"""The ``nvrar`` torch.distributed backend, and the group wrapper patch() swaps in.

How it plugs into torch (pinned by tests/test_torch.py::test_torch_internals_nvrar_relies_on):

* ``Backend.register_backend("nvrar", creator, extended_api=True, devices=["cpu", "cuda"])``; the
  creator returns a ``torch.distributed.ProcessGroup`` subclass (torch's PyProcessGroup
  trampoline: C++ callers such as the functional collectives reach its Python ``allreduce``).
  torch.distributed then uses that object as the group (``_new_process_group_helper``: a
  creator that returns a ProcessGroup replaces the group).
* The native backend of the device (ProcessGroupGloo on the CPU; ProcessGroupNCCL on CUDA where
  available), created on the same store under the prefix ``gloo/`` / ``nccl/``, is registered on
  that group for its device. Every collective this class does not override (all_gather,
  reduce_scatter, broadcast, barrier, send/recv, all_to_all, ...) is torch's own dispatch to it.
* ``allreduce`` and ``allreduce_coalesced`` ask nvrar.selector per tensor: nvrar or the native
  backend. torch.distributed.all_reduce, the functional collectives (``_c10d_functional``), DTensor
  and compiled graphs all reach these two methods.

The nvrar Communicator of a group is created on its first all-reduce (every rank of a group makes
its all-reduces in the same order, so every rank creates it at the same call), through the
group's store: no collective of the group itself runs inside it.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceCoalescedOptions, AllreduceOptions, PrefixStore

from . import selector, settings
from ._torch_state import GroupState, StoreBootstrap, Work, groups, lock, op_name, state_for_group, state_of

NAME = "nvrar"
_BackendType = dist.ProcessGroup.BackendType


def _op_or_none(op: Any) -> Optional[str]:
    try:
        return op_name(op)
    except ValueError:  # PREMUL_SUM and the like: the native backend's business
        return None


class NvrarProcessGroup(dist.ProcessGroup):
    """A process group whose all-reduces follow nvrar's policy; everything else goes to the
    native backend registered on it for the device.

    Made by ``init_process_group("nvrar")`` / ``new_group(backend="nvrar")`` (``store`` given:
    nvrar state of its own), or by patch() around an existing group (``wrapped`` given: the state
    is the one nt.all_reduce uses for that group).
    """

    def __init__(self, rank: int, size: int, natives: Dict[str, Any], *, store: Any = None, timeout: float = settings.TIMEOUT_S,
                 wrapped: Any = None, label: str = "") -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the (rank, size) constructor has no stub
        self._natives = natives
        self._store = store
        self._timeout = timeout
        self._wrapped = wrapped
        self._label = label
        self._sequence = itertools.count()
        self._served: Optional[set] = None
        first = True
        for device, backend in natives.items():
            kind = _BackendType.NCCL if backend.name() == "nccl" else _BackendType.GLOO
            if first:
                self._set_default_backend(kind)
                first = False
            self._register_backend(torch.device(device), kind, backend)

    def getBackendName(self) -> str:
        return NAME

    # -- state -------------------------------------------------------------------------------------
    def _serves(self, device: str) -> bool:
        """Whether nvrar serves ``device``'s all-reduces in this group (e.g. not CUDA under
        "cpu:nvrar,cuda:nccl", where the group still reaches this object)."""
        if self._wrapped is not None:
            return True
        if self._served is None:
            config = str(dist.distributed_c10d._world.pg_backend_config.get(self, NAME))
            if ":" in config:
                pairs = [p.split(":") for p in config.split(",")]
                self._served = {d.strip() for d, b in pairs if b.strip() == NAME}
            else:
                self._served = {"cpu", "cuda"}
        return device in self._served

    def _state(self, device: str) -> GroupState:
        if self._wrapped is not None:
            return state_for_group(self._wrapped, device)
        def make() -> GroupState:
            prefix = f"nvrar/{device}/{next(self._sequence)}"  # a new one after nt.reset()
            return GroupState(device, self.size(),
                              lambda: StoreBootstrap(self._store, prefix, self.rank(), self.size(), self._timeout),
                              self._label)

        return state_of((self, device), make)

    def _native(self, device: str) -> Any:
        backend = self._natives.get(device)
        if backend is None:
            raise RuntimeError(f"nvrar backend ({self._label}): no native backend for {device} tensors "
                               f"(have {sorted(self._natives)})")
        return backend

    # -- the two all-reduces -------------------------------------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None) -> Any:  # type: ignore[override]  # one Python method serves the overloads
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if opts is None:
            opts = AllreduceOptions()
        elif not isinstance(opts, AllreduceOptions):  # allreduce(tensors, ReduceOp)
            op, opts = opts, AllreduceOptions()
            opts.reduceOp = op
        device = tensors[0].device.type
        if len(tensors) != 1 or not self._serves(device):
            return self._native(device).allreduce(tensors, opts)
        st = self._state(device)
        name = _op_or_none(opts.reduceOp)
        if name is None or (choice := st.decide_tensor(tensors[0], name)) == selector.NATIVE:
            st.counts["native"] += 1
            return self._native(device).allreduce(tensors, opts)
        return st.run(tensors[0], name, choice)

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        if opts is None:
            opts = AllreduceCoalescedOptions()
        if not tensors:
            return Work([])
        device = tensors[0].device.type
        if not self._serves(device) or any(t.device.type != device for t in tensors):
            return self._native(device).allreduce_coalesced(tensors, opts)
        st = self._state(device)
        name = _op_or_none(opts.reduceOp)
        choices = [selector.NATIVE if name is None else st.decide_tensor(t, name) for t in tensors]
        native = [t for t, c in zip(tensors, choices) if c == selector.NATIVE]
        pending = []
        if native:
            st.counts["native"] += len(native)
            pending.append(self._native(device).allreduce_coalesced(native, opts))
        works = [st.run(t, name, c) for t, c in zip(tensors, choices) if name is not None and c != selector.NATIVE]
        failed = next((w.exception() for w in works if w.exception() is not None), None)
        events = [w._event for w in works if w._event is not None]
        return Work(tensors, failed, events[-1] if events else None, pending)

    # -- lifetime ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        close_states(self)
        for backend in self._natives.values():
            if self._wrapped is None and hasattr(backend, "shutdown"):
                backend.shutdown()

    def abort(self) -> None:
        close_states(self)
        for backend in self._natives.values():
            if self._wrapped is None and hasattr(backend, "abort"):
                backend.abort()


def close_states(pg: Any) -> None:
    with lock:
        for key in [k for k in groups if k[0] is pg]:
            groups.pop(key).close()


def _create(opts: Any, backend_options: Any = None) -> NvrarProcessGroup:
    """The creator torch.distributed calls (extended API) for each group using the backend."""
    store, rank, size = opts.store, opts.group_rank, opts.group_size
    timeout: timedelta = opts.timeout
    natives: Dict[str, Any] = {}
    gloo = dist.ProcessGroupGloo(PrefixStore("gloo/", store), rank, size, timeout)
    gloo.options.global_ranks_in_group = list(opts.global_ranks_in_group)
    gloo.options.group_name = opts.group_id
    natives["cpu"] = gloo
    if torch.cuda.is_available() and dist.is_nccl_available():
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        nccl_opts.global_ranks_in_group = list(opts.global_ranks_in_group)
        nccl_opts.group_name = opts.group_id
        natives["cuda"] = dist.ProcessGroupNCCL(PrefixStore("nccl/", store), rank, size, nccl_opts)
    elif torch.cuda.is_available():
        natives["cuda"] = gloo  # gloo reduces CUDA tensors too (through host copies)
    return NvrarProcessGroup(rank, size, natives, store=store, timeout=timeout.total_seconds(),
                             label=f"group {opts.group_id!r}")


def register() -> None:
    """Make "nvrar" a torch.distributed backend name (idempotent)."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def wrap(pg: Any) -> NvrarProcessGroup:
    """patch(): an NvrarProcessGroup over an existing group, with its native backends."""
    natives = {}
    for device in pg._device_types:
        natives[device.type] = pg._get_backend(device)
    wrapper = NvrarProcessGroup(pg.rank(), pg.size(), natives, wrapped=pg, label=f"group {pg.group_name!r}")
    wrapper._set_group_name(pg.group_name)
    return wrapper
