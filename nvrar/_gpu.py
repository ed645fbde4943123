"""Loading the GPU executor module (nvrar._cuda), which exists only in builds made with nvcc.

The module needs NVSHMEM's host library (libnvshmem_host.so.3, from the nvidia-nvshmem-cu13
wheel). Its run path finds it beside an installed nvrar; for an editable install (or an
NVSHMEM elsewhere) it is loaded here first, from the wheel's directory or NVSHMEM_HOME.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from typing import Any, Optional, Tuple

__all__ = ["load", "built", "version_mismatch"]

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

