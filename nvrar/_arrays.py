"""Array adaptation: numpy arrays, torch tensors and cupy arrays in, (pointer, count, dtype code)
out; the checks of out=; the dtype of empty().

The dtype and op codes are the native module's (csrc/protocol/types.h, exported by the bindings
as nvrar._C.DTYPE_CODES / OP_CODES / ELEMENT_SIZES): every table here is derived from them.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _C
from ._C import buffer_address as _buffer_address
from ._C import write_probe as _write_probe

__all__ = [
    "DTYPE_CODES", "DTYPE_NAMES", "OP_CODES", "ELEMENT_SIZE", "SUPPORTED",
    "op_code", "numpy_dtype_code", "torch_dtype_code", "torch_tensor_type", "is_cupy", "cupy_info",
    "stream_handle", "resolve_dtype", "CheckedTensors", "check_out_numpy", "check_out_torch", "check_out_cupy", "check_overlap",
]

DTYPE_CODES: Dict[str, int] = dict(_C.DTYPE_CODES)  # "float32" -> code
DTYPE_NAMES: Dict[int, str] = {code: name for name, code in DTYPE_CODES.items()}
OP_CODES: Dict[str, int] = dict(_C.OP_CODES)  # "sum" -> code
ELEMENT_SIZE: Dict[int, int] = dict(_C.ELEMENT_SIZES)  # code -> bytes

_NUMPY_LESS = ("bfloat16",)  # dtypes numpy does not have (torch only)
SUPPORTED = ", ".join(f"{n} (torch)" if n in _NUMPY_LESS else n for n in DTYPE_CODES)
_OP_BY_NAME: Dict[str, int] = {**OP_CODES, "mean": OP_CODES["avg"]}

_NUMPY_CODES: Dict[Any, int] = {np.dtype(n): c for n, c in DTYPE_CODES.items() if n not in _NUMPY_LESS}

_torch_codes: Optional[Dict[Any, int]] = None


def torch_tensor_type() -> Any:
    """torch.Tensor if torch is already imported (never imports torch itself)."""
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None) if torch is not None else None


def torch_dtype_code(dtype: Any) -> Optional[int]:
    global _torch_codes
    if _torch_codes is None:
        import torch

        _torch_codes = {getattr(torch, n): c for n, c in DTYPE_CODES.items()}
    return _torch_codes.get(dtype)


def numpy_dtype_code(dtype: Any) -> Optional[int]:
    return _NUMPY_CODES.get(dtype)


def op_code(op: Any) -> int:
    """Map "sum" | "max" | "min" | "avg" or a torch.distributed.ReduceOp to an op code."""
    if isinstance(op, str):
        code = _OP_BY_NAME.get(op.lower())
        if code is not None:
            return code
        raise ValueError(f"unknown op {op!r}; nvrar supports {', '.join(repr(n) for n in OP_CODES)}")
    name = getattr(op, "name", None)  # ReduceOp.RedOpType members
    if name is None and type(op).__name__ == "ReduceOp":  # ReduceOp instances compare to the members
        import torch.distributed as dist

        for member in (n.upper() for n in OP_CODES):
            if op == getattr(dist.ReduceOp, member):
                name = member
                break
        else:
            name = str(op)
    if isinstance(name, str) and name.lower() in _OP_BY_NAME:
        return _OP_BY_NAME[name.lower()]
    raise ValueError(f"unsupported op {op!r}; nvrar supports {', '.join(OP_CODES)} (strings or "
                     "torch.distributed.ReduceOp)")


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


class CheckedTensors:
    """CPU torch tensors that passed torch_info (in place, writeable), so that a call on the same
    tensor skips the checks: (pointer, count, dtype code) by tensor, or None.

    An entry serves only the very tensor it was made for, unchanged: it holds a weak reference
    (a tensor freed and another created at the same id or address is checked anew), and it is
    used only while the tensor's data pointer, byte size and dtype are those it was checked with
    and the tensor is still contiguous, so resize_, set_, as_strided_ and ``.data =`` all
    invalidate it. Storage from torch's own allocator (resizable) is always writeable; memory from
    numpy, a buffer or a file (and a tensor that shared its storage through .numpy()) can have
    its permissions changed without the tensor knowing, so its entry is marked to be probed
    (writable_range's first step, _C.write_probe) on every call; where the probe does not answer
    yes, the call takes the full checks. A few entries (decode's buffers); the table starts over
    when full.
    """

    _MAX = 16

    def __init__(self) -> None:
        self._entries: Dict[int, Tuple[Any, int, int, Any, int, int, bool]] = {}

    def get(self, x: Any) -> Optional[Tuple[int, int, int]]:
        # (Communicator.all_reduce inlines these checks on its hot path: change both together.)
        e = self._entries.get(id(x))
        if e is None or e[0]() is not x:
            return None
        if x.data_ptr() != e[1] or x.nbytes != e[2] or x.dtype is not e[3] or not x.is_contiguous():
            return None
        if e[6] and not _write_probe(e[1], e[2]):
            return None
        return e[1], e[4], e[5]

    def add(self, x: Any, ptr: int, count: int, code: int) -> None:
        try:
            if not x.is_cpu:
                return
            probe = not x.untyped_storage().resizable()
            ref = weakref.ref(x)
        except (AttributeError, RuntimeError, TypeError):
            return
        if len(self._entries) >= self._MAX:
            self._entries.clear()
        self._entries[id(x)] = (ref, ptr, x.nbytes, x.dtype, count, code, probe)

    def __len__(self) -> int:
        return len(self._entries)



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
    if not sys.platform.startswith("linux"):
        return True
    if _write_probe(ptr, nbytes):  # madvise(MADV_POPULATE_WRITE), first and last page (in C++: cheap)
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


# -- out= ----------------------------------------------------------------------------------------
def check_overlap(ptr: int, optr: int, nbytes: int) -> None:
    if optr != ptr and optr < ptr + nbytes and ptr < optr + nbytes:
        raise ValueError("all_reduce: out partially overlaps x; use out=None for in place, or a separate buffer")


def check_out_numpy(x: np.ndarray, out: Any, ptr: int, count: int) -> int:
    """The address of ``out`` for numpy ``x`` (same shape, dtype, kind; writeable; no partial overlap)."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"all_reduce: out must be a numpy.ndarray like x, got {type(out).__name__}")
    if out.shape != x.shape:
        raise ValueError(f"all_reduce: out has shape {out.shape} but x has shape {x.shape}")
    if out.dtype != x.dtype:
        raise TypeError(f"all_reduce: out has dtype {out.dtype} but x has dtype {x.dtype}")
    if not out.flags.writeable:
        raise ValueError("all_reduce: out is read-only")
    optr, _, _ = numpy_info(out, "out")
    check_overlap(ptr, optr, count * x.itemsize)
    return optr


def check_out_torch(x: Any, out: Any, ptr: int, count: int, device: str = "cpu", index: int = 0) -> int:
    """The address of ``out`` for torch tensor ``x`` (same shape, dtype, kind, device; no partial overlap)."""
    tensor = torch_tensor_type()
    if tensor is None or not isinstance(out, tensor):
        raise TypeError(f"all_reduce: out must be a torch.Tensor like x, got {type(out).__name__}")
    if out.shape != x.shape:
        raise ValueError(f"all_reduce: out has shape {tuple(out.shape)} but x has shape {tuple(x.shape)}")
    if out.dtype != x.dtype:
        raise TypeError(f"all_reduce: out has dtype {out.dtype} but x has dtype {x.dtype}")
    if device == "cuda":
        optr, _, _ = torch_info(out, "out", device="cuda", index=index)
    else:
        optr, _, _ = torch_info(out, "out", write=True)
    check_overlap(ptr, optr, count * x.element_size())
    return optr


def check_out_cupy(x: Any, out: Any, ptr: int, count: int, index: int) -> int:
    if not is_cupy(out) or out.shape != x.shape or out.dtype != x.dtype:
        raise TypeError("all_reduce: out must be a cupy array of x's shape and dtype")
    optr, _, _ = cupy_info(out, "out", index)
    check_overlap(ptr, optr, count * x.itemsize)
    return optr


# -- empty() -------------------------------------------------------------------------------------
def _is_bfloat16_name(dtype: Any) -> bool:
    return isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16")


def resolve_dtype(dtype: Any) -> Tuple[str, Any, int, int]:
    """(kind, library dtype, code, itemsize) for empty(): kind "torch" for a torch dtype (or
    "bfloat16"), else "numpy"."""
    torch_mod = sys.modules.get("torch")
    if torch_mod is None and _is_bfloat16_name(dtype):
        try:
            import torch as torch_mod  # bfloat16 needs torch
        except ImportError:
            torch_mod = None
    if torch_mod is not None:
        if _is_bfloat16_name(dtype):
            dtype = torch_mod.bfloat16
        if isinstance(dtype, torch_mod.dtype):
            code = torch_dtype_code(dtype)
            if code is None:
                raise TypeError(f"empty: dtype {dtype} is not supported; supported: {SUPPORTED}")
            return "torch", dtype, code, ELEMENT_SIZE[code]
    if _is_bfloat16_name(dtype):
        raise TypeError("empty: bfloat16 needs torch (pip install torch); numpy has no bfloat16")
    try:
        npd = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"empty: {dtype!r} is not a dtype; supported: {SUPPORTED}") from None
    code = numpy_dtype_code(npd)
    if code is None:
        raise TypeError(f"empty: dtype {npd} is not supported; supported: {SUPPORTED}")
    return "numpy", npd, code, npd.itemsize
