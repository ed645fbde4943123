"""Communicator.all_reduce_add_rms_norm: argument checks and the executor call (CPU: numpy arrays
or CPU tensors; GPU: CUDA tensors on the communicator's device, on the current torch stream), plus
the fp32 reference math shared by the torch fallback and the tests.

The numerics (NOTE [fused add + RMSNorm] in csrc/protocol/epilogue.h): s = all_reduce_sum(x)
(rounded once to the dtype, as Communicator.all_reduce gives it); residual <- dtype(residual +
s) in fp32; x <- dtype(residual * 1/sqrt(mean(residual^2) + eps) * weight) in fp32, where the
norm reads the rounded new residual (vLLM's fused_add_rms_norm).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import numpy as np

from . import _arrays, selector
from .errors import NvrarError

_FLOAT_CODES = tuple(_arrays.DTYPE_CODES[n] for n in ("float32", "float16", "bfloat16"))
_NAME = "all_reduce_add_rms_norm"


def _info(comm: Any, a: Any, what: str, write: bool) -> Tuple[int, int, int]:
    try:
        if isinstance(a, np.ndarray):
            if write and not a.flags.writeable:
                raise ValueError(f"all_reduce: {what} is read-only")
            return _arrays.numpy_info(a, what)
        if comm._device == "cuda":
            return _arrays.torch_info(a, what, device="cuda", index=comm._cuda_device, write=write)
        return _arrays.torch_info(a, what, write=write)
    except (TypeError, ValueError) as exc:
        raise type(exc)(str(exc).replace("all_reduce:", f"{_NAME}:", 1)) from None


def _shape(a: Any) -> Tuple[int, ...]:
    return tuple(int(d) for d in a.shape)


def check_args(comm: Any, x: Any, residual: Any, weight: Any, eps: Any) -> Tuple[int, int, int, int, int, int, float]:
    """(x ptr, residual ptr, weight ptr, rows, h, dtype code, eps), or TypeError/ValueError, before
    any communication."""
    tensor = _arrays.torch_tensor_type()
    kinds = []
    for what, a in (("x", x), ("residual", residual), ("weight", weight)):
        if isinstance(a, np.ndarray):
            kinds.append("numpy")
        elif tensor is not None and isinstance(a, tensor):
            kinds.append("torch")
        else:
            raise TypeError(f"{_NAME}: {what} must be a numpy.ndarray or a torch.Tensor, got {type(a).__name__}")
    if len(set(kinds)) != 1:
        raise TypeError(f"{_NAME}: x, residual and weight must be of one kind, got {', '.join(kinds)}")
    if comm._device == "cuda" and kinds[0] != "torch":
        raise TypeError(f"{_NAME}: a device='cuda' communicator takes torch CUDA tensors, got numpy arrays")
    if x.dtype != residual.dtype or x.dtype != weight.dtype:
        raise TypeError(f"{_NAME}: x, residual and weight must have one dtype, got {_arrays.describe_dtype(x)}, "
                        f"{_arrays.describe_dtype(residual)}, {_arrays.describe_dtype(weight)}")
    if len(_shape(x)) < 1:
        raise ValueError(f"{_NAME}: x must have shape (..., h), got a 0-d array")
    if _shape(x) != _shape(residual):
        raise ValueError(f"{_NAME}: residual has shape {_shape(residual)} but x has shape {_shape(x)}")
    h = _shape(x)[-1]
    if _shape(weight) != (h,):
        raise ValueError(f"{_NAME}: weight must have shape ({h},) (the last dimension of x), got {_shape(weight)}")
    if h < 1:
        raise ValueError(f"{_NAME}: the hidden size (last dimension of x) must be >= 1, got {h}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{_NAME}: eps must be a finite number >= 0, got {eps!r}")
    xp, count, code = _info(comm, x, "x", True)
    if code not in _FLOAT_CODES:
        raise TypeError(f"{_NAME}: dtype {_arrays.describe_dtype(x)} is not supported; float32, float16, bfloat16")
    rp, _, _ = _info(comm, residual, "residual", True)
    wp, _, _ = _info(comm, weight, "weight", False)
    nbytes = count * _arrays.ELEMENT_SIZE[code]
    spans = {"x": (xp, nbytes), "residual": (rp, nbytes), "weight": (wp, h * _arrays.ELEMENT_SIZE[code])}
    names = list(spans)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            (pa, na), (pb, nb) = spans[a], spans[b]
            if na and nb and pa < pb + nb and pb < pa + na:
                raise ValueError(f"{_NAME}: {a} and {b} overlap in memory; they must be separate buffers")
    return xp, rp, wp, count // h, h, code, float(np.float32(eps))


def all_reduce_add_rms_norm(comm: Any, x: Any, residual: Any, weight: Any, eps: float = 1e-6,
                            algorithm: Optional[str] = None) -> Tuple[Any, Any]:
    ex = comm._ex
    if ex is None:
        raise NvrarError(f"{_NAME}: the communicator is closed")
    xp, rp, wp, rows, h, code, e32 = check_args(comm, x, residual, weight, eps)
    acode = comm._algorithm if algorithm is None else selector.algorithm_code(algorithm)
    if comm._device == "cuda":
        import torch

        stream = torch.cuda.current_stream(x.device)
        ex.all_reduce_add_rms_norm(xp, rp, wp, rows, h, code, e32, acode, _arrays.stream_handle(stream))
        return x, residual
    ex.all_reduce_add_rms_norm(xp, rp, wp, rows, h, code, e32, acode)
    return x, residual


def reference(s: Any, residual: Any, weight: Any, eps: float) -> Tuple[Any, Any]:
    """The unfused math in torch, on the all-reduced sum ``s``: (x, new residual), new tensors.
    Correctly rounded fp32 operations in the order of NOTE [fused add + RMSNorm]: the mean of
    squares over 32 strided lanes added in order, then a fixed pairwise tree."""
    import torch

    # Every fp32 operation is done in float64 and rounded to fp32: correctly rounded (53 >= 2 * 24
    # + 2 bits), whereas torch's own fp32 sqrt on the CPU can be off by one ulp.
    def f32(t: Any) -> Any:
        return t.float().double()

    r = (residual.double() + s.double()).to(residual.dtype)
    rf = r.double()
    h = rf.shape[-1]
    sq = f32(rf * rf)
    lanes = 32
    pad = (-h) % lanes
    if pad:
        sq = torch.cat([sq, sq.new_zeros(*sq.shape[:-1], pad)], dim=-1)
    sq = sq.reshape(*sq.shape[:-1], -1, lanes)
    p = sq.new_zeros(*sq.shape[:-2], lanes)
    for k in range(sq.shape[-2]):
        p = f32(p + sq[..., k, :])
    o = lanes // 2
    while o:
        p = f32(p[..., :o] + p[..., o:2 * o])
        o //= 2
    ms = f32(p / float(h))
    inv = f32(1.0 / f32(torch.sqrt(f32(ms + float(np.float32(eps))))))
    return f32(f32(rf * inv) * weight.double()).to(residual.dtype), r
