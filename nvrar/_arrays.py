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
    _buffer_address = buffer_address
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


def torch_info(x: Any, what: str, device: str = "cpu", index: int = 0) -> Tuple[int, int, int]:
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
    return x.data_ptr(), x.numel(), code


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
