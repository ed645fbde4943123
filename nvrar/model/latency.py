"""Alpha-beta-gamma latency model of NVRAR, NCCL (ring, tree) and flat recursive doubling.

Every cost is built as ``Terms``: a map from a profile parameter (see
:data:`nvrar.model.profiles.PARAMS`) to its coefficient, a count for an alpha and a byte count for
a bandwidth (whose beta is us per byte). The time is the dot product with the profile
(:func:`evaluate`), so every cost is linear in the parameters and can be fitted by least squares.

Layout: N nodes x G ranks per node, W = N*G, message M bytes. NVRAR (docs/design.md):

* two-shot hierarchical: stage-in copy (2M bytes of local traffic); intra-node reduce-scatter, one
  phase in which each rank loads (G-1) shards of s = M/G over NVLink and reduces them; inter-node
  recursive doubling of the shard: N' = 2^floor(log2 N), log2 N' exchange steps plus a fold-in and a
  fold-out step when N > N', each step one alpha plus s wire bytes; intra-node all-gather, one phase
  loading (G-1)*s bytes.
* one-shot: each rank loads the whole message from its G-1 peers (one phase, (G-1)*M bytes, no
  all-gather), then every rank runs the inter-node recursive doubling on the whole message.
* transports of an inter-node step: LL packets (flag-in-word cells: half of each 8-byte cell is the
  flag, so the wire carries 2 bytes per payload byte, at the lower alpha ``net_ll_alpha_us``) and
  put-with-signal (payload bytes only, alpha ``net_signal_alpha_us``).
* network sharing: the G ranks of a node send at once; with fewer NICs than senders each rank gets
  nics/G of a NIC, so its bytes are scaled by max(1, G/nics).

Reductions cost gamma = 1/hbm_bw per byte of local memory traffic: 2s in the reduce-scatter (read the
local operand, write the result; peer operands are charged to NVLink) and 3s in a recursive-doubling
step (read both operands, write the result).

NCCL follows its own tuning model (src/graph/tuning.cc): ring latency = base + (2(W-1) - 2(N-1))
NVLink steps + 2(N-1) network steps, bandwidth term 2(W-1)/W * M / busbw; tree latency =
base + 2((G-1) NVLink steps + floor(log2 N) network levels), bandwidth term 2M / busbw; NVLink steps
cost 1.8x more when N > 1 (NCCL's LL rule). One protocol per algorithm: the profile's bandwidths
are effective values for 128 KB-2 MB, not NCCL's protocol switch (LL / LL128 / Simple).

Flat recursive doubling: recursive doubling over all W ranks on the whole message; with node-major
ranks the first log2 G steps stay in the node when G is a power of two.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

from .profiles import Profile, linear_value

__all__ = [
    "Terms",
    "NVRAR_VARIANTS",
    "NCCL_ALGORITHMS",
    "evaluate",
    "nvrar_terms",
    "nccl_terms",
    "flat_rd_terms",
    "nccl_allgather_terms",
    "nccl_sendrecv_terms",
    "candidates",
    "best_of",
    "predict",
]

Terms = Dict[str, float]

#: (variant, transport) pairs of NVRAR, named as in the "nvrar_<variant>_<transport>" output keys.
NVRAR_VARIANTS: Tuple[Tuple[str, str], ...] = (
    ("two_shot", "ll"),
    ("two_shot", "signal"),
    ("one_shot", "ll"),
    ("one_shot", "signal"),
)
NCCL_ALGORITHMS: Tuple[str, ...] = ("ring", "tree")

_WIRE_FACTOR = {"ll": 2.0, "signal": 1.0}
_NET_ALPHA = {"ll": "net_ll_alpha_us", "signal": "net_signal_alpha_us"}
_NCCL_MULTINODE_NVL = 1.8  # NCCL tuning.cc: intra-node LL latency x1.8 when nNodes > 1


def _layout(nodes: int, gpus: int, size: float) -> None:
    if nodes < 1 or gpus < 1 or int(nodes) != nodes or int(gpus) != gpus:
        raise ValueError(f"nodes and gpus per node must be integers >= 1, got {nodes} x {gpus}")
    if size < 0:
        raise ValueError(f"message size must be >= 0 bytes, got {size}")


def _log2_floor(n: int) -> int:
    return n.bit_length() - 1


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _add(terms: Terms, name: str, coef: float) -> None:
    terms[name] = terms.get(name, 0.0) + coef


def evaluate(terms: Mapping[str, float], profile: Profile) -> float:
    """Time in microseconds of a cost expressed as terms."""
    return sum(coef * linear_value(profile, name) for name, coef in terms.items())


def _net_share(profile: Profile, senders: int) -> float:
    return max(1.0, senders / profile.nics_per_node)


def _recursive_doubling(terms: Terms, shard: float, nodes: int, transport: str,
                        share: float) -> None:
    """Inter-node recursive doubling of ``shard`` bytes over ``nodes`` with fold-in/out."""
    if nodes <= 1:
        return
    pow2 = 1 << _log2_floor(nodes)
    exchanges = _log2_floor(pow2)
    fold = nodes > pow2
    steps = exchanges + (2 if fold else 0)
    reduces = exchanges + (1 if fold else 0)  # fold-out only copies the result back
    _add(terms, _NET_ALPHA[transport], steps)
    _add(terms, "net_bw_GBps", steps * _WIRE_FACTOR[transport] * shard * share)
    _add(terms, "hbm_bw_GBps", reduces * 3.0 * shard)


def nvrar_terms(size: float, nodes: int, gpus: int, profile: Profile,
                variant: str = "two_shot", transport: str = "signal",
                zero_copy: bool = False) -> Terms:
    """Cost of one NVRAR all-reduce of ``size`` bytes (see the module docstring)."""
    _layout(nodes, gpus, size)
    if variant not in ("two_shot", "one_shot") or transport not in _WIRE_FACTOR:
        raise ValueError(f"unknown NVRAR variant {variant!r} / transport {transport!r}")
    terms: Terms = {"nvrar_overhead_us": 1.0}
    if not zero_copy:
        _add(terms, "hbm_bw_GBps", 2.0 * size)
    share = _net_share(profile, gpus)
    if variant == "two_shot":
        shard = size / gpus
        if gpus > 1:
            _add(terms, "nvl_alpha_us", 2.0)  # reduce-scatter phase + all-gather phase
            _add(terms, "nvl_bw_GBps", 2.0 * (gpus - 1) * shard)
            _add(terms, "hbm_bw_GBps", 2.0 * shard)
        _recursive_doubling(terms, shard, nodes, transport, share)
    else:
        if gpus > 1:
            _add(terms, "nvl_alpha_us", 1.0)
            _add(terms, "nvl_bw_GBps", (gpus - 1) * size)
            _add(terms, "hbm_bw_GBps", 2.0 * size)
        _recursive_doubling(terms, size, nodes, transport, share)
    return terms


def nccl_terms(size: float, nodes: int, gpus: int, algorithm: str = "ring") -> Terms:
    """Cost of one NCCL all-reduce with ``algorithm`` "ring" or "tree" (NCCL's tuning model)."""
    _layout(nodes, gpus, size)
    ranks = nodes * gpus
    terms: Terms = {"nccl_base_us": 1.0}
    if ranks == 1:
        return terms
    if algorithm == "ring":
        _nccl_ring_passes(terms, size, nodes, gpus, passes=2)  # reduce-scatter + all-gather
    elif algorithm == "tree":
        nvl = _NCCL_MULTINODE_NVL if nodes > 1 else 1.0
        _add(terms, "nccl_nvl_alpha_us", 2.0 * (gpus - 1) * nvl)
        _add(terms, "nccl_tree_net_alpha_us", 2.0 * _log2_floor(nodes))
        bw = "nccl_tree_bw_GBps" if nodes > 1 else "nccl_intra_bw_GBps"
        _add(terms, bw, 2.0 * size)
    else:
        raise ValueError(f"unknown NCCL algorithm {algorithm!r}; known: {NCCL_ALGORITHMS}")
    return terms


def flat_rd_terms(size: float, nodes: int, gpus: int, profile: Profile,
                  transport: str = "signal") -> Terms:
    """Recursive doubling over all W = N*G ranks on the whole message (no hierarchy)."""
    _layout(nodes, gpus, size)
    terms: Terms = {"nvrar_overhead_us": 1.0}
    _add(terms, "hbm_bw_GBps", 2.0 * size)
    ranks = nodes * gpus
    pow2 = 1 << _log2_floor(ranks)
    exchanges = _log2_floor(pow2)
    if nodes == 1:
        intra = exchanges
    else:
        intra = min(exchanges, _log2_floor(gpus)) if _is_pow2(gpus) else 0
    fold = ranks > pow2
    intra_steps = intra + (2 if fold and nodes == 1 else 0)
    inter_steps = exchanges - intra + (2 if fold and nodes > 1 else 0)
    reduces = exchanges + (1 if fold else 0)
    share = _net_share(profile, gpus)
    _add(terms, "nvl_alpha_us", intra_steps)
    _add(terms, "nvl_bw_GBps", intra_steps * size)
    _add(terms, _NET_ALPHA[transport], inter_steps)
    _add(terms, "net_bw_GBps", inter_steps * _WIRE_FACTOR[transport] * size * share)
    _add(terms, "hbm_bw_GBps", reduces * 3.0 * size)
    return {k: v for k, v in terms.items() if v}


def nccl_allgather_terms(total: float, nodes: int, gpus: int) -> Terms:
    """NCCL ring all-gather producing ``total`` bytes on every rank (W-1 steps, (W-1)/W * total)."""
    _layout(nodes, gpus, total)
    ranks = nodes * gpus
    terms: Terms = {"nccl_base_us": 1.0}
    if ranks == 1:
        return terms
    _nccl_ring_passes(terms, total, nodes, gpus, passes=1)
    return terms


def _nccl_ring_passes(terms: Terms, size: float, nodes: int, gpus: int, passes: int) -> None:
    """``passes`` ring passes over all W = N*G ranks, each W-1 steps (N-1 of them crossing the
    network) moving (W-1)/W of ``size``."""
    ranks = nodes * gpus
    nvl = _NCCL_MULTINODE_NVL if nodes > 1 else 1.0
    inter = nodes - 1
    _add(terms, "nccl_nvl_alpha_us", passes * (ranks - 1 - inter) * nvl)
    _add(terms, "nccl_ring_net_alpha_us", passes * inter)
    bw = "nccl_ring_bw_GBps" if nodes > 1 else "nccl_intra_bw_GBps"
    _add(terms, bw, passes * (ranks - 1) / ranks * size)


def nccl_sendrecv_terms(size: float, inter_node: bool) -> Terms:
    """One NCCL point-to-point transfer of ``size`` bytes (a pipeline-stage hand-off)."""
    if inter_node:
        return {"nccl_base_us": 1.0, "nccl_ring_net_alpha_us": 1.0, "nccl_ring_bw_GBps": size}
    return {"nccl_base_us": 1.0, "nccl_nvl_alpha_us": 1.0, "nccl_intra_bw_GBps": size}


def candidates(size: float, nodes: int, gpus: int, profile: Profile,
               zero_copy: bool = False) -> Dict[str, Terms]:
    """Every modeled algorithm for this call, by output key."""
    out: Dict[str, Terms] = {}
    for variant, transport in NVRAR_VARIANTS:
        out[f"nvrar_{variant}_{transport}"] = nvrar_terms(
            size, nodes, gpus, profile, variant, transport, zero_copy)
    for algorithm in NCCL_ALGORITHMS:
        out[f"nccl_{algorithm}"] = nccl_terms(size, nodes, gpus, algorithm)
    flat = {t: flat_rd_terms(size, nodes, gpus, profile, t) for t in _WIRE_FACTOR}
    out["flat_rd"] = min(flat.values(), key=lambda terms: evaluate(terms, profile))
    return out


def best_of(times: Mapping[str, float], prefix: str) -> Tuple[str, float]:
    """The fastest entry whose key starts with ``prefix``."""
    key = min((k for k in times if k.startswith(prefix)), key=times.__getitem__)
    return key, times[key]


def predict(size: float, nodes: int, gpus: int, profile: Profile,
            zero_copy: bool = False) -> Dict[str, Any]:
    """Predicted latencies (us) of one all-reduce of ``size`` bytes on ``nodes`` x ``gpus``.

    Keys of ``predicted_us``: "nvrar" (fastest variant and transport, what a selector would pick),
    "nccl_ring", "nccl_tree", "nccl" (the faster of the two, what NCCL's tuner aims at), "flat_rd",
    and every "nvrar_<variant>_<transport>".
    """
    times = {k: evaluate(t, profile) for k, t in candidates(size, nodes, gpus, profile, zero_copy).items()}
    nvrar_key, nvrar = best_of(times, "nvrar_")
    nccl_key, nccl = best_of(times, "nccl_")
    predicted = {"nvrar": nvrar, "nccl_ring": times["nccl_ring"], "nccl_tree": times["nccl_tree"],
                 "nccl": nccl, "flat_rd": times["flat_rd"]}
    predicted.update({k: v for k, v in times.items() if k.startswith("nvrar_")})
    return {
        "profile": profile.name,
        "nodes": nodes,
        "gpus_per_node": gpus,
        "bytes": int(size),
        "predicted_us": predicted,
        "nvrar_choice": nvrar_key[len("nvrar_"):],
        "nccl_choice": nccl_key[len("nccl_"):],
        "speedup_vs_nccl": nccl / nvrar,
    }

