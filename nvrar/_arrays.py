"""Array adaptation: numpy arrays and torch tensors in, (pointer, count, dtype code) out.

The codes match csrc/protocol/types.h (DType, RedOp) and never change.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Tuple

import numpy as np

__all__ = [
    "DTYPE_FLOAT32", "DTYPE_FLOAT16", "DTYPE_BFLOAT16", "DTYPE_INT32",
    "OP_SUM", "OP_MAX", "OP_MIN", "OP_AVG",
    "op_code", "numpy_dtype_code", "torch_dtype_code", "torch_tensor_type", "SUPPORTED", "is_cupy", "cupy_info",
    "stream_handle",
]

DTYPE_FLOAT32, DTYPE_FLOAT16, DTYPE_BFLOAT16, DTYPE_INT32 = 0, 1, 2, 3
OP_SUM, OP_MAX, OP_MIN, OP_AVG = 0, 1, 2, 3

SUPPORTED = "float32, float16, bfloat16 (torch), int32"
OP_NAMES = {OP_SUM: "sum", OP_MAX: "max", OP_MIN: "min", OP_AVG: "avg"}
_OP_BY_NAME: Dict[str, int] = {"sum": OP_SUM, "max": OP_MAX, "min": OP_MIN, "avg": OP_AVG, "mean": OP_AVG}

_NUMPY_CODES: Dict[Any, int] = {
    np.dtype(np.float32): DTYPE_FLOAT32,
    np.dtype(np.float16): DTYPE_FLOAT16,
    np.dtype(np.int32): DTYPE_INT32,
}
ELEMENT_SIZE = {DTYPE_FLOAT32: 4, DTYPE_FLOAT16: 2, DTYPE_BFLOAT16: 2, DTYPE_INT32: 4}
DTYPE_NAMES = {DTYPE_FLOAT32: "float32", DTYPE_FLOAT16: "float16", DTYPE_BFLOAT16: "bfloat16", DTYPE_INT32: "int32"}

_torch_codes: Optional[Dict[Any, int]] = None


def _buffer_address(x: Any) -> int:
    from ._C import buffer_address  # bound on first use: importing _arrays needs no native module

    global _buffer_address
    _buffer_address = buffer_address  # type: ignore[assignment]  # the native function from now on
    return buffer_address(x)


def torch_tensor_type() -> Optional[type]:
    """torch.Tensor if torch is already imported (never imports torch itself)."""
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None) if torch is not None else None


def torch_dtype_code(dtype: Any) -> Optional[int]:
    global _torch_codes
    if _torch_codes is None:
        import torch

        _torch_codes = {
            torch.float32: DTYPE_FLOAT32,
            torch.float16: DTYPE_FLOAT16,
            torch.bfloat16: DTYPE_BFLOAT16,
            torch.int32: DTYPE_INT32,
        }
    return _torch_codes.get(dtype)


def numpy_dtype_code(dtype: Any) -> Optional[int]:
    return _NUMPY_CODES.get(dtype)


def op_code(op: Any) -> int:
    """Map "sum" | "max" | "min" | "avg" or a torch.distributed.ReduceOp to an op code."""
    if isinstance(op, str):
        code = _OP_BY_NAME.get(op.lower())
        if code is not None:
            return code
        raise ValueError(f"unknown op {op!r}; nvrar supports 'sum', 'max', 'min', 'avg'")
    name = getattr(op, "name", None)  # ReduceOp.RedOpType members
    if name is None and type(op).__name__ == "ReduceOp":  # ReduceOp instances compare to the members
        import torch.distributed as dist

        for member in ("SUM", "MAX", "MIN", "AVG"):
            if op == getattr(dist.ReduceOp, member):
                name = member
                break
        else:
            name = str(op)
    if isinstance(name, str) and name.lower() in _OP_BY_NAME:
        return _OP_BY_NAME[name.lower()]
    raise ValueError(f"unsupported op {op!r}; nvrar supports sum, max, min, avg (strings or torch.distributed.ReduceOp)")


def describe_dtype(x: Any) -> str:
    return str(getattr(x, "dtype", type(x).__name__)).replace("torch.", "")


def unsupported_dtype(x: Any, what: str) -> TypeError:
    return TypeError(f"all_reduce: {what} has dtype {describe_dtype(x)}, which nvrar does not reduce; supported: {SUPPORTED}")


def numpy_info(x: np.ndarray, what: str) -> Tuple[int, int, int]:
    """(pointer, element count, dtype code) of a numpy array, or a TypeError/ValueError."""
    code = _NUMPY_CODES.get(x.dtype)
    if code is None:
        raise unsupported_dtype(x, what)
    if not x.flags.c_contiguous:
        raise ValueError(f"all_reduce: {what} is not C-contiguous (shape {x.shape}, strides {x.strides}); "
                         "pass numpy.ascontiguousarray(...)")
    return _buffer_address(x), x.size, code


def torch_info(x: Any, what: str, device: str = "cpu", index: int = 0, write: bool = False) -> Tuple[int, int, int]:
    """(pointer, element count, dtype code) of a torch tensor, or a TypeError/ValueError; with
    ``write``, a CPU tensor in read-only memory is refused (a write there would be SIGSEGV)."""
    code = torch_dtype_code(x.dtype)
    if code is None:
        raise unsupported_dtype(x, what)
    if device == "cpu":
        if not x.is_cpu:
            raise ValueError(f"all_reduce: {what} is on device {x.device}, but this communicator runs on the CPU")
    elif not x.is_cuda or x.device.index != index:
        raise ValueError(f"all_reduce: {what} is on device {x.device}, but this communicator runs on cuda:{index}")
    if not x.is_contiguous():
        raise ValueError(f"all_reduce: {what} is not contiguous (shape {tuple(x.shape)}, strides {x.stride()}); "
                         "pass .contiguous()")
    if x.is_neg() or x.is_conj():
        raise ValueError(f"all_reduce: {what} is a lazily negated or conjugated view; pass .resolve_neg() / "
                         ".resolve_conj()")
    if write and device == "cpu" and x.numel() and not _torch_writable(x):
        raise ValueError(f"all_reduce: {what} lies in read-only memory (for example torch.from_numpy of a read-only "
                         f"numpy.memmap); pass a writeable tensor{' or out=' if what == 'x' else ''}")
    return x.data_ptr(), x.numel(), code


_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without writing; EINVAL/EFAULT if it cannot
_madvise: Any = None


def _torch_writable(x: Any) -> bool:
    """Whether the memory of CPU tensor ``x`` may be written. Storages of torch's own allocator
    (resizable) always may; others (from numpy, a buffer, a file) are probed: the first and last
    page through madvise(MADV_POPULATE_WRITE) (microseconds, nothing written), and where that
    refuses, the permissions of /proc/self/maps (exact)."""
    try:
        if x.untyped_storage().resizable():
            return True
    except (AttributeError, RuntimeError):
        pass
    return writable_range(x.data_ptr(), x.numel() * x.element_size())


def writable_range(ptr: int, nbytes: int) -> bool:
    global _madvise
    if not sys.platform.startswith("linux"):
        return True
    if _madvise is None:
        import ctypes
        import mmap

        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        _madvise = (fn, mmap.PAGESIZE)
    fn, page = _madvise
    first, last = ptr & ~(page - 1), (ptr + nbytes - 1) & ~(page - 1)
    if fn(first, page, _MADV_POPULATE_WRITE) == 0 and (last == first or fn(last, page, _MADV_POPULATE_WRITE) == 0):
        return True
    return _maps_writable(ptr, ptr + nbytes)


def _maps_writable(start: int, end: int) -> bool:
    """Every byte of [start, end) in a mapping with write permission (/proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return True  # cannot tell: the numpy-style flags were all there was to check
    pos = start
    for line in lines:
        span, perms = line.split()[:2]
        lo, hi = (int(v, 16) for v in span.split("-"))
        if hi <= pos or lo > pos:
            continue
        if "w" not in perms:
            return False
        pos = hi
        if pos >= end:
            return True
    return False


def is_cupy(x: Any) -> bool:
    return type(x).__module__.startswith("cupy")


def cupy_info(x: Any, what: str, index: int) -> Tuple[int, int, int]:
    code = _NUMPY_CODES.get(x.dtype)
    if code is None:
        raise unsupported_dtype(x, what)
    if x.device.id != index:
        raise ValueError(f"all_reduce: {what} is on cuda:{x.device.id}, but this communicator runs on cuda:{index}")
    if not x.flags.c_contiguous:
        raise ValueError(f"all_reduce: {what} is not C-contiguous; pass cupy.ascontiguousarray(...)")
    return int(x.data.ptr), int(x.size), code


def stream_handle(stream: Any) -> int:
    """A cudaStream_t as an int, from a torch.cuda.Stream, a cupy Stream or an int."""
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr"):
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return value
    raise TypeError(f"stream must be a torch.cuda.Stream, a cupy Stream or an int, got {type(stream).__name__}")
