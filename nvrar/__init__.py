"""nvrar: a low-latency hierarchical all-reduce (NVRAR) for tensor-parallel LLM inference.

Public API:
    Communicator       the collective object (all_reduce, empty, close)
    NvrarError         every failure of a collective
    NvrarTimeoutError  a deadline passed, or a peer process exited
    build_info()       what the native module was built with
"""

from .errors import NvrarError, NvrarTimeoutError
from .communicator import Communicator

__all__ = ["Communicator", "NvrarError", "NvrarTimeoutError", "build_info", "__version__"]

__version__ = "0.1.0"


def build_info() -> dict:
    """What the native module was built with: {"cuda": bool, "nvshmem_version": str|None, "cuda_archs": [...], ...}."""
    from . import _C

    return dict(_C.build_info())
