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

__all__ = ["load", "load_error", "built"]

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
    try:
        from . import _cuda
    except ImportError as exc:
        _error = f"the GPU executor module does not load: {exc} (pip install nvidia-nvshmem-cu13)"
        return None, _error
    _module = _cuda
    return _module, None


def load_error() -> Optional[str]:
    return load()[1]
