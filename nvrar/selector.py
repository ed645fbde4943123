"""Algorithm selection: the one place that decides which variant serves which message size.

The CPU executor applies the one-shot threshold chosen here to every call with ``algo="auto"``;
the decision depends only on values that are identical on every rank (world size, ranks per node,
message size, the table), so every rank picks the same variant. A mismatch would still be caught:
the variant is part of the call signature that every flag carries.
"""

from __future__ import annotations

from typing import Optional

from . import env

__all__ = ["VARIANTS", "NATIVE", "Table", "select", "default_choice", "variant_code", "oneshot_max_bytes",
           "cma_min_bytes", "cma_piece_bytes",
           "ll_max_bytes", "gpu_launch"]

# Codes shared with csrc/cpu/executor.h (Variant).
VARIANTS = {"auto": 0, "two-shot": 1, "one-shot": 2}


def variant_code(name: Optional[str]) -> int:
    """Code of a variant name; None means auto."""
    if name is None:
        return 0
    key = str(name).lower().replace("_", "-")
    if key not in VARIANTS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(VARIANTS)}")
    return VARIANTS[key]


# One-shot vs two-shot crossover of the CPU executor, in bytes, by ranks per node. One-shot reads
# G whole messages per rank but needs one synchronization less; two-shot moves about 2 messages
# per rank whatever G is (and pushes results straight into the peers' outputs). G = 2: one-shot
# wins up to 4 KB, two-shot from 8 KB on (measured with nvrar-bench --min-bytes 64 --max-bytes 32K
# --algos one-shot,two-shot, 2 ranks on a 2-core x86 host; that command, or `nvrar tune`, measures
# another machine). G = 1 has no intra-node
# phase, so both variants move the same bytes. Larger G: not measured here (more ranks than
# cores); 16 KB is a guess between the two costs.
_CPU_ONESHOT_MAX = {1: 1 << 20, 2: 4 << 10}
_CPU_ONESHOT_MAX_DEFAULT = 16 << 10


# GPU: one-shot reads G whole messages over NVLink per rank, two-shot 2 messages plus one more
# synchronization. Untuned defaults (no GPU measurement yet; `nvrar tune` writes measured tables):
# 256 KB up to 4 GPUs per node, 64 KB beyond.
_GPU_ONESHOT_MAX_SMALL_G, _GPU_ONESHOT_MAX = 256 << 10, 64 << 10


def oneshot_max_bytes(device: str, world_size: int, ranks_per_node: int) -> int:
    """Largest message (bytes) that the auto policy sends through the one-shot variant."""
    override = env.get_bytes("NVRAR_ONESHOT_MAX_BYTES")
    if override is not None:
        return override
    if device == "cpu":
        return _CPU_ONESHOT_MAX.get(ranks_per_node, _CPU_ONESHOT_MAX_DEFAULT)
    return _GPU_ONESHOT_MAX_SMALL_G if ranks_per_node <= 4 else _GPU_ONESHOT_MAX


# GPU launch: one CUDA block (one slice, own flags) per 32 KB of message, at most 16 blocks of
# 512 threads: a block moves 8 KB per pass (16 bytes a thread), so a slice is at most 4 passes;
# 64 KB runs on 2 blocks, 256 KB and more on 8-16 SMs (one block up to 256 KB left one SM's load
# and store bandwidth and one thread's sequential loads as the limit). Messages up to 32 KB stay
# on one block: fewest flags. Unmeasured on a GPU: scripts/gpu_check.sh's sweep is the check.
_GPU_LAUNCH = {"max_blocks": 16, "threads": 512, "block_bytes": 32 << 10}


def gpu_launch(device: str, ranks_per_node: int) -> dict:
    return dict(_GPU_LAUNCH)


# Smallest shard (bytes) that the CPU executor moves by cross-memory reads and writes (a system
# call each, which pins the pages) instead of staging it through the shared segment. Two-shot,
# 2 ranks, median us at 8K/16K/32K messages: threshold 4K 3.62/4.11/5.19, 8K 3.14/4.20/5.27,
# 32K 3.16/4.88/8.10 (NVRAR_CMA_MIN_BYTES=... nvrar-bench --algos two-shot --buffers ordinary).
_CPU_CMA_MIN = 8 << 10


def cma_min_bytes(device: str, ranks_per_node: int) -> int:
    override = env.get_bytes("NVRAR_CMA_MIN_BYTES")
    return _CPU_CMA_MIN if override is None else override


# Cross-memory transfers are split into pieces of this size (bytes), each fetched, reduced and
# pushed while it is in cache; whole shards of a few MB would spill a 2 MB L2 cache.
_CPU_CMA_PIECE = 128 << 10


def cma_piece_bytes(device: str, ranks_per_node: int) -> int:
    return _CPU_CMA_PIECE


# Inter-node shards up to this size travel as LL packets (protocol/ll.h): one network latency
# instead of two (data, then signal), at twice the bytes; above it put-with-signal. GPU: 32 KB, an
# untuned guess at where doubling the bytes costs more than a network latency (NVSHMEM puts on
# InfiniBand: ~2-3 us latency, ~45 GB/s: 32 KB more on the wire is ~0.7 us). CPU: off (flags in
# shared memory cost nothing); tests switch it on to run the GPU's LL logic on the CPU.
_GPU_LL_MAX = 32 << 10


def ll_max_bytes(device: str) -> int:
    override = env.get_bytes("NVRAR_LL_MAX_BYTES")
    if override is not None:
        return override
    return _GPU_LL_MAX if device == "cuda" else 0


# -- nvrar or the group's native backend ------------------------------------------------------

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16", "int32")
SUPPORTED_OPS = ("sum", "max", "min", "avg")
NATIVE = "native"

# Without a tuning table (nvrar tune): on the CPU nvrar beats gloo at every size measured (8 KB -
# 16 MB, README "Results on this machine"), so it serves every size. On GPUs the published NVRAR result covers
# multi-node 128 KB - 2 MB; on one node NCCL's NVLink algorithms are hard to beat, and above a few
# MB NCCL's ring is bandwidth-optimal: nvrar takes multi-node messages up to 2 MB, NCCL the rest,
# until `nvrar tune` measures the crossovers of the actual machine.
_GPU_DEFAULT_MAX_BYTES = 2 << 20


def default_choice(device: str, world_size: int, ranks_per_node: int, nbytes: int) -> str:
    """The variant ("auto" lets the executor pick one-shot/two-shot) or "native", without a table."""
    if device == "cpu":
        return "auto"
    if world_size // max(1, ranks_per_node) >= 2 and nbytes <= _GPU_DEFAULT_MAX_BYTES:
        return "auto"
    return NATIVE


def select(device: str, world_size: int, ranks_per_node: int, dtype: str, op: str, nbytes: int,
           table: Optional["Table"] = None) -> str:
    """The one decision of who serves an all-reduce: a variant name ("auto", "one-shot",
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
            if choice != NATIVE and choice not in VARIANTS:
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
