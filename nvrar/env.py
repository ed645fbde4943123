"""Every environment variable nvrar reads, in one place: name, meaning, default.

Constructor arguments take precedence over these variables; the variables take precedence over
the built-in defaults, which nvrar.settings defines (the default texts here are derived from them).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Optional

from . import settings as _defaults

__all__ = ["VARIABLES", "EnvVar", "get_float", "get_int", "get_bytes", "get_str", "parse_bytes", "resolve"]


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    meaning: str


VARIABLES: Dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar("NVRAR_TIMEOUT_S", f"{_defaults.TIMEOUT_S:g}", "Deadline of every wait of a collective and of the bootstrap, in seconds."),
        EnvVar(
            "NVRAR_MAX_BYTES",
            _defaults.per_device_text(_defaults.MAX_BYTES),
            "Largest chunk one protocol round reduces (the symmetric staging buffer); larger messages "
            "run in chunks. Accepts 64K, 4M, ... Must be equal on every rank.",
        ),
        EnvVar(
            "NVRAR_HEAP_BYTES",
            _defaults.per_device_text(_defaults.HEAP_BYTES),
            "Size of the zero-copy pool that Communicator.empty() allocates from, per rank.",
        ),
        EnvVar(
            "NVRAR_RANKS_PER_NODE",
            "",
            "Ranks per (emulated) node when ranks_per_node= is not given; by default the launcher's "
            "local size (LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, SLURM_NTASKS_PER_NODE, MPI "
            "shared-memory split) or the number of ranks on this host.",
        ),
        EnvVar(
            "NVRAR_ONESHOT_MAX_BYTES",
            "",
            "Messages up to this size use the one-shot algorithm (default: by ranks per node, "
            "nvrar.settings.Settings.oneshot_max). "
            "Must be equal on every rank.",
        ),
        EnvVar(
            "NVRAR_ONESHOT_ADAPT_MAX_BYTES",
            "",
            "CPU executor, one node: auto calls above the one-shot threshold and up to this size take "
            "the algorithm (one-shot or two-shot) the node's leader measures faster, per message size "
            "class, the other tried now and then (NOTE [one-shot or two-shot], csrc/cpu/executor.cpp; "
            "default: nvrar.settings.CPU_ONESHOT_ADAPT_MAX, 1M with 2 ranks per node, else 0; 0 turns it "
            "off, and so does an explicit NVRAR_ONESHOT_MAX_BYTES unless this is set too). The result is the "
            "same bits either way. Must be equal on every rank.",
        ),
        EnvVar(
            "NVRAR_TEST_ALGORITHM_FLIP",
            "0",
            "Testing: 1 makes each node leader's choice of NVRAR_ONESHOT_ADAPT_MAX_BYTES decide the other "
            "algorithm after every call, so that the ranks' agreement on it is tried on every call "
            "(tests/test_hot_path.py).",
        ),
        EnvVar(
            "NVRAR_ALGORITHM",
            _defaults.ALGORITHM,
            "Force an algorithm for every call: auto, one-shot or two-shot.",
        ),
        EnvVar(
            "NVRAR_ALGO",
            "",
            "Deprecated spelling of NVRAR_ALGORITHM (read with a DeprecationWarning; NVRAR_ALGORITHM wins).",
        ),
        EnvVar(
            "NVRAR_JITTER_US",
            f"{_defaults.JITTER_US:g}",
            "Testing: inject random delays of up to this many microseconds before puts and after "
            "signals of the CPU executor, to shake out races in the epoch protocol.",
        ),
        EnvVar(
            "NVRAR_LL_MAX_BYTES",
            _defaults.per_device_text(_defaults.LL_MAX_BYTES),
            "Inter-node shards up to this size go as low-latency packets (flag in every 8-byte word) "
            "instead of put-with-signal; 0 is off (the CPU's default, where tests turn it on to exercise "
            "the GPU's LL logic). Must be equal on every rank.",
        ),
        EnvVar(
            "NVRAR_GPU_CHANNELS",
            str(_defaults.GPU_LAUNCH["channels"]),
            "GPU: messages per peer per inter-node step, 1 to "
            f"{_defaults.GPU_MAX_CHANNELS} (the blocks' slices are gathered into this many channels; "
            "nvrar.settings.GPU_LAUNCH['channels'], chosen by the wire model). Must be equal on every rank.",
        ),
        EnvVar(
            "NVRAR_HD_MIN_BYTES",
            _defaults.per_device_text(_defaults.HD_MIN_BYTES)
            + f"; {_defaults.size_text(_defaults.HD_MIN_BYTES_HOSTS)} (CPU, ranks on several hosts)",
            "CPU executor: inter-node shards from this size go by halving-doubling (Rabenseifner: "
            "bitwise the same result as recursive doubling, fewer bytes sent with 4 or more nodes) "
            "instead of recursive doubling; 0 is never (the GPU's default). Must be equal on every rank.",
        ),
        EnvVar(
            "NVRAR_TUNING_FILE",
            "~/.cache/nvrar/tuning.json",
            "Tuning tables written by `nvrar tune`, read when nvrar.torch sets up a group; a table is "
            "used only for the device, world size and ranks per node it was measured on.",
        ),
        EnvVar(
            "NVRAR_SESSION_SECRET",
            "",
            "Rendezvous through nvrar's TCP store (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT): a secret of at "
            "least 16 characters, equal on every rank, that every client of the store must prove (mutual "
            "HMAC). Unset: the store serves only this user's processes on this host (socket owner checked). "
            "Needed when ranks on several hosts rendezvous through it.",
        ),
        EnvVar(
            "NVRAR_NVSHMEM_INIT",
            "auto",
            "GPU executor, where NVSHMEM is not initialized yet in the process: auto initializes it through "
            "nvshmem4py where nvshmem4py is installed and imports, else by nvrar itself (a unique id from "
            "rank 0); nvrar always by nvrar itself (nvshmem4py is then not imported); nvshmem4py always through "
            "nvshmem4py (every rank raises where it does not import). An NVSHMEM already initialized is joined "
            "whatever this says. Must be equal on every rank.",
        ),
        EnvVar("NVRAR_JITTER_SEED", str(_defaults.JITTER_SEED), "Testing: seed of the jitter generator (mixed with the rank)."),
        EnvVar(
            "NVRAR_TEST_KILL_AT",
            "",
            "Testing: the rank SIGKILLs itself at this point of a CPU communicator's set-up, one of "
            "nvrar._setup.KILL_POINTS (tests/test_setup_faults.py); read once per set-up.",
        ),
        EnvVar(
            "NVRAR_CMA",
            str(int(_defaults.CMA)),
            "CPU executor: 1 lets ranks write result shards straight into each other's private output "
            "buffers (process_vm_writev, the single-copy path MPI libraries use) where the OS allows it; "
            "0 always copies through the shared segment.",
        ),
        EnvVar(
            "NVRAR_CPU_SPREAD",
            str(int(_defaults.CPU_SPREAD)),
            "CPU executor: 1 lets a rank whose waits find the peer on its own CPU 16 times in a row (32 for "
            "the lower rank of the pair; the scheduler put both on one core, beside other work) move itself "
            "to a CPU of its affinity mask where no rank of its host runs, restoring the mask at once, at "
            "most once per 50 ms; never with more ranks in the job than CPUs in the mask (NOTE [moving "
            "apart], csrc/cpu/executor.cpp). 0 never touches the calling thread's affinity.",
        ),
        EnvVar(
            "NVRAR_STREAM_STAGING",
            _defaults.STREAM_STAGING,
            "CPU executor: how a one-shot call stages its input in the shared segment for its local peers. "
            "auto: each node's leader times plain and streaming (non-temporal) stores and its ranks take the "
            "faster (NOTE [streaming stage-in], csrc/cpu/executor.cpp; plain stores win where the two CPUs "
            "share a line quickly, streaming ones where a line crosses slowly); 1 always streaming; 0 always "
            "plain. The result is the same bits either way.",
        ),
        EnvVar(
            "NVRAR_CMA_MIN_BYTES",
            _defaults.size_text(_defaults.CMA_MIN_BYTES),
            "CPU executor: smallest shard moved by cross-memory reads and writes. Unset, above the "
            "default each node's leader times both ways (cross-memory or staged through the shared "
            "segment) and all its ranks take the faster (NOTE [cross-memory or staged], csrc/cpu/executor.cpp); with more "
            "ranks than cores, shards below 256K are staged. Set, every shard from this size goes by "
            "cross-memory transfer.",
        ),
        EnvVar(
            "NVRAR_VLLM",
            "0",
            "vLLM plugin (nvrar.integrations.vllm, docs/engines.md): 1 makes vLLM's platform hand out "
            "nvrar's device communicators (tensor-parallel all-reduce served by nvrar); platform also "
            "supplies nvrar's platform through vllm.platform_plugins; 0 leaves vLLM as it is.",
        ),
        EnvVar(
            "NVRAR_MPICH_PREFIX",
            "",
            "nvrar-bench's mpich peer (nvrar.bench.mpilibs): the directory holding MPICH's lib/libmpi.so.12 and "
            "bin/mpiexec (pip install mpich --prefix DIR, or an installation prefix); unset, the mpich wheel's "
            "metadata on sys.path (its environment, or DIR/lib/pythonX.Y/site-packages on PYTHONPATH).",
        ),
        EnvVar(
            "NVRAR_IMPI_PREFIX",
            "",
            "nvrar-bench's impi peer (nvrar.bench.mpilibs): the directory holding Intel MPI's lib/libmpi.so.12 and "
            "bin/mpiexec (pip install impi-rt==2021.16.1 --prefix DIR, or an installation prefix); unset, the "
            "impi-rt wheel's metadata on sys.path.",
        ),
        EnvVar(
            "NVRAR_SGLANG",
            "0",
            "SGLang plugin (nvrar.integrations.sglang, docs/engines.md): 1 registers the HookRegistry "
            "hooks that add the out-of-place method nvrar to SGLang's all-reduce chain and serve CPU "
            "tensors; 0 leaves SGLang as it is.",
        ),
    )
}

_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
           "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_bytes(text: str) -> int:
    """Parse a size such as ``4096``, ``64K``, ``2M``, ``1GiB`` (binary multiples)."""
    s = str(text).strip().upper().replace(" ", "")
    num = s.rstrip("KMGIB")
    suffix = s[len(num):]
    if not num or suffix not in _SUFFIX:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 64K, 2M)")
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 64K, 2M)") from None
    if not math.isfinite(value):
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 64K, 2M)")
    result = int(value * _SUFFIX[suffix])
    if result < 0 or result != value * _SUFFIX[suffix]:
        raise ValueError(f"not a whole, non-negative number of bytes: {text!r}")
    return result


def _raw(name: str) -> Optional[str]:
    if name not in VARIABLES:
        raise KeyError(f"undocumented environment variable {name}; add it to nvrar.env.VARIABLES")
    value = os.environ.get(name, "").strip()
    return value or None


def _get(name: str, parse: Callable[[str], object]):
    """The parsed value of a set variable, or None when unset (each caller applies its default;
    the defaults in VARIABLES document them)."""
    raw = _raw(name)
    if raw is None:
        return None
    try:
        return parse(raw)
    except (ValueError, OverflowError) as exc:
        raise ValueError(f"{name}={raw!r}: {exc}") from None


def get_float(name: str) -> Optional[float]:
    return _get(name, float)


def get_int(name: str) -> Optional[int]:
    return _get(name, int)


def get_bytes(name: str) -> Optional[int]:
    return _get(name, parse_bytes)


def get_str(name: str) -> Optional[str]:
    return _get(name, str)


# -- the settings of a Communicator: arguments, then these variables, then nvrar.settings -----
def _env_algorithm() -> Optional[str]:
    value = get_str("NVRAR_ALGORITHM")
    old = get_str("NVRAR_ALGO")
    if old is not None:
        warnings.warn("NVRAR_ALGO is deprecated; set NVRAR_ALGORITHM" +
                      (" (NVRAR_ALGORITHM is set and wins)" if value is not None else ""),
                      DeprecationWarning, stacklevel=4)
    return value if value is not None else old


def resolve(device: str, *, timeout: Optional[float] = None, max_bytes: Optional[int] = None,
            heap_bytes: Optional[int] = None, ranks_per_node: Optional[int] = None,
            algorithm: Optional[str] = None) -> _defaults.Settings:
    """Every setting: arguments first, then NVRAR_* variables, then the defaults of nvrar.settings
    (ValueError naming the variable if one is bad). The arguments are assumed checked
    (check_arguments)."""
    if device not in _defaults.DEVICES:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if timeout is None:
        timeout = get_float("NVRAR_TIMEOUT_S")
        timeout = _defaults.TIMEOUT_S if timeout is None else _defaults.check_timeout(timeout, "NVRAR_TIMEOUT_S")
    if max_bytes is None:
        max_bytes = get_bytes("NVRAR_MAX_BYTES")
        max_bytes = _defaults.MAX_BYTES[device] if max_bytes is None else max_bytes
        if max_bytes < _defaults.MIN_MAX_BYTES:
            raise ValueError(f"NVRAR_MAX_BYTES must be at least {_defaults.MIN_MAX_BYTES}, got {max_bytes}")
    if heap_bytes is None:
        heap_bytes = get_bytes("NVRAR_HEAP_BYTES")
        heap_bytes = _defaults.HEAP_BYTES[device] if heap_bytes is None else heap_bytes
    requested = ranks_per_node if ranks_per_node is not None else get_int("NVRAR_RANKS_PER_NODE")
    if requested is not None and requested < 1:
        raise ValueError(f"NVRAR_RANKS_PER_NODE must be >= 1, got {requested}")
    if algorithm is None:
        algorithm = _env_algorithm() or _defaults.ALGORITHM
    _defaults.algorithm_code(algorithm)
    ll = get_bytes("NVRAR_LL_MAX_BYTES")
    hd = get_bytes("NVRAR_HD_MIN_BYTES")
    cpu = device == "cpu"  # the CPU executor's own variables are read (and checked) only there
    cma_min = get_bytes("NVRAR_CMA_MIN_BYTES") if cpu else None
    cma = get_int("NVRAR_CMA") if cpu else None
    spread = get_int("NVRAR_CPU_SPREAD") if cpu else None
    stream = get_str("NVRAR_STREAM_STAGING") if cpu else None
    if stream is not None and stream not in _defaults.STREAM_STAGING_CODES:
        raise ValueError(f"NVRAR_STREAM_STAGING must be one of {', '.join(_defaults.STREAM_STAGING_CODES)}, "
                         f"got {stream!r}")
    channels = get_int("NVRAR_GPU_CHANNELS") if not cpu else None
    if channels is not None and not 1 <= channels <= _defaults.GPU_MAX_CHANNELS:
        raise ValueError(f"NVRAR_GPU_CHANNELS must be 1 to {_defaults.GPU_MAX_CHANNELS}, got {channels}")
    return _defaults.Settings(
        device=device,
        timeout_s=float(timeout),
        max_bytes=int(max_bytes),
        heap_bytes=int(heap_bytes),
        ranks_per_node=requested,
        algorithm=algorithm,
        oneshot_max_bytes=get_bytes("NVRAR_ONESHOT_MAX_BYTES"),
        oneshot_adapt_max_bytes=get_bytes("NVRAR_ONESHOT_ADAPT_MAX_BYTES") if cpu else None,
        ll_max_bytes=_defaults.LL_MAX_BYTES[device] if ll is None else ll,
        hd_min_bytes=hd,
        jitter_us=(get_float("NVRAR_JITTER_US") if cpu else None) or _defaults.JITTER_US,
        jitter_seed=(get_int("NVRAR_JITTER_SEED") if cpu else None) or _defaults.JITTER_SEED,
        cma=_defaults.CMA if cma is None else cma != 0,
        cma_min_bytes=_defaults.CMA_MIN_BYTES if cma_min is None else cma_min,
        cma_piece_bytes=_defaults.CMA_PIECE_BYTES,
        max_blocks=_defaults.GPU_LAUNCH["max_blocks"],
        threads=_defaults.GPU_LAUNCH["threads"],
        block_bytes=_defaults.GPU_LAUNCH["block_bytes"],
        channels=_defaults.GPU_LAUNCH["channels"] if channels is None else channels,
        cpu_spread=_defaults.CPU_SPREAD if spread is None else spread != 0,
        stream_staging=_defaults.STREAM_STAGING if stream is None else stream,
    )
