"""Algorithm selection: the one place that decides which variant serves which message size.

The CPU executor applies the one-shot threshold chosen here to every call with ``algo="auto"``;
the decision depends only on values that are identical on every rank (world size, ranks per node,
message size, the table), so every rank picks the same variant. A mismatch would still be caught:
the variant is part of the call signature that every flag carries.
"""

from __future__ import annotations

from typing import Optional

from . import env

__all__ = ["VARIANTS", "variant_code", "oneshot_max_bytes", "cma_min_bytes", "cma_piece_bytes"]

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
# wins up to 4 KB, two-shot from 8 KB on (nvrar-bench --min-bytes 64 --max-bytes 32K --algos
# one-shot,two-shot, 2 ranks on a 2-core x86 host, README "Tuning"). G = 1 has no intra-node
# phase, so both variants move the same bytes. Larger G: not measured here (more ranks than
# cores); 16 KB is a guess between the two costs.
_CPU_ONESHOT_MAX = {1: 1 << 20, 2: 4 << 10}
_CPU_ONESHOT_MAX_DEFAULT = 16 << 10


def oneshot_max_bytes(device: str, world_size: int, ranks_per_node: int) -> int:
    """Largest message (bytes) that the auto policy sends through the one-shot variant."""
    override = env.get_bytes("NVRAR_ONESHOT_MAX_BYTES")
    if override is not None:
        return override
    if device == "cpu":
        return _CPU_ONESHOT_MAX.get(ranks_per_node, _CPU_ONESHOT_MAX_DEFAULT)
    return _CPU_ONESHOT_MAX_DEFAULT


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
