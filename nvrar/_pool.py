"""The zero-copy pool behind Communicator.empty(): a first-fit allocator over the executor's
symmetric heap, the blocks that expose its memory to numpy / torch / cupy, and empty() itself."""

from __future__ import annotations

import bisect
import collections
import math
import threading
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _arrays
from .errors import NvrarError

__all__ = ["PoolAllocator", "empty"]

_POOL_ALIGN = 256  # bytes; every empty() block starts on this boundary


class _Block:
    """One empty() allocation: its array interface feeds numpy, its lifetime frees the bytes."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class _CudaBlock:
    """empty() on the GPU: a device allocation exposed through __cuda_array_interface__."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None}


class PoolAllocator:
    """First-fit allocator over the zero-copy pool (offsets in bytes).

    Blocks come back through weakref finalizers, which can run inside any allocation (a garbage
    collection) -- also inside alloc() itself, with the lock held. So a finalizer never takes the
    lock: it queues the block (deque.append is atomic) and the next alloc() or drain() returns it.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: List[Tuple[int, int]] = [(0, size)]  # sorted (offset, length)
        self._lock = threading.Lock()
        self._returned: "collections.deque[Tuple[int, int]]" = collections.deque()
        self._allocated = 0  # blocks handed out, ever
        self._released = 0   # blocks returned, ever (under the lock)

    @staticmethod
    def _rounded(nbytes: int) -> int:
        return max(_POOL_ALIGN, (nbytes + _POOL_ALIGN - 1) // _POOL_ALIGN * _POOL_ALIGN)

    def _drain_locked(self) -> None:
        while self._returned:
            off, need = self._returned.popleft()
            bisect.insort(self._free, (off, need))
            self._released += 1
        merged: List[Tuple[int, int]] = []
        for o, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        self._free = merged

    def alloc(self, nbytes: int) -> Optional[int]:
        need = self._rounded(nbytes)
        with self._lock:
            self._drain_locked()
            for i, (off, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = (off + need, length - need)
                    self._allocated += 1
                    return off
        return None

    def release(self, off: int, nbytes: int) -> None:
        """From a finalizer: lock-free."""
        self._returned.append((off, self._rounded(nbytes)))

    def live(self) -> int:
        """Blocks still out (drains what came back, if the lock is free now)."""
        if self._lock.acquire(blocking=False):
            try:
                self._drain_locked()
            finally:
                self._lock.release()
        return self._allocated - self._released - len(self._returned)

    def largest_free(self) -> int:
        with self._lock:
            self._drain_locked()
            return max((n for _, n in self._free), default=0)


def empty(pool: PoolAllocator, base: int, shape: Union[int, Sequence[int]], dtype: Any, device: str,
          cuda_device: int, release: Callable[[PoolAllocator, int, int], None]) -> Any:
    """An uninitialized array of ``shape`` and ``dtype`` in the pool at address ``base``; when its
    last view is gone, ``release(pool, offset, nbytes)`` runs (a weakref finalizer)."""
    shape_t = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    if any(s < 0 for s in shape_t):
        raise ValueError(f"empty: negative dimension in shape {shape_t}")
    kind, dt, _, itemsize = _arrays.resolve_dtype(dtype)
    nbytes = math.prod(shape_t) * itemsize  # exact: a product that overflows int64 is just too large
    off = pool.alloc(nbytes)
    if off is None:
        raise NvrarError(
            f"empty: shape {shape_t} of {dt} needs {nbytes} bytes, and the symmetric heap has no free block of "
            f"that size (pool {pool.size} bytes, "
            f"largest free {pool.largest_free()}); pass heap_bytes= or set NVRAR_HEAP_BYTES"
        )
    if device == "cuda":
        cblock = _CudaBlock(base + off, nbytes)
        weakref.finalize(cblock, release, pool, off, nbytes)
        if kind == "numpy":  # a numpy dtype on a GPU communicator: a cupy array
            import cupy

            with cupy.cuda.Device(cuda_device):
                return cupy.asarray(cblock).view(dt).reshape(shape_t)
        import torch

        raw_t = torch.as_tensor(cblock, device=f"cuda:{cuda_device}")
        return raw_t.view(dt).reshape(shape_t)
    block = _Block(base + off, nbytes)
    weakref.finalize(block, release, pool, off, nbytes)
    raw = np.asarray(block)
    if kind == "numpy":
        return raw.view(dt).reshape(shape_t)
    import torch

    return torch.from_numpy(raw).view(dt).reshape(shape_t)
