"""Loading the GPU executor module (nvrar._cuda), which exists only in builds made with nvcc,
and its partner nvshmem4py (NVIDIA's Python API for NVSHMEM), where installed.

The module needs NVSHMEM's host library (libnvshmem_host.so.3, from the nvidia-nvshmem-cu13
wheel). Its run path finds it beside an installed nvrar; for an editable install (or an
NVSHMEM elsewhere) it is loaded here first, from the wheel's directory or NVSHMEM_HOME.

nvshmem4py finds its host library through cuda.pathfinder. Both must use the same file (two
copies would be two NVSHMEM states in one process): library_mismatch() checks it, with the
versions, before anything is initialized. docs/gpu/executor.md says how the two share NVSHMEM.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import threading
from typing import Any, List, Optional, Tuple

__all__ = ["load", "built", "version_mismatch", "nvshmem4py_version", "nvshmem4py", "library_mismatch",
           "mapped_host_libraries", "nvshmem4py_initialized", "nvshmem4py_device", "Nvshmem4pyInit", "Executor"]

_module: Any = None
_error: Optional[str] = None


def _nvshmem_lib_dirs():
    home = os.environ.get("NVSHMEM_HOME")
    if home:
        yield os.path.join(home, "lib")
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ModuleNotFoundError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            yield os.path.join(root, "lib")


def built() -> bool:
    """Whether this build contains the GPU executor (regardless of whether it loads here)."""
    return importlib.util.find_spec("nvrar._cuda") is not None


def load() -> Tuple[Any, Optional[str]]:
    """(module, None) or (None, why not)."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module, _error
    if not built():
        _error = "this nvrar was built without the GPU executor (no nvcc at build time, or NVRAR_CUDA=0)"
        return None, _error
    for d in _nvshmem_lib_dirs():
        path = os.path.join(d, "libnvshmem_host.so.3")
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            break
    loaded = _loaded_library_version()
    try:
        from . import _cuda
    except ImportError as exc:
        _error = (f"the GPU executor module does not load: {exc} (NVSHMEM host library loaded: "
                  f"{loaded or 'none'}; pip install nvidia-nvshmem-cu13)")
        return None, _error
    built_with = str(_cuda.build_info()["nvshmem_version"])
    loaded = _cuda.nvshmem_library_version()
    why = version_mismatch(built_with, loaded)
    if why:
        _error = why
        return None, _error
    _module = _cuda
    return _module, None


def _loaded_library_version() -> Optional[str]:
    """Version of the NVSHMEM host library this process has loaded (or would load), via its C entry
    point, before the module is imported; None when none loads."""
    for d in _nvshmem_lib_dirs():
        path = os.path.join(d, "libnvshmem_host.so.3")
        if not os.path.exists(path):
            continue
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            v = [ctypes.c_int(0) for _ in range(3)]
            lib.nvshmemx_vendor_get_version_info(*[ctypes.byref(x) for x in v])
            return ".".join(str(x.value) for x in v)
        except (OSError, AttributeError):
            continue
    return None


def version_mismatch(built_with: str, loaded: str) -> Optional[str]:
    """None when the NVSHMEM host library loaded is the version the module was built against (same
    major.minor; the patch may differ), else why not. nvrar links NVSHMEM's device library and enters
    the host library through a non-ABI entry point, so another minor version is refused here rather
    than left to fail inside nvshmem_init."""
    try:
        b = tuple(int(p) for p in built_with.split("."))
        loaded_t = tuple(int(p) for p in loaded.split("."))
    except (AttributeError, ValueError):
        return f"cannot compare NVSHMEM versions: built against {built_with!r}, loaded {loaded!r}"
    if b[:2] == loaded_t[:2]:
        return None
    return (f"nvrar was built against NVSHMEM {built_with} but NVSHMEM {loaded} is loaded: install the "
            f"matching host library (pip install nvidia-nvshmem-cu13=={built_with}) or rebuild nvrar "
            f"against {loaded} (pip install --no-build-isolation ., with that version installed)")



# -- nvshmem4py -------------------------------------------------------------------------------------

