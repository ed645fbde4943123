"""Every setting of a Communicator and its default, defined once.

A setting comes from the constructor's argument, else from its NVRAR_* variable, else from the
defaults below (nvrar.env.resolve reads them in that order). The native executors have no
defaults of their own: nvrar passes every value explicitly (nvrar/_setup.py), and the texts of
nvrar.env.VARIABLES are derived from these constants. This module imports nothing else of nvrar
but the native module (its algorithm codes): env.py and selector.py build on it, never the
other way round, so that the package's import graph has no cycle (tests/test_imports.py).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Dict, Optional

from . import _C

__all__ = ["Settings", "check_arguments", "algorithm_code", "algorithm_name", "ALGORITHMS", "ALGORITHM_NAMES", "check_timeout", "size_text", "per_device_text",
           "MAX_BYTES", "HEAP_BYTES", "TIMEOUT_S", "MAX_TIMEOUT_S", "MIN_MAX_BYTES", "ALGORITHM",
           "CPU_ONESHOT_MAX", "CPU_ONESHOT_MAX_DEFAULT", "CPU_ONESHOT_ADAPT_MAX", "GPU_ONESHOT_MAX_SMALL_G", "GPU_ONESHOT_MAX",
           "GPU_ONESHOT_MAX_NODES", "GPU_ONESHOT_MAX_MANY_NODES_LARGE_G",
           "GPU_NATIVE_ABOVE", "GPU_LAUNCH", "GPU_MAX_CHANNELS", "CMA_MIN_BYTES", "CMA_MIN_BYTES_OVERSUBSCRIBED", "cpu_cma_min_bytes", "CMA_PIECE_BYTES", "LL_MAX_BYTES", "HD_MIN_BYTES", "HD_MIN_BYTES_HOSTS", "STREAM_STAGING", "STREAM_STAGING_CODES", "AGREED"]

DEVICES = ("cpu", "cuda")

# Per executor: the largest chunk of one round, and the zero-copy pool behind empty() (bytes).
# CPU: 1 MB, so that a round's staging, shards and results stay in cache; on an AMD EPYC host
# (family 25, 2 cores, AVX2, KVM guest, 2026-12-03) 2 ranks, cold, three alternated runs of
# 1 MB against 4 MB rounds, median us: 4 MB messages 271-313 against 445-522, 8 MB 664-788
# against 933-1376, 2 MB level (143-221 against 142-213); an extra round costs two flag waits.
MAX_BYTES: Dict[str, int] = {"cpu": 1 << 20, "cuda": 16 << 20}
HEAP_BYTES: Dict[str, int] = {"cpu": 32 << 20, "cuda": 64 << 20}
MIN_MAX_BYTES = 256  # a smaller round could not hold one 16-byte cell per rank of a node
TIMEOUT_S = 60.0  # deadline of every wait, and of the bootstrap
MAX_TIMEOUT_S = 1e6  # ~11.6 days: any longer deadline is a mistake, and overflows nanosecond clocks
ALGORITHM = "auto"

# Algorithm name -> code, as the native module defines them (csrc/protocol/types.h Algorithm).
ALGORITHMS: Dict[str, int] = dict(_C.ALGORITHM_CODES)
ALGORITHM_NAMES: Dict[int, str] = {code: name for name, code in ALGORITHMS.items()}


def algorithm_code(name: Optional[str]) -> int:
    """Code of an algorithm name ("auto", "one-shot", "two-shot"); None means auto."""
    if name is None:
        return ALGORITHMS["auto"]
    key = str(name).lower().replace("_", "-")
    if key not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}")
    return ALGORITHMS[key]


def algorithm_name(code: int) -> str:
    return ALGORITHM_NAMES[code]
SECRET_BYTES = 16  # the session secret rank 0 draws at setup (csrc/cpu/executor.h kSecretBytes)

# One-shot vs two-shot crossover of the CPU executor, in bytes, by ranks per node. One-shot reads
# G whole messages per rank but needs one synchronization less; two-shot moves about 2 messages
# per rank whatever G is (and pushes results straight into the peers' outputs). G = 2: one-shot
# up to 128 KB, two-shot from 256 KB on. Since its stage-in may stream (NOTE [streaming stage-in],
# csrc/cpu/executor.cpp), one-shot is the faster up to 128 KB in both of the states of the AMD EPYC
# host (family 25, 2 cores, AVX2, KVM guest; 2026-12-04 13:45-13:49 UTC, `mpirun -n 2 --oversubscribe
# python benchmarks/stage_in.py algorithms [--busy] --sizes 32K,64K,128K,256K`, five interleaved
# rounds of 150 cold calls, medians in us, one-shot / two-shot): with a cache line crossing between
# the CPUs in about 140 ns, 32K 4.02/4.87, 64K 6.35/7.58, 128K 10.28/11.27, 256K 20.48/18.42, and
# beside a spinning process 6.85/7.28, 9.99/10.61, 14.54/15.17, 25.85/23.50 (another busy run:
# 7.09/7.56, 10.40/10.29, 15.14/16.32, 27.00/23.38); with it crossing in about 560 ns, 9.14/17.52,
# 13.20/20.47, 25.34/34.75, 44.51/55.45. So 256 KB, where the fast state has two-shot 10-14% ahead,
# stays two-shot by this table, and is one of the sizes CPU_ONESHOT_ADAPT_MAX below lets the node
# leader's timing decide. (Before streaming stage-ins the threshold was 32 KB: plain one-shot lost to
# two-shot at 64 KB in the slow state, 1.13-1.16x.) Every rank must pick the same algorithm, so the
# threshold cannot follow one rank's buffers. G = 1 has no intra-node phase, so both variants move
# the same bytes. Larger G: not measured here (more ranks than cores); 16 KB is a guess between the
# two costs. `nvrar tune` measures another machine.
CPU_ONESHOT_MAX: Dict[int, int] = {1: 1 << 20, 2: 128 << 10}
CPU_ONESHOT_MAX_DEFAULT = 16 << 10
# NOTE [one-shot or two-shot] (csrc/cpu/executor.cpp): auto calls above CPU_ONESHOT_MAX and up to
# this size (bytes), in a job of one node, take the algorithm the node's leader measures faster,
# the other tried now and then. G = 2, the same host and date as above (`stage_in.py algorithms
# --sizes 128K,256K,512K,1M`, 20:50 UTC, medians of four rounds in us, one-shot / two-shot): a line
# crossing in 129-140 ns, 256K 19.19/18.08, 512K 36.27/34.03, 1M 67.60/63.75; beside a spinning
# process with it crossing in 552-557 ns, 31.77/35.28, 58.06/67.82, 116.32/133.07. From 2 MB
# two-shot's half-size reductions win in both states (docs/results.md). Other G: not measured (0:
# the table alone). NVRAR_ONESHOT_ADAPT_MAX_BYTES sets it (0: off); an explicit
# NVRAR_ONESHOT_MAX_BYTES turns it off unless that is set too.
CPU_ONESHOT_ADAPT_MAX: Dict[int, int] = {2: 1 << 20}

# GPU: one-shot reads G whole messages over NVLink per rank, two-shot 2 messages plus one more
# synchronization. Untuned defaults (no GPU measurement yet; `nvrar tune` writes measured tables):
# on one node 256 KB up to 4 GPUs per node, 64 KB beyond.
GPU_ONESHOT_MAX_SMALL_G, GPU_ONESHOT_MAX = 256 << 10, 64 << 10
# Across nodes one-shot sends the whole message at every inter-node step (G times two-shot's shard)
# to save the reduce-scatter's NVLink phase; the wire model (nvrar model, h100-ndr-ibgda, over the
# emulated ledgers of both algorithms, docs/gpu/wire-model.md "How the defaults were chosen") has it
# faster only for the smallest messages: at 16 KB on 2x4, 2x8 and 4x2 (2x4: one-shot/LL 7.24 us,
# two-shot/LL 7.65), slower from 32 KB on two nodes (2x4 32 KB: 8.08 vs 7.90) and at 16 KB on 4x4
# (10.74 vs 10.63). So: 16 KB on two nodes, and with more nodes (more steps, each carrying the whole
# message) 16 KB up to 2 GPUs per node and 8 KB beyond. The budget's cells (2x4, 2x8, 4x2 at 128 KB
# and more) go two-shot, the model's fastest there (tests/test_wire_budget.py).
GPU_ONESHOT_MAX_NODES, GPU_ONESHOT_MAX_MANY_NODES_LARGE_G = 16 << 10, 8 << 10

# Without a tuning table (nvrar tune): on GPUs the published NVRAR result covers multi-node
# 128 KB - 2 MB; on one node NCCL's NVLink algorithms are hard to beat, and above a few MB NCCL's
# ring is bandwidth-optimal: nvrar takes multi-node messages up to this size, NCCL the rest
# (nvrar.selector.default_choice).
GPU_NATIVE_ABOVE = 2 << 20

# GPU launch: one CUDA block (one slice, own flags) per 32 KB of message, at most 16 blocks of
# 512 threads: a block moves 8 KB per pass (16 bytes a thread), so a slice is at most 4 passes;
# 64 KB runs on 2 blocks, 256 KB and more on 8-16 SMs (one block up to 256 KB left one SM's load
# and store bandwidth and one thread's sequential loads as the limit). Messages up to 32 KB stay
# on one block: fewest flags. Unmeasured on a GPU: scripts/gpu_check.sh's sweep is the check.
#
# channels: messages per peer per inter-node step (NOTE [channels], csrc/cuda/device.cuh): the
# blocks' slices are gathered into this many put-with-signal or LL messages, 1 to 4. Chosen by the
# wire model over the ledgers of 2x8 512 KB bf16 with 1, 2 and 4 channels
# (docs/gpu/ledgers/candidates/2x8-512K-channels-*.json; docs/gpu/wire-model.md, "How the defaults
# were chosen"): 1 is the fastest on every transport (h100-ndr-ibgda 12.55 / 12.85 / 13.45 us,
# h100-ndr-ibrc 60.25 / 61.25 / 63.25, a100-slingshot 31.42 / 41.43 / 61.44): a step's messages
# leave in parallel but each costs a post or a proxy command, and the model credits no bandwidth to
# more of them. NVRAR_GPU_CHANNELS overrides it.
GPU_LAUNCH: Dict[str, int] = {"max_blocks": 16, "threads": 512, "block_bytes": 32 << 10, "channels": 1}
GPU_MAX_CHANNELS = 4  # kMaxChannels (device.cuh)

# Smallest shard (bytes) that the CPU executor moves by cross-memory reads and writes (a system
# call each, which pins the pages) instead of staging it through the shared segment. Two-shot,
# 2 ranks, median us at 8K/16K/32K messages: threshold 4K 3.62/4.11/5.19, 8K 3.14/4.20/5.27,
# 32K 3.16/4.88/8.10 (NVRAR_CMA_MIN_BYTES=... nvrar-bench --algorithms two-shot --buffers ordinary).
CMA_MIN_BYTES = 8 << 10

# With more ranks on the host than cores, small cross-memory transfers lose to staging through the
# segment, large ones win. A process_vm_readv or writev is a system call that pins the peer's
# pages, six of them per piece at G = 4; a staged shard is plain loads from shared memory, but it
# is copied twice (stage-in, then the reducer's read; the result likewise) where a cross-memory
# piece is fetched into a scratch buffer in L2, reduced there and pushed once. 4 ranks on 2 cores,
# cold, nvrar time / MPI_Allreduce time, three alternated runs each (nvrar-bench --ranks 4 --timing
# cold --buffers ordinary --backends nvrar,mpi, NVRAR_CMA_MIN_BYTES=... against unset = staged):
# staged 0.70-0.76 at 1 MB, 0.67-0.77 at 2 MB, 0.70-0.73 at 4 MB, 0.71-0.86 at 8 MB; cross-memory
# from 256 KB shards 0.61-0.67, 0.58-0.64, 0.54-0.66, 0.49-0.60 (docs/results.md, runs of 2026-12-02 00:25-01:20 UTC);
# smaller shards by cross-memory no better (128 KB shards: 0.46-0.82 against 0.49-0.75 staged at
# 256 KB messages; an earlier host, 32K-512K messages: 0.79-1.23 against 0.45-0.86). So there,
# unless NVRAR_CMA_MIN_BYTES is set, smaller shards are staged (cpu_cma_min_bytes) and from this
# size the node's leader times both ways and its ranks take the faster (NOTE [cross-memory or
# staged], csrc/cpu/executor.cpp: on the same host on 2026-12-03, 1 MB at 4 ranks, staged took
# 0.45x the time of cross-memory).
CMA_MIN_BYTES_OVERSUBSCRIBED = 256 << 10


def cpu_cma_min_bytes(st: "Settings", ranks_on_host: int, cores: int, explicit: bool) -> int:
    """The cross-memory threshold a CPU executor is built with: ``st.cma_min_bytes``, except with
    more ranks on the host than cores and no explicit NVRAR_CMA_MIN_BYTES, where it is
    CMA_MIN_BYTES_OVERSUBSCRIBED (smaller shards are staged through the segment)."""
    if explicit or ranks_on_host <= cores:
        return st.cma_min_bytes
    return max(st.cma_min_bytes, CMA_MIN_BYTES_OVERSUBSCRIBED)


# Cross-memory transfers are split into pieces of this size (bytes), each fetched, reduced and
# pushed while it is in cache; whole shards of a few MB would spill a 2 MB L2 cache.
CMA_PIECE_BYTES = 128 << 10

# Inter-node shards up to this size travel as LL packets (protocol/ll.h): one network latency
# instead of two (data, then signal), at twice the bytes; above it put-with-signal. GPU: 32 KB, an
# untuned guess at where doubling the bytes costs more than a network latency (NVSHMEM puts on
# InfiniBand: ~2-3 us latency, ~45 GB/s: 32 KB more on the wire is ~0.7 us). CPU: off (flags in
# shared memory cost nothing); tests switch it on to run the GPU's LL logic on the CPU.
LL_MAX_BYTES: Dict[str, int] = {"cpu": 0, "cuda": 32 << 10}

# Inter-node shards from this size (bytes) go by halving-doubling instead of recursive doubling
# (NOTE [halving-doubling] in csrc/protocol/round.h: the same bits, 2 (N'-1)/N' of the shard sent
# per rank instead of log2 N' times it; used with 4 or more nodes). CPU only; the GPU executor
# keeps recursive doubling (0).
HD_MIN_BYTES: Dict[str, int] = {"cpu": 256 << 10, "cuda": 0}
# The CPU default where the nodes are hosts (the inter-node steps cross tcp, not shared memory):
# every byte sent costs kernel copies on both sides, so halving-doubling pays from smaller shards
# (4 hosts x 1 rank here, against MPI_Allreduce in the same run: from 0.64-0.85x its speed to
# 1.07-1.19x at 128 KB, better at 64 KB, worse at 32 KB, where its two extra steps cost more than
# the bytes they save; docs/results.md).
HD_MIN_BYTES_HOSTS = 64 << 10

JITTER_US = 0.0
JITTER_SEED = 0
CMA = True
# NOTE [moving apart] (csrc/cpu/executor.cpp): a rank that keeps finding its local peer on its own
# CPU moves itself to a free CPU of its affinity mask (and restores the mask). 0: never.
CPU_SPREAD = True
# NOTE [streaming stage-in] (csrc/cpu/executor.cpp): how a one-shot call stages its input: "auto"
# (each node's leader times plain and streaming stores and its ranks take the faster), "0" plain
# stores, "1" streaming stores. NVRAR_STREAM_STAGING.
STREAM_STAGING = "auto"
STREAM_STAGING_CODES: Dict[str, int] = {"auto": -1, "0": 0, "1": 1}

# Settings that decide which bytes each round carries (chunking, algorithm, transport): every
# rank must use the same values, checked once at construction (field -> name in the error).
AGREED: Dict[str, str] = {"ranks_per_node": "ranks_per_node", "max_bytes": "max_bytes", "heap_bytes": "heap_bytes",
                          "algorithm": "algorithm", "ll_max_bytes": "NVRAR_LL_MAX_BYTES",
                          "oneshot_max_bytes": "NVRAR_ONESHOT_MAX_BYTES", "hd_min_bytes": "NVRAR_HD_MIN_BYTES",
                          "oneshot_adapt_max_bytes": "NVRAR_ONESHOT_ADAPT_MAX_BYTES",
                          "channels": "NVRAR_GPU_CHANNELS"}


def size_text(nbytes: int) -> str:
    """64K, 4M, 0: a size as the NVRAR_* variables accept it."""
    for suffix, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{suffix}"
    return str(nbytes)


def per_device_text(values: Dict[str, int]) -> str:
    """"4M (CPU), 16M (GPU)"."""
    return ", ".join(f"{size_text(values[d])} ({'CPU' if d == 'cpu' else 'GPU'})" for d in DEVICES)


def check_timeout(value: float, what: str) -> float:
    if not value > 0 or math.isinf(value) or math.isnan(value) or value > MAX_TIMEOUT_S:
        raise ValueError(f"{what} must be a positive number of seconds up to {MAX_TIMEOUT_S:g}, got {value}")
    return value


def algorithm_argument(algorithm: Optional[str], algo: Optional[str], where: str) -> Optional[str]:
    """``algorithm=``, or its deprecated spelling ``algo=`` (with a DeprecationWarning)."""
    if algo is None:
        return algorithm
    if algorithm is not None and algorithm != algo:
        raise TypeError(f"{where}: algorithm={algorithm!r} and its deprecated spelling algo={algo!r} disagree; "
                        f"pass algorithm= only")
    warnings.warn(f"{where}: algo= is deprecated; pass algorithm=", DeprecationWarning, stacklevel=3)
    return algo


@dataclass(frozen=True)
class Settings:
    """Every value a Communicator's executor is built with (resolved on this rank)."""

    device: str
    timeout_s: float
    max_bytes: int
    heap_bytes: int
    ranks_per_node: Optional[int]  # requested; None: the launcher's local size, or ranks on this host
    algorithm: str
    oneshot_max_bytes: Optional[int]  # NVRAR_ONESHOT_MAX_BYTES; None: by layout (oneshot_max)
    ll_max_bytes: int
    hd_min_bytes: Optional[int]  # NVRAR_HD_MIN_BYTES (0: never); None: by device and hosts (hd_min)
    jitter_us: float
    jitter_seed: int
    cma: bool
    cma_min_bytes: int
    cma_piece_bytes: int
    max_blocks: int
    threads: int
    block_bytes: int
    channels: int = GPU_LAUNCH["channels"]  # NVRAR_GPU_CHANNELS; GPU only (the CPU sends per slice)
    cpu_spread: bool = CPU_SPREAD  # NVRAR_CPU_SPREAD; CPU only
    stream_staging: str = STREAM_STAGING  # NVRAR_STREAM_STAGING; CPU only
    oneshot_adapt_max_bytes: Optional[int] = None  # NVRAR_ONESHOT_ADAPT_MAX_BYTES; None: oneshot_adapt_max's default

    def agreed(self) -> Dict[str, object]:
        """The values that must be equal on every rank (exchanged as JSON at construction)."""
        return {key: getattr(self, key) for key in AGREED}

    def hd_min(self, across_hosts: bool) -> int:
        """Smallest inter-node shard (bytes) that goes by halving-doubling (0: never)."""
        if self.hd_min_bytes is not None:
            return self.hd_min_bytes
        return HD_MIN_BYTES_HOSTS if self.device == "cpu" and across_hosts else HD_MIN_BYTES[self.device]

    def across_hosts(self) -> "Settings":
        """What a CPU executor whose ranks span hosts is built with: no LL packets (they never
        cross hosts: NOTE [put-with-signal across hosts], csrc/cpu/host_link.h) and the
        halving-doubling threshold across hosts."""
        return replace(self, ll_max_bytes=0, hd_min_bytes=self.hd_min(True))

    def oneshot_adapt_max(self, ranks_per_node: int, nodes: int = 1) -> int:
        """Largest message (bytes) whose auto calls above :meth:`oneshot_max` take the algorithm the
        node leader measures faster (NOTE [one-shot or two-shot], csrc/cpu/executor.cpp); 0: none.
        CPU, one node only."""
        if self.device != "cpu" or nodes != 1:
            return 0
        if self.oneshot_adapt_max_bytes is not None:
            return self.oneshot_adapt_max_bytes
        if self.oneshot_max_bytes is not None:
            return 0  # an explicit one-shot threshold is obeyed as it was set
        return CPU_ONESHOT_ADAPT_MAX.get(ranks_per_node, 0)

    def oneshot_max(self, ranks_per_node: int, nodes: int = 1) -> int:
        """Largest message (bytes) that the auto policy sends through the one-shot variant, for
        ``nodes`` nodes of ``ranks_per_node`` ranks (the GPU's threshold knows the node count)."""
        if self.oneshot_max_bytes is not None:
            return self.oneshot_max_bytes
        if self.device == "cpu":
            return CPU_ONESHOT_MAX.get(ranks_per_node, CPU_ONESHOT_MAX_DEFAULT)
        if nodes > 2:
            return GPU_ONESHOT_MAX_NODES if ranks_per_node <= 2 else GPU_ONESHOT_MAX_MANY_NODES_LARGE_G
        if nodes == 2:
            return GPU_ONESHOT_MAX_NODES
        return GPU_ONESHOT_MAX_SMALL_G if ranks_per_node <= 4 else GPU_ONESHOT_MAX


def check_arguments(*, timeout: Optional[float] = None, max_bytes: Optional[int] = None,
                    heap_bytes: Optional[int] = None, ranks_per_node: Optional[int] = None,
                    algorithm: Optional[str] = None) -> Optional[float]:
    """Check the constructor's arguments (the caller's own, on every rank alike): a ValueError
    before any communication. Returns the timeout as a float (or None)."""
    if timeout is not None:
        timeout = check_timeout(float(timeout), "timeout")
    if max_bytes is not None and int(max_bytes) < MIN_MAX_BYTES:
        raise ValueError(f"max_bytes must be at least {MIN_MAX_BYTES}, got {max_bytes}")
    if heap_bytes is not None and int(heap_bytes) < 0:
        raise ValueError(f"heap_bytes must be >= 0, got {heap_bytes}")
    if ranks_per_node is not None and (not isinstance(ranks_per_node, int) or ranks_per_node < 1):
        raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
    if algorithm is not None:
        algorithm_code(algorithm)
    return timeout
