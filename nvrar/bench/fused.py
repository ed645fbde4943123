"""nvrar-bench row of the fused all-reduce + residual add + RMSNorm (backend "nvrar", algorithm
"add-rms-norm"): Communicator.all_reduce_add_rms_norm on rows of h elements, beside the plain
all-reduce at the same sizes. Verified through the residual: it starts at zero, so afterwards it
holds the all-reduced sum, compared exactly like every other row."""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from .backends import _HostArrays

FUSED_ALGO = "add-rms-norm"
HIDDEN = 4096  # row length (elements) of the fused rows; smaller messages are one row


class _Bufs:
    def __init__(self, x: Any, residual: Any, weight: Any) -> None:
        self.x, self.residual, self.weight = x, residual, weight


class NvrarFusedBackend(_HostArrays):
    name = "nvrar"
    algorithm = FUSED_ALGO

    def __init__(self, comm: Any, hidden: int = HIDDEN) -> None:
        self.comm = comm
        self.hidden = hidden
        self.skip_reason = None if comm.device == "cpu" else "the fused call runs on CPU communicators only"

    def supports(self, dtype: str, op: str) -> Optional[str]:
        if op != "sum":
            return "the fused call reduces with sum"
        if dtype not in ("float32", "float16", "bfloat16"):
            return "the fused call takes float32, float16, bfloat16"
        return self.skip_reason

    def alloc(self, count: int, dtype: str) -> Any:
        h = math.gcd(count, self.hidden) if count >= self.hidden else count
        x = super().alloc(count, dtype)
        w = super().alloc(h, dtype)
        super().fill(w, np.ones(h))
        return _Bufs(x.reshape(-1, h), super().alloc(count, dtype).reshape(-1, h), w)

    def fill(self, buf: Any, values: np.ndarray) -> None:
        super().fill(buf.x, values.reshape(buf.x.shape))
        super().fill(buf.residual, np.zeros(buf.x.shape))

    def read(self, buf: Any) -> np.ndarray:
        return super().read(buf.residual).reshape(-1)

    def call(self, buf: Any, op: str) -> None:
        self.comm.all_reduce_add_rms_norm(buf.x, buf.residual, buf.weight)