# The distributions that provide the `nvshmem` package (nvshmem4py), per CUDA major.
_NVSHMEM4PY_DISTS = ("nvshmem4py-cu13", "nvshmem4py-cu12", "nvshmem4py")
_n4p: Any = None
_n4p_error: Optional[str] = None


def nvshmem4py_version() -> Optional[str]:
    """The installed nvshmem4py's version, from its metadata (nothing is imported); None if absent."""
    for dist in _NVSHMEM4PY_DISTS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def nvshmem4py() -> Tuple[Any, Optional[str]]:
    """(nvshmem.core, None) where nvshmem4py is installed and imports, else (None, why not). Importing
    it initializes nothing (it works on a host without a GPU)."""
    global _n4p, _n4p_error
    if _n4p is not None or _n4p_error is not None:
        return _n4p, _n4p_error
    if nvshmem4py_version() is None:
        _n4p_error = "nvshmem4py is not installed (pip install 'nvrar[nvshmem4py]')"
        return None, _n4p_error
    try:
        import nvshmem.core as core
    except Exception as exc:  # noqa: BLE001 - an installed package that fails to import: say why
        _n4p_error = f"nvshmem4py {nvshmem4py_version()} is installed but does not import: {type(exc).__name__}: {exc}"
        return None, _n4p_error
    _n4p = core
    return _n4p, None


def mapped_host_libraries() -> List[str]:
    """The distinct NVSHMEM host library files mapped into this process (real paths, sorted)."""
    found = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith("libnvshmem_host"):
                    found.add(os.path.realpath(parts[5].strip()))
    except OSError:
        pass
    return sorted(found)


def nvshmem4py_library(core: Any) -> Tuple[str, str]:
    """(real path, version) of the NVSHMEM host library nvshmem4py uses (cuda.pathfinder loads it
    once per process, or finds it loaded)."""
    from cuda.pathfinder import load_nvidia_dynamic_lib

    path = os.path.realpath(load_nvidia_dynamic_lib("nvshmem_host").abs_path)
    return path, str(core.get_version().libnvshmem_version)


def library_mismatch(mod: Any, core: Any) -> Optional[str]:
    """None when nvrar's GPU module and nvshmem4py use one NVSHMEM host library file of the version
    nvrar was built against, else why not (naming both sides)."""
    ours = os.path.realpath(mod.nvshmem_library_path() or "?")
    ours_version = mod.nvshmem_library_version()
    try:
        theirs, theirs_version = nvshmem4py_library(core)
    except Exception as exc:  # noqa: BLE001 - cuda.pathfinder's own errors
        return f"nvshmem4py cannot load NVSHMEM's host library: {type(exc).__name__}: {exc}"
    if ours != theirs:
        return (f"nvrar and nvshmem4py loaded two different NVSHMEM host libraries (two NVSHMEM states in one "
                f"process): nvrar {ours} ({ours_version}, NVSHMEM_HOME or the nvidia-nvshmem-cu13 wheel), "
                f"nvshmem4py {theirs} ({theirs_version}, cuda.pathfinder); make both find the same one (unset "
                f"NVSHMEM_HOME, or point LD_LIBRARY_PATH at it)")
    mapped = mapped_host_libraries()
    if len(mapped) > 1:
        return (f"this process maps {len(mapped)} NVSHMEM host libraries ({', '.join(mapped)}): two NVSHMEM states; "
                f"nvrar uses {ours}, nvshmem4py {theirs}; load one only (NVSHMEM_HOME and cuda.pathfinder must agree)")
    if ours_version != theirs_version:
        return f"NVSHMEM versions disagree: nvrar sees {ours_version}, nvshmem4py {theirs_version} in {ours}"
    built_with = str(mod.build_info()["nvshmem_version"])
    why = version_mismatch(built_with, theirs_version)
    return f"nvshmem4py: {why}" if why else None


def nvshmem4py_initialized(core: Any) -> bool:
    """Whether nvshmem4py's own flag says it initialized NVSHMEM (its tensor() and collectives refuse
    to work otherwise, whatever the library's status)."""
    try:
        from nvshmem.core import _internal_tracking as tracking

        return bool(tracking._is_initialized["status"] == tracking.InternalInitStatus.INITIALIZED)
    except (ImportError, AttributeError, KeyError):
        return False


