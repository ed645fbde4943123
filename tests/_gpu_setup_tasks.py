"""Rank-side task of tests/test_gpu_setup.py (run by _worker.py): Communicator(device="cuda") set up
over the real store bootstrap, by real processes, with a stand-in for the native side only: the GPU
module's functions that setup_gpu calls (device_count, unique_id, nvshmem_init_status, nvshmem_pes,
set_symmetric_size_default, GpuExecutor, ...), nvshmem4py's nvshmem.core and cuda.core's Device.
Each rank's stand-in fails where its plan says; every call is recorded and reported.

Installed through nvrar._setup.NATIVE_STANDIN (a testing hook, None in every other use): the
verdict exchange, _nvshmem_mode, _check_modes, nvrar._gpu's Nvshmem4pyInit and library_mismatch
(with the real cuda.pathfinder) run as they do on a GPU machine."""

from __future__ import annotations

import ctypes
import os
import sys
import time
import types
from typing import Any, Dict, List, Optional

import nvrar
from nvrar import _gpu, _setup

UID_BYTES = 128  # nvshmemx_uniqueid_t


class Planned(RuntimeError):
    """The failure a plan asked for."""


class StandIn:
    def __init__(self, rank: int, plan: Dict[str, Any]) -> None:
        self.rank = rank
        self.plan = plan
        self.calls: List[str] = []
        self.uids: Dict[str, str] = {}
        self.status = int(plan.get("status", 0))

    def call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.plan.get("fail", []):
            raise Planned(f"{name} failed on rank {self.rank} (planned)")


def _library() -> tuple:
    """(path, version) of the NVSHMEM host library as nvshmem4py's cuda.pathfinder finds it: the
    stand-in GPU module claims the same file, so that library_mismatch runs for real and agrees."""
    from cuda.pathfinder import load_nvidia_dynamic_lib

    path = os.path.realpath(load_nvidia_dynamic_lib("nvshmem_host").abs_path)
    import importlib.metadata as md

    return path, md.version("nvidia-nvshmem-cu13")


def make_module(s: StandIn) -> Any:
    """The GPU module (nvrar._cuda) as setup_gpu and Communicator use it."""
    mod = types.SimpleNamespace()
    lib = _library() if s.plan.get("n4p") == "import" else ("/nonexistent/libnvshmem_host.so.3", "3.4.5")

    def device_count():
        s.call("device_count")
        n = int(s.plan.get("devices", 1))
        return n, "" if n else "no CUDA device (stand-in)"

    def unique_id():
        s.call("unique_id")
        uid = os.urandom(UID_BYTES)
        s.uids["generated"] = uid.hex()
        return uid

    def nvshmem_init_status():
        s.call("nvshmem_init_status")
        return s.status

    def nvshmem_pes():
        s.call("nvshmem_pes")
        pes = s.plan.get("pes")
        return tuple(pes) if pes else (s.rank, int(os.environ["WORLD_SIZE"]))

    def set_symmetric_size_default(**kw):
        s.call("set_symmetric_size_default")

    class GpuExecutor:
        def __init__(self, **kw):
            s.call("GpuExecutor")
            s.uids["executor"] = kw["uid"].hex()
            self.kw = {k: v for k, v in kw.items() if k != "uid"}
            self.pool_bytes = int(kw["pool_bytes"])
            self.pool_address = 1 << 40
            self.max_bytes = int(kw["max_bytes"])

        def all_reduce(self, *a):
            raise AssertionError("the stand-in executor reduces nothing")

        def close(self):
            s.call("close")

        def abandon(self):
            s.call("abandon")

    mod.device_count = device_count
    mod.unique_id = unique_id
    mod.nvshmem_init_status = nvshmem_init_status
    mod.nvshmem_pes = nvshmem_pes
    mod.set_symmetric_size_default = set_symmetric_size_default
    mod.GpuExecutor = GpuExecutor
    mod.nvshmem_library_path = lambda: lib[0]
    mod.nvshmem_library_version = lambda: lib[1]
    mod.build_info = lambda: {"nvshmem_version": lib[1]}
    mod.env_set_by_nvrar = lambda: []
    mod.version = lib[1]
    return mod


class _Uid:
    """nvshmem4py's UniqueID as nvrar uses it: .ptr and ._data.nbytes."""

    def __init__(self, data: bytes) -> None:
        self._buf = ctypes.create_string_buffer(data, UID_BYTES)
        self.ptr = ctypes.addressof(self._buf)
        self._data = memoryview(self._buf)[:UID_BYTES]


def make_core(s: StandIn, version: str) -> Any:
    """nvshmem.core (nvshmem4py) as nvrar._gpu uses it."""
    core = types.SimpleNamespace()

    def get_unique_id(empty: bool = False):
        if empty:
            return _Uid(bytes(UID_BYTES))
        s.call("n4p_unique_id")
        uid = os.urandom(UID_BYTES)
        s.uids["generated"] = uid.hex()
        return _Uid(uid)

    def init(device, uid, rank, nranks, initializer_method):
        s.call("n4p_init")
        assert (rank, nranks, initializer_method) == (s.rank, int(os.environ["WORLD_SIZE"]), "uid"), (rank, nranks)
        s.uids["n4p_init"] = ctypes.string_at(uid.ptr, UID_BYTES).hex()
        s.status = 2

    core.get_unique_id = get_unique_id
    core.init = init
    core.init_status = lambda: s.status
    core.get_version = lambda: types.SimpleNamespace(libnvshmem_version=version)
    core.finalize = lambda: s.call("n4p_finalize")
    return core


def install(s: StandIn) -> None:
    mod = make_module(s)
    core = make_core(s, mod.version) if s.plan.get("n4p") == "import" else None
    why = None if core is not None else "nvshmem4py is not installed (stand-in)"

    class Device:  # cuda.core's, as Nvshmem4pyInit.init uses it
        def __init__(self, device):
            self.device_id = int(device)

        def set_current(self):
            s.call("set_current")

    # nvrar._gpu asks nvshmem.core._internal_tracking whether nvshmem4py initialized NVSHMEM; the
    # stand-in's own nvshmem4py has none (never initialized by the user), and cuda.core is the stand-in's.
    sys.modules["nvshmem"] = types.ModuleType("nvshmem")
    sys.modules["nvshmem.core"] = types.ModuleType("nvshmem.core")
    sys.modules["cuda.core"] = types.SimpleNamespace(Device=Device)  # type: ignore[assignment]
    _setup.NATIVE_STANDIN = lambda: ((mod, None), (core, why))


def task_gpusetup(args: Dict[str, Any]) -> Dict[str, Any]:
    rank = int(os.environ["RANK"])
    s = StandIn(rank, args.get("plan", {}))
    install(s)
    out: Dict[str, Any] = {"raised": None, "message": "", "init": os.environ.get("NVRAR_NVSHMEM_INIT")}
    t0 = time.monotonic()
    comm: Optional[nvrar.Communicator] = None
    try:
        comm = nvrar.Communicator(device="cuda", ranks_per_node=args.get("G"), timeout=args.get("timeout", 30))
    except Exception as exc:  # noqa: BLE001 - the test checks type and message
        out.update(raised=type(exc).__name__, message=str(exc))
    out["elapsed"] = time.monotonic() - t0
    out["n4p_live"] = _gpu.Nvshmem4pyInit.live
    if comm is not None:
        out["device"] = comm._cuda_device
        comm.close()
        out["n4p_live_after_close"] = _gpu.Nvshmem4pyInit.live
    out["calls"] = s.calls
    out["uids"] = s.uids
    return out


TASKS = {"gpusetup": task_gpusetup}
