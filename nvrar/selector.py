"""Algorithm selection: who serves an all-reduce (nvrar, with which algorithm, or the group's
native backend), and the algorithm names and codes.

With ``algorithm="auto"`` the executor picks one-shot or two-shot by the one-shot threshold of
nvrar.settings (Settings.oneshot_max); every decision depends only on values that are identical on
every rank (world size, ranks per node, message size, the table), so every rank picks alike. A
mismatch would still be caught: the algorithm is part of the call signature that every flag carries.
"""

from __future__ import annotations

from typing import Optional

from . import _C
from .settings import ALGORITHM_NAMES, ALGORITHMS, GPU_NATIVE_ABOVE, algorithm_code, algorithm_name

__all__ = ["ALGORITHMS", "ALGORITHM_NAMES", "NATIVE", "Table", "select", "default_choice", "algorithm_code",
           "algorithm_name"]

# ALGORITHMS, ALGORITHM_NAMES, algorithm_code and algorithm_name are defined in nvrar.settings (the
# bottom of the package's import graph: settings.py imports nothing of nvrar that imports it back)
# and exported here as well.


# -- nvrar or the group's native backend ------------------------------------------------------

SUPPORTED_DTYPES = tuple(_C.DTYPE_CODES)
SUPPORTED_OPS = tuple(_C.OP_CODES)
NATIVE = "native"

# Without a tuning table (nvrar tune): on the CPU nvrar beats gloo at every size measured (8 KB -
# 16 MB), so it serves every size. On GPUs: multi-node messages up to settings.GPU_NATIVE_ABOVE,
# the group's NCCL the rest, until `nvrar tune` measures the crossovers of the actual machine.


def default_choice(device: str, world_size: int, ranks_per_node: int, nbytes: int) -> str:
    """The algorithm ("auto" lets the executor pick one-shot/two-shot) or "native", without a table."""
    if device == "cpu":
        return "auto"
    if world_size // max(1, ranks_per_node) >= 2 and nbytes <= GPU_NATIVE_ABOVE:
        return "auto"
    return NATIVE


def select(device: str, world_size: int, ranks_per_node: int, dtype: str, op: str, nbytes: int,
           table: Optional["Table"] = None) -> str:
    """The one decision of who serves an all-reduce: an algorithm name ("auto", "one-shot",
    "two-shot") or "native" (the process group's own backend: gloo on CPU, NCCL on GPU).

    Every argument is identical on every rank of a valid collective call (the table is checked
    to be identical when a communicator is created), so every rank decides alike.
    """
    if dtype not in SUPPORTED_DTYPES or op not in SUPPORTED_OPS:
        return NATIVE
    if table is not None:
        return table.choice(nbytes)
    return default_choice(device, world_size, ranks_per_node, nbytes)


class Table:
    """A tuned size table for one (device, world size, ranks per node): ascending buckets, each
    the largest message it covers (None: no limit) and its choice."""

    def __init__(self, device: str, world_size: int, ranks_per_node: int, buckets: list, source: str = "") -> None:
        self.device = device
        self.world_size = world_size
        self.ranks_per_node = ranks_per_node
        self.source = source
        if not isinstance(buckets, list) or not buckets:
            raise ValueError(f"tuning table {source}: no buckets")
        self.buckets = []
        for b in buckets:
            if not isinstance(b, dict) or set(b) != {"max_bytes", "choice"}:
                raise ValueError(f"tuning table {source}: a bucket must be {{max_bytes, choice}}, got {b!r}")
            limit, choice = b["max_bytes"], b["choice"]
            if limit is not None and (type(limit) is not int or limit < 0):
                raise ValueError(f"tuning table {source}: max_bytes must be a non-negative int or null, got {limit!r}")
            if choice != NATIVE and choice not in ALGORITHMS:
                raise ValueError(f"tuning table {source}: unknown choice {choice!r}")
            self.buckets.append((limit, str(choice)))
        limits = [lim for lim, _ in self.buckets if lim is not None]
        if any(a >= b for a, b in zip(limits, limits[1:])) or any(lim is None for lim, _ in self.buckets[:-1]):
            raise ValueError(f"tuning table {source}: limits must strictly ascend, and only the last may be unbounded")

    def choice(self, nbytes: int) -> str:
        for limit, choice in self.buckets:
            if limit is None or nbytes <= limit:
                return choice
        return NATIVE  # above the largest measured size

    def window(self) -> tuple:
        """(smallest, largest) message size served by nvrar; None where unbounded or empty."""
        lo = hi = None
        prev = 0
        for limit, choice in self.buckets:
            if choice != NATIVE:
                lo = prev if lo is None else lo
                hi = limit
            prev = (limit or 0) + 1
        return lo, hi

    def fingerprint(self) -> str:
        import hashlib
        import json

        data = json.dumps([self.device, self.world_size, self.ranks_per_node, self.buckets])
        return hashlib.sha256(data.encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return {"device": self.device, "world_size": self.world_size, "ranks_per_node": self.ranks_per_node,
                "buckets": [{"max_bytes": lim, "choice": c} for lim, c in self.buckets]}