class Nvshmem4pyInit:
    """The NVSHMEM initialization nvrar makes through nvshmem4py, when nvshmem4py is installed and
    nothing in the process has initialized NVSHMEM yet: one per process, reference-counted by the
    communicators made over it; the last close() finalizes it (after nvrar's own references)."""

    lock = threading.Lock()
    users = 0
    live = False
    core: Any = None  # the nvshmem.core initialized, finalized by the last release

    @staticmethod
    def unique_id(core: Any) -> bytes:
        uid = core.get_unique_id()
        return bytes(ctypes.string_at(uid.ptr, uid._data.nbytes))

    @classmethod
    def init(cls, core: Any, device: int, rank: int, world: int, uid: bytes) -> None:
        """nvshmem.core.init(..., initializer_method="uid") on `device`, then the status checked:
        NVSHMEM 3.4.5 may return with NVSHMEM only bootstrapped (status 1). Raises NvrarError."""
        from cuda.core import Device

        from .errors import NvrarError

        mine = core.get_unique_id(empty=True)
        if len(uid) != mine._data.nbytes:
            raise NvrarError(f"nvshmem4py: rank 0 sent a unique id of {len(uid)} bytes, expected {mine._data.nbytes}")
        ctypes.memmove(mine.ptr, uid, len(uid))
        dev = Device(device)
        dev.set_current()  # a current context first: without one NVSHMEM only bootstraps
        try:
            core.init(device=dev, uid=mine, rank=rank, nranks=world, initializer_method="uid")
        except Exception as exc:  # noqa: BLE001 - NvshmemError / NvshmemInvalid, whatever the version
            raise NvrarError(f"nvshmem.core.init(initializer_method='uid', rank={rank}, nranks={world}) failed on "
                             f"device {device}: {type(exc).__name__}: {exc}; NVSHMEM_DEBUG=WARN says why") from exc
        status = int(core.init_status())
        if status < 2:  # NVSHMEM_STATUS_IS_INITIALIZED
            raise NvrarError(f"nvshmem.core.init returned but NVSHMEM's status is {status} (1: bootstrapped, not "
                             f"initialized) on device {device}; NVSHMEM_DEBUG=WARN says why")
        with cls.lock:
            cls.live = True
            cls.core = core

    @classmethod
    def acquire(cls) -> bool:
        """One more communicator over nvrar's nvshmem4py initialization, if there is one live."""
        with cls.lock:
            if cls.live:
                cls.users += 1
            return cls.live

    @classmethod
    def release(cls, finalize: bool) -> None:
        with cls.lock:
            cls.users -= 1
            last = cls.users == 0 and cls.live and finalize
            core = cls.core
            if last:
                cls.live = False
                cls.core = None
        if last and core is not None:
            core.finalize()  # collective: the last close() of every rank gets here


class Executor:
    """The GPU executor as the Communicator holds it: every attribute is the native executor's (the
    bound methods themselves: no cost per call), and close() / abandon() also drop the reference
    this communicator holds on nvrar's nvshmem4py initialization, after the native references."""

    __slots__ = ("_ex", "_n4p_ref", "__weakref__")

    def __init__(self, ex: Any, n4p_ref: bool) -> None:
        self._ex = ex
        self._n4p_ref = n4p_ref

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ex, name)

    def close(self) -> None:
        try:
            self._ex.close()  # nvshmem_free of the segment, then nvrar's own NVSHMEM reference
        finally:
            self._drop(finalize=True)

    def abandon(self) -> None:
        try:
            self._ex.abandon()  # not collective: nvshmem4py's initialization stays to the end of the process
        finally:
            self._drop(finalize=False)

    def _drop(self, finalize: bool) -> None:
        if self._n4p_ref:
            self._n4p_ref = False
            Nvshmem4pyInit.release(finalize)


def nvshmem4py_device(core: Any) -> Optional[int]:
    """The CUDA device nvshmem4py's init bound this process to (None if it has none recorded)."""
    try:
        from nvshmem.core import _internal_tracking as tracking

        dev = tracking._cached_device["device"]
        return None if dev is None else int(dev.device_id)
    except (ImportError, AttributeError, KeyError, TypeError, ValueError):
        return None
