"""nvrar: a low-latency hierarchical all-reduce (NVRAR) for tensor-parallel LLM inference.

Public API:
    Communicator       the collective object (all_reduce, empty, close)
    NvrarError         every failure of a collective
    NvrarTimeoutError  a deadline passed, or a peer process exited
    build_info()       what the native module was built with
"""

from typing import Any, Dict

from .errors import NvrarError, NvrarTimeoutError
from .communicator import Communicator

__all__ = ["Communicator", "NvrarError", "NvrarTimeoutError", "build_info", "__version__"]

__version__ = "0.1.0"


def build_info() -> dict:
    """What nvrar was built with and can use here:

    ``{"cuda": bool, "nvshmem_version": str | None, "cuda_archs": [int], "cpu_executor": True,
    "nvshmem_library_version": str | None, "gpus": int, "cuda_error": str | None,
    "nvshmem4py_version": str | None}``.
    "cuda" is true when the GPU executor was built and loads (with or without a GPU present);
    "gpus" counts the CUDA devices it sees; "nvshmem4py_version" is the installed nvshmem4py's
    (read from its metadata, not imported), None when it is absent.
    """
    from . import _C  # noqa: F401 - the CPU executor is always there
    from ._gpu import load, nvshmem4py_version

    info: Dict[str, Any] = {"cuda": False, "nvshmem_version": None, "cuda_archs": [], "cpu_executor": True,
            "nvshmem_library_version": None, "gpus": 0, "cuda_error": None,
            "nvshmem4py_version": nvshmem4py_version()}
    mod, err = load()
    if mod is None:
        info["cuda_error"] = err
        return info
    info.update(mod.build_info())
    info["nvshmem_library_version"] = mod.nvshmem_library_version()
    info["gpus"], why = mod.device_count()
    if not info["gpus"]:
        info["cuda_error"] = f"no usable GPU: {why}"
    return info
