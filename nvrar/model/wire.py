"""Wire cost model: the GPU kernel's wire ledger priced per operation on one network transport.

The ledger (``scripts/emulate.sh --ledger LAYOUT SIZE``, schema ``nvrar.wire-ledger/1``, keys in
docs/gpu/emulation.md) counts what one call of the GPU kernel puts on the wire, per step and per
PE: messages, signal operations and atomics, fences and quiets, transport-inserted proxy fences,
waits that need a consistency step, inter-node bytes and, inside a node, chains of system-scope
release stores. This module prices those counts with a table of per-operation costs per wire
profile (:data:`WIRES`), each cost with its source or marked as an estimate. Bandwidths, NVLink
latency and the NIC count come from the machine profile of :mod:`nvrar.model.profiles` that the
wire profile extends, so a machine has one set of numbers.

The price is a tool for decisions (which plan, which threshold, which protocol), never a result:
no number here was measured on a GPU. docs/gpu/wire-model.md has the table, the formula and the
commands; the formula in short (per step, from the step's ``max`` counters, the slowest PE):

* inter-node step, GPU-initiated transport (IBGDA): ``ceil(fences_before_data / senders) x fence +
  ceil(signal_ops_before_data / senders) x atomic + messages_max_per_peer x post + proxy_fences x
  fence + bytes x share / nic_bw + one_way + consistency_waits x consistency``, senders = the PE's data
  messages of the step (one per sending block: the ledger counts per PE, the blocks run in parallel);
* inter-node step, CPU-proxy transport (IBRC, libfabric): every operation of the PE is one command
  to its one proxy thread, ``commands x proxy_cmd`` with ``commands = puts + put_signals + ll_puts +
  signal_ops + remote_atomics + fences + quiets + proxy_fences``, plus a round trip for every
  operation that blocks the proxy thread (quiets, fences where the transport's fence is a quiet),
  plus ``proxy_fences x proxy_fence + bytes x share / nic_bw + one_way + consistency_waits x
  consistency``;
* per chunk, in-node phases from the plan's algorithm (the ledger records the flags' release stores
  under stage_in / one_shot / all_gather): stage-in ``2 x staged / hbm_bw``; the phase gated by the
  ready flags (reduce-scatter or one-shot) and the all-gather ``nvl_alpha + max(0, release_chain_max
  - 1) x chained_store + nvlink_bytes / nvl_bw``;
* call: ``launch + sum over chunks of their phases`` (a block runs its chunks one after another).

Extrapolation to more nodes (:func:`extrapolate`): inter-node recursive doubling over N nodes has
``log2 N'`` exchange steps (N' = 2^floor(log2 N)) plus a fold-in and a fold-out step when N > N';
every step moves the same shard, so the ledger at N nodes is the measured one with each chunk's
inter-node steps replaced by that many copies of its measured exchange step (fold steps copied from
the measured ones where the measured layout has them, else from the exchange step).
"""

from __future__ import annotations

import copy
import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .anchors import ANCHORS
from .latency import predict
from .profiles import PROFILES, Profile

__all__ = [
    "SCHEMA",
    "DECISION_NOTE",
    "COUNTERS",
    "PRICED_COUNTERS",
    "WireProfile",
    "WIRES",
    "get_wire",
    "cost_table",
    "price",
    "price_inter_step",
    "price_chunk",
    "extrapolate",
    "inter_node_steps",
    "fastest",
    "rank",
    "price_channels",
    "best_channels",
    "inter_node_byte_floor",
    "load_ledger",
    "load_ledgers",
    "ledger_for",
]

SCHEMA = "nvrar.wire-ledger/1"
DECISION_NOTE = ("modelled from emulated ledgers: a tool for decisions, never a result "
                 "(no number here was measured on a GPU)")

#: The counters of the ledger schema (docs/gpu/emulation.md).
COUNTERS: Tuple[str, ...] = (
    "messages_max_per_peer", "puts", "put_signals", "ll_puts", "signal_ops", "remote_atomics",
    "fences", "quiets", "fences_before_data", "signal_ops_before_data", "proxy_fences_ibgda",
    "proxy_fences_ibrc", "proxy_fences_libfabric", "consistency_waits", "inter_node_bytes",
    "release_chain_max", "sys_fences", "device_fences",
)

#: The counters the price depends on (sys_fences and device_fences are recorded, not priced).
PRICED_COUNTERS: Tuple[str, ...] = tuple(c for c in COUNTERS if c not in ("sys_fences", "device_fences"))

IN_NODE_PHASES = ("stage_in", "reduce_scatter", "one_shot", "all_gather")
TRANSPORTS = ("ibgda", "ibrc", "libfabric")

# --- sources --------------------------------------------------------------------------------------
_ANCH = "ANCHORS (shared notes), 'What an NVSHMEM operation costs on the wire'"
_NVSHMEM = "NVSHMEM v3.4.5-0"


@dataclass(frozen=True)
class WireProfile:
    """Per-operation costs of one transport on one machine (see the module docstring).

    Costs in microseconds. ``machine`` names the :data:`nvrar.model.profiles.PROFILES` entry whose
    NVLink bandwidth and latency, NIC bandwidth, NICs per node, GPUs per node and HBM bandwidth
    the model uses. ``sources`` holds one line per field; a line starting with "estimate" is not
    a measurement of anything.
    """

    name: str
    description: str
    machine: str
    transport: str  # "ibgda" | "ibrc" | "libfabric"
    one_way_us: float  # one put's data seen at the target, after its issue
    rtt_us: float  # a network round trip: a quiet's wait for completions
    fence_us: float  # what one nvshmem_fence holds the issuing thread (IBGDA) or proxy thread for
    atomic_us: float  # a remote atomic / signal op issued before a step's data (IBGDA); 0 on proxies
    post_us: float  # GPU-initiated: one message's work-request post on the peer's queue pair
    proxy_cmd_us: float  # CPU proxy: one command through the PE's proxy thread
    proxy_fence_us: float  # a fence the transport inserts (putmem_signal on unordered transports)
    consistency_us: float  # one consistency step (proxy-consistency mode); 0 where none is needed
    signal_atomic_us: float  # IBGDA: a put-with-signal's signal, an atomic the target NIC runs after the data
    launch_us: float  # one kernel launch
    ll_efficiency: float  # payload bytes per LL wire byte (ledger bytes already include the flags)
    sources: Dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def proxy(self) -> bool:
        """True where every GPU-initiated operation goes through a CPU proxy thread."""
        return self.transport != "ibgda"

    @property
    def fence_is_quiet(self) -> bool:
        """Whether the transport's fence waits for completions (a round trip)."""
        return self.fence_us >= self.rtt_us > 0

    def machine_profile(self) -> Profile:
        return PROFILES[self.machine]

    # Numbers taken from the machine profile (one copy of each).
    @property
    def nic_bw_GBps(self) -> float:
        return self.machine_profile().net_bw_GBps

    @property
    def nvl_bw_GBps(self) -> float:
        return self.machine_profile().nvl_bw_GBps

    @property
    def nvl_alpha_us(self) -> float:
        return self.machine_profile().nvl_alpha_us

    @property
    def chained_store_us(self) -> float:
        """One system-scope release store that waits for the previous one's acknowledgement."""
        return self.machine_profile().nvl_alpha_us

    @property
    def hbm_bw_GBps(self) -> float:
        return self.machine_profile().hbm_bw_GBps


_FROM_MACHINE = {
    "nic_bw_GBps": ("GB/s", "net_bw_GBps"),
    "nvl_bw_GBps": ("GB/s", "nvl_bw_GBps"),
    "nvl_alpha_us": ("us", "nvl_alpha_us"),
    "chained_store_us": ("us", "nvl_alpha_us"),
    "hbm_bw_GBps": ("GB/s", "hbm_bw_GBps"),
}
_CHAIN_SOURCE = ("one NVLink round trip per store (" + _ANCH + ": 'a chain of system-scope release stores "
                 "from one thread about one NVLink round trip each'); the machine's nvl_alpha_us, a flag "
                 "store plus poll, is that round trip")

_COMMON_SOURCES = {
    "launch_us": "ANCHORS: kernel launch about 2.6 us minimum (one kernel per call, old and new alike)",
    "ll_efficiency": ("csrc/protocol/ll.h: 4 payload bytes per 8-byte packet; the ledger's inter_node_bytes "
                      "already count the flags, so pricing does not apply it again (used for byte floors)"),
}

H100_NDR_IBGDA = WireProfile(
    name="h100-ndr-ibgda",
    description="H100 + InfiniBand NDR400, NVSHMEM IBGDA (GPU-initiated RDMA, no proxy)",
    machine="h100-ndr400",
    transport="ibgda",
    one_way_us=2.5,
    rtt_us=5.0,
    fence_us=5.0,
    atomic_us=5.0,
    post_us=0.3,
    proxy_cmd_us=0.0,
    proxy_fence_us=0.0,
    consistency_us=0.0,
    signal_atomic_us=1.0,
    launch_us=2.6,
    ll_efficiency=0.5,
    sources={
        "one_way_us": "estimate: " + _ANCH + ": one-way GPU-initiated put on NDR with IBGDA 2-3 us",
        "signal_atomic_us": ("estimate: " + _NVSHMEM + " ibgda_device.cuh (put_signal_thread_impl): the data "
                             "goes as an unsignaled RDMA write and the signal as a trailing atomic work request, "
                             "which the target NIC runs after the write as a read-modify-write of GPU memory "
                             "over PCIe: about one PCIe round trip (1 us) after the data is seen; an LL "
                             "packet's flag arrives with its data"),
        "rtt_us": ("estimate: " + _ANCH + ": a quiet or remote atomic a round trip (4-6 us); GIN measured a "
                   "16.7 us small-message round trip at the collective level (arXiv 2511.15076)"),
        "fence_us": ("estimate: = rtt_us; " + _NVSHMEM + " ibgda_device.cuh: nvshmemi_ibgda_fence runs a quiet "
                     "when more than one QP can reach the target (several RC QPs or DCIs)"),
        "atomic_us": ("estimate: = rtt_us (" + _ANCH + ": 'a quiet or remote atomic a round trip'); a signal op "
                      "SET is a masked compare-swap, two work requests. An upper bound where several "
                      "atomics complete under one fence"),
        "post_us": ("estimate: NVSHMEM performance guide: a GPU thread fills a work request more slowly than "
                    "a CPU thread; posts to one peer serialize on its QP"),
        "proxy_cmd_us": "not applicable: IBGDA has no proxy thread",
        "proxy_fence_us": ("not applicable: " + _NVSHMEM + " transfer_device.cuh: on IBGDA the QP orders the "
                           "signal after the data, no fence is inserted"),
        "consistency_us": "not applicable: IBGDA needs no proxy consistency step (init.cu)",
        **_COMMON_SOURCES,
    },
)

H100_NDR_IBRC = WireProfile(
    name="h100-ndr-ibrc",
    description="H100 + InfiniBand NDR400, NVSHMEM IBRC (CPU proxy), no gdrcopy: proxy-consistency mode",
    machine="h100-ndr400",
    transport="ibrc",
    one_way_us=2.5,
    rtt_us=6.0,
    fence_us=0.0,
    atomic_us=0.0,
    post_us=0.0,
    proxy_cmd_us=1.0,
    proxy_fence_us=6.0,
    consistency_us=3.0,
    signal_atomic_us=0.0,
    launch_us=2.6,
    ll_efficiency=0.5,
    sources={
        "one_way_us": "estimate: as h100-ndr-ibgda; the proxy's own time is priced per command (proxy_cmd_us)",
        "rtt_us": ("estimate: a NIC round trip (4-6 us, " + _ANCH + ") plus the proxy's hand-back of the "
                   "completion to the GPU (about 1 us)"),
        "fence_us": ("NVSHMEM IBRC transport (nvshmemt_ibrc_fence): returns without waiting, one RC QP per "
                     "peer keeps order; the fence costs its proxy command only"),
        "atomic_us": "a signal op is one more proxy command (an inline RDMA write on IBRC), no wait",
        "post_us": "not applicable: the proxy posts the work requests (priced in proxy_cmd_us)",
        "proxy_cmd_us": ("estimate: " + _ANCH + ": 'about 1 us of proxy time per command' (measured for the "
                         "libfabric proxy, taken for IBRC too); every put, signal and fence is one command to "
                         "the PE's one proxy thread"),
        "proxy_fence_us": ("estimate: = rtt_us, priced only if the ledger counts one (IBRC's RC QP is "
                           "ordered, so putmem_signal inserts none)"),
        "signal_atomic_us": "not applicable: the proxy's signal command is priced in proxy_cmd_us",
        "consistency_us": ("estimate: " + _ANCH + ": with IBRC and no gdrcopy on x86 (init.cu) each "
                           "nvshmem_uint64_wait_until adds a proxy round trip (proxy.cpp: "
                           "cuFlushGPUDirectRDMAWrites or a loopback read): GPU to proxy, a loopback read, back"),
        **_COMMON_SOURCES,
    },
)

A100_SLINGSHOT = WireProfile(
    name="a100-slingshot",
    description="Perlmutter A100 + Slingshot-11, NVSHMEM libfabric (cxi) transport through the CPU proxy",
    machine="perlmutter",
    transport="libfabric",
    one_way_us=3.0,
    rtt_us=8.0,
    fence_us=8.0,
    atomic_us=0.0,
    post_us=0.0,
    proxy_cmd_us=1.0,
    proxy_fence_us=8.0,
    consistency_us=0.0,
    signal_atomic_us=0.0,
    launch_us=2.6,
    ll_efficiency=0.5,
    sources={
        "one_way_us": ("estimate: " + _ANCH + ": Slingshot through the libfabric proxy 3-5 us one way, "
                       "taken at 3 us plus 1 us of proxy time per command (proxy_cmd_us)"),
        "rtt_us": "estimate: " + _ANCH + ": a quiet through the libfabric proxy 6-10 us",
        "fence_us": ("estimate: = rtt_us; " + _NVSHMEM + ": the libfabric host transport's fence is "
                     "nvshmemt_libfabric_quiet (proxy operations are unordered)"),
        "atomic_us": "a signal op is one more proxy command on libfabric, no wait of its own",
        "post_us": "not applicable: the proxy posts the operations (priced in proxy_cmd_us)",
        "proxy_cmd_us": "estimate: " + _ANCH + ": about 1 us of proxy time per command on Slingshot",
        "proxy_fence_us": ("estimate: = rtt_us; " + _NVSHMEM + " transfer_device.cuh: "
                           "nvshmemx_putmem_signal_nbi_block inserts a proxy fence (a quiet on libfabric) "
                           "between the data and the signal"),
        "consistency_us": "not applicable: proxy-consistency mode is IBRC without gdrcopy (init.cu)",
        "signal_atomic_us": ("not applicable: the signal is a proxy command after the inserted fence (priced in "
                             "proxy_cmd_us and proxy_fence_us)"),
        **_COMMON_SOURCES,
    },
)

WIRES: Dict[str, WireProfile] = {w.name: w for w in (H100_NDR_IBGDA, H100_NDR_IBRC, A100_SLINGSHOT)}


def get_wire(name: str) -> WireProfile:
    if name not in WIRES:
        raise KeyError(f"unknown wire profile {name!r}; known: {', '.join(WIRES)}")
    return WIRES[name]


def cost_table(wire: WireProfile) -> List[Dict[str, Any]]:
    """Every per-operation cost of ``wire`` with unit and source (machine numbers included)."""
    rows: List[Dict[str, Any]] = []
    for name in ("one_way_us", "rtt_us", "fence_us", "atomic_us", "post_us", "proxy_cmd_us",
                 "proxy_fence_us", "consistency_us", "signal_atomic_us", "launch_us", "ll_efficiency"):
        source = wire.sources.get(name, "")
        rows.append({"name": name, "value": float(getattr(wire, name)),
                     "unit": "us" if name.endswith("_us") else "ratio", "source": source,
                     "estimate": source.startswith("estimate")})
    machine = wire.machine_profile()
    for name, (unit, field_name) in _FROM_MACHINE.items():
        src = machine.sources.get(field_name, "")
        if name == "chained_store_us":
            src = _CHAIN_SOURCE
        rows.append({"name": name, "value": float(getattr(wire, name)), "unit": unit,
                     "source": f"machine profile {machine.name}.{field_name}: {src}",
                     "estimate": src.startswith(("assumption", "estimate", "one NVLink"))})
    return rows


# --- ledgers --------------------------------------------------------------------------------------

def _check(ledger: Mapping[str, Any]) -> None:
    if ledger.get("schema") != SCHEMA:
        raise ValueError(f"not a wire ledger: schema {ledger.get('schema')!r}, expected {SCHEMA!r}")
    for key in ("nodes", "gpus_per_node", "size", "plan", "steps"):
        if key not in ledger:
            raise ValueError(f"wire ledger {ledger.get('layout', '?')} {ledger.get('size', '?')}: no {key!r}")


def load_ledger(path: str) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    try:
        _check(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    data.setdefault("source_file", path)
    return data


def load_ledgers(directory: str) -> List[Dict[str, Any]]:
    """Every ``*.json`` wire ledger in ``directory`` (other JSON files are skipped)."""
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        try:
            out.append(load_ledger(path))
        except (ValueError, json.JSONDecodeError):
            continue
    return out


def ledger_for(ledgers: Sequence[Mapping[str, Any]], nodes: int, gpus: int, size: int,
               dtype: Optional[str] = None) -> Optional[Mapping[str, Any]]:
    """The one ledger of (nodes, gpus, size[, dtype]) among ``ledgers``, or None.

    Several matches are an error: a directory the table reads holds one call per layout and size
    (the plan the defaults choose), alternatives go to :func:`fastest`.
    """
    found = [led for led in ledgers if led["nodes"] == nodes and led["gpus_per_node"] == gpus
             and led["size"] == size and (dtype is None or led.get("dtype") == dtype)]
    if len(found) > 1:
        names = ", ".join(str(led.get("source_file", "?")) for led in found)
        raise ValueError(f"several ledgers for {nodes}x{gpus} {size} bytes: {names}; keep one per "
                         "layout and size (or pass --dtype)")
    return found[0] if found else None


def _counters(entry: Mapping[str, Any]) -> Dict[str, int]:
    return {k: int(entry.get(k, 0) or 0) for k in COUNTERS}


def _chunk_len(ledger: Mapping[str, Any], chunk: int) -> int:
    plan = ledger["plan"]
    chunk_bytes = int(plan.get("chunk_bytes") or ledger["size"])
    return max(0, min(chunk_bytes, int(ledger["size"]) - chunk * chunk_bytes))


def _net_share(wire: WireProfile, gpus: int) -> float:
    return max(1.0, gpus / wire.machine_profile().nics_per_node)


# --- pricing --------------------------------------------------------------------------------------

def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def price_inter_step(step: Mapping[str, Any], ledger: Mapping[str, Any], wire: WireProfile) -> Dict[str, Any]:
    """The modelled time of one inter-node ledger step and its terms (us), from its ``max`` counters."""
    if step.get("phase") != "inter_node":
        raise ValueError(f"not an inter-node step: {step.get('phase')!r}")
    m = _counters(step.get("max", {}))
    terms: Dict[str, float] = {}
    proxy_fences = m[f"proxy_fences_{wire.transport}"]
    if not wire.proxy:
        # The ledger counts per PE, over its blocks; each block that sends (one data message
        # each) issues its own before-data operations, in parallel with the others.
        senders = max(1, m["puts"] + m["put_signals"] + m["ll_puts"])
        terms["fences_before_data"] = _ceil_div(m["fences_before_data"], senders) * wire.fence_us
        terms["signal_ops_before_data"] = _ceil_div(m["signal_ops_before_data"], senders) * wire.atomic_us
        terms["messages"] = m["messages_max_per_peer"] * wire.post_us
        terms["proxy_fences"] = proxy_fences * wire.fence_us
        # The signal of a put-with-signal lands after its data (the messages go in parallel).
        terms["signal_atomic"] = (1 if m["put_signals"] else 0) * wire.signal_atomic_us
    else:
        commands = (m["puts"] + m["put_signals"] + m["ll_puts"] + m["signal_ops"] + m["remote_atomics"]
                    + m["fences"] + m["quiets"] + proxy_fences)
        terms["proxy_commands"] = commands * wire.proxy_cmd_us
        blocking = m["quiets"] + (m["fences"] if wire.fence_is_quiet else 0)
        terms["proxy_waits"] = blocking * wire.rtt_us
        terms["proxy_fences"] = proxy_fences * wire.proxy_fence_us
    gpus = int(ledger["gpus_per_node"])
    terms["bytes"] = (m["inter_node_bytes"] * _net_share(wire, gpus)) / (wire.nic_bw_GBps * 1e3)
    terms["one_way"] = wire.one_way_us
    terms["consistency"] = m["consistency_waits"] * wire.consistency_us
    return {"chunk": step.get("chunk", 0), "phase": "inter_node", "step": step.get("step"),
            "protocol": step.get("protocol"), "us": sum(terms.values()), "terms": terms}


def _chain(steps: Sequence[Mapping[str, Any]], phases: Sequence[str]) -> int:
    return max([_counters(s.get("max", {}))["release_chain_max"] for s in steps if s["phase"] in phases] or [0])


def _in_node(chunk: int, phase: str, terms: Dict[str, float]) -> Dict[str, Any]:
    return {"chunk": chunk, "phase": phase, "step": 0, "protocol": None, "us": sum(terms.values()),
            "terms": terms}


def price_chunk(ledger: Mapping[str, Any], chunk: int, wire: WireProfile) -> List[Dict[str, Any]]:
    """The priced phases of one chunk, in order: stage-in, reduce-scatter (two-shot) or one-shot,
    the inter-node steps, all-gather (two-shot). In-node phases follow the plan's algorithm whether
    or not the ledger has a step for them (a phase that stores no flag records none)."""
    steps = [s for s in ledger["steps"] if int(s.get("chunk", 0)) == chunk]
    gpus = int(ledger["gpus_per_node"])
    length = _chunk_len(ledger, chunk)
    two_shot = ledger["plan"].get("algorithm", "two-shot") != "one-shot"
    out: List[Dict[str, Any]] = []
    if gpus > 1:
        # Stage-in: my input copied into the symmetric buffer (two-shot: all but my own shard).
        staged = (gpus - 1) * length / gpus if two_shot else length
        out.append(_in_node(chunk, "stage_in", {"hbm": 2.0 * staged / (wire.hbm_bw_GBps * 1e3)}))
        # The phase gated by stage-in's ready flags: one flag hop, the rest of a chain of release
        # stores, the peers' shards (two-shot) or whole chunks (one-shot) over NVLink.
        chain = _chain(steps, ("stage_in", "reduce_scatter", "one_shot"))
        nvl_bytes = (gpus - 1) * length / gpus if two_shot else (gpus - 1) * length
        out.append(_in_node(chunk, "reduce_scatter" if two_shot else "one_shot", {
            "nvlink_latency": wire.nvl_alpha_us,
            "release_chain": max(0, chain - 1) * wire.chained_store_us,
            "nvlink_bytes": nvl_bytes / (wire.nvl_bw_GBps * 1e3)}))
    out.extend(price_inter_step(s, ledger, wire) for s in steps if s["phase"] == "inter_node")
    if gpus > 1 and two_shot:
        chain = _chain(steps, ("all_gather",))
        out.append(_in_node(chunk, "all_gather", {
            "nvlink_latency": wire.nvl_alpha_us,
            "release_chain": max(0, chain - 1) * wire.chained_store_us,
            "nvlink_bytes": (gpus - 1) * length / gpus / (wire.nvl_bw_GBps * 1e3)}))
    return out


def _chunks(ledger: Mapping[str, Any]) -> List[int]:
    found = {int(s.get("chunk", 0)) for s in ledger["steps"]}
    planned = int(ledger["plan"].get("chunks") or 0)
    return sorted(found | set(range(planned)))


def price(ledger: Mapping[str, Any], wire: "WireProfile | str") -> Dict[str, Any]:
    """Modelled latency (us) of the call a ledger records, with a per-phase, per-step breakdown."""
    w = get_wire(wire) if isinstance(wire, str) else wire
    _check(ledger)
    for s in ledger["steps"]:
        if s["phase"] not in IN_NODE_PHASES + ("inter_node",):
            raise ValueError(f"unknown phase {s['phase']!r} in wire ledger step {s.get('step')}")
    steps = [p for c in _chunks(ledger) for p in price_chunk(ledger, c, w)]
    by_phase: Dict[str, float] = {}
    for s in steps:
        by_phase[s["phase"]] = by_phase.get(s["phase"], 0.0) + s["us"]
    total = w.launch_us + sum(s["us"] for s in steps)
    plan = ledger["plan"]
    return {
        "wire": w.name, "machine": w.machine, "transport": w.transport,
        "layout": f"{ledger['nodes']}x{ledger['gpus_per_node']}", "size": int(ledger["size"]),
        "kernel": ledger.get("kernel"), "device_code": ledger.get("device_code"),
        "algorithm": plan.get("algorithm"), "chunks": plan.get("chunks"),
        "blocks": plan.get("blocks"), "channels": plan.get("channels"),
        "protocols": sorted({str(s.get("protocol")) for s in ledger["steps"] if s.get("protocol")}),
        "extrapolated_from": ledger.get("extrapolated_from"),
        "total_us": total, "launch_us": w.launch_us, "by_phase_us": by_phase, "steps": steps,
        "note": DECISION_NOTE,
    }


# --- extrapolation ------------------------------------------------------------------------------

def _log2_floor(n: int) -> int:
    return n.bit_length() - 1


def inter_node_steps(nodes: int) -> List[str]:
    """Kinds of the inter-node steps of recursive doubling over ``nodes``, in order."""
    if nodes <= 1:
        return []
    pow2 = 1 << _log2_floor(nodes)
    kinds = ["exchange"] * _log2_floor(pow2)
    return ["fold_in", *kinds, "fold_out"] if nodes > pow2 else kinds


def _step_kinds(ledger: Mapping[str, Any]) -> Dict[int, str]:
    kinds = {int(s["step"]): str(s["kind"]) for s in ledger["plan"].get("inter_steps", [])}
    if kinds:
        return kinds
    return dict(enumerate(inter_node_steps(int(ledger["nodes"]))))


def extrapolate(ledger: Mapping[str, Any], nodes: int) -> Dict[str, Any]:
    """The ledger of the same call on ``nodes`` nodes by the step-count rule (module docstring).

    In-node steps are kept; each chunk's inter-node steps become ``inter_node_steps(nodes)``, every
    exchange a copy of the chunk's last measured exchange step and every fold step a copy of the
    measured fold step of the same kind (of the exchange step where the measured layout has none).
    ``per_pe`` lists are dropped; ``call.max`` becomes the sum of the steps' maxima (an upper bound
    of the measured definition, equal to it where one PE is the slowest in every step).
    """
    _check(ledger)
    src_nodes = int(ledger["nodes"])
    if src_nodes < 2 or nodes < 2:
        raise ValueError("extrapolation needs a ledger with inter-node steps and a target of >= 2 nodes")
    kinds = _step_kinds(ledger)
    out = copy.deepcopy(dict(ledger))
    by_chunk: Dict[int, List[Dict[str, Any]]] = {}
    for s in out["steps"]:
        by_chunk.setdefault(int(s.get("chunk", 0)), []).append(s)
    target = inter_node_steps(nodes)
    new_steps: List[Dict[str, Any]] = []
    for chunk in sorted(by_chunk):
        steps = by_chunk[chunk]
        pos = [i for i, s in enumerate(steps) if s["phase"] == "inter_node"]
        if not pos:
            raise ValueError(f"ledger {ledger.get('layout')}: chunk {chunk} has no inter-node step")
        model: Dict[str, Dict[str, Any]] = {}
        for i in pos:
            model[kinds.get(int(steps[i]["step"]), "exchange")] = steps[i]  # the last of each kind
        if "exchange" not in model:
            raise ValueError(f"ledger {ledger.get('layout')}: chunk {chunk} has no measured exchange step")
        new_steps.extend(s for i, s in enumerate(steps) if i < pos[0] and s["phase"] != "inter_node")
        for i, kind in enumerate(target):
            step = copy.deepcopy(model.get(kind, model["exchange"]))
            step["step"] = i
            new_steps.append(step)
        new_steps.extend(s for i, s in enumerate(steps) if i > pos[-1] and s["phase"] != "inter_node")
    for s in new_steps:
        s.pop("per_pe", None)
    out["steps"] = new_steps
    gpus = int(ledger["gpus_per_node"])
    out.update(nodes=nodes, pes=nodes * gpus, layout=f"{nodes}x{gpus}")
    templates: List[Dict[str, Any]] = list(ledger["plan"].get("inter_steps", []))
    by_kind: Dict[str, Dict[str, Any]] = {}
    for tpl in templates:
        by_kind.setdefault(str(tpl.get("kind")), tpl)
    fallback: Dict[str, Any] = by_kind.get("exchange", templates[0] if templates else {})
    out["plan"]["inter_steps"] = [{**by_kind.get(kind, fallback), "step": i, "kind": kind}
                                  for i, kind in enumerate(target)]
    total = {k: 0 for k in COUNTERS}
    for s in new_steps:
        for k, v in _counters(s.get("max", {})).items():
            total[k] = max(total[k], v) if k == "release_chain_max" else total[k] + v
    out["call"] = {"max": total, "per_pe": []}
    out["extrapolated_from"] = {"layout": f"{src_nodes}x{gpus}", "kernel": ledger.get("kernel"),
                                "rule": "inter-node steps per chunk = log2 N' exchanges + 2 folds if N > N'"}
    return out


# --- decisions ----------------------------------------------------------------------------------

def rank(ledgers: Sequence[Mapping[str, Any]], wire: "WireProfile | str") -> List[Tuple[float, Mapping[str, Any]]]:
    """(modelled us, ledger) of alternative plans of one call, fastest first.

    All ledgers must record the same layout and size (alternative plans of one call).
    """
    if not ledgers:
        raise ValueError("no ledgers to compare")
    keys = {(led["nodes"], led["gpus_per_node"], led["size"]) for led in ledgers}
    if len(keys) != 1:
        raise ValueError(f"ledgers of different calls cannot be compared: {sorted(keys)}")
    priced = [(price(led, wire)["total_us"], led) for led in ledgers]
    return sorted(priced, key=lambda p: p[0])


def fastest(ledgers: Sequence[Mapping[str, Any]], wire: "WireProfile | str") -> Mapping[str, Any]:
    """The ledger whose plan the wire profile prices fastest (first given wins a tie)."""
    return rank(ledgers, wire)[0][1]


def price_channels(ledgers: Sequence[Mapping[str, Any]], wire: "WireProfile | str") -> Dict[int, float]:
    """Modelled us per channel count, from ledgers of one call that differ in ``plan.channels``."""
    out: Dict[int, float] = {}
    for us, led in rank(ledgers, wire):
        channels = led["plan"].get("channels")
        if channels is None:
            raise ValueError(f"ledger {led.get('source_file', led.get('layout'))} has no plan.channels")
        out.setdefault(int(channels), us)
    return out


def best_channels(ledgers: Sequence[Mapping[str, Any]], wire: "WireProfile | str") -> int:
    """The channel count the wire profile prices fastest."""
    priced = price_channels(ledgers, wire)
    return min(priced, key=lambda c: (priced[c], c))


# --- comparison table ---------------------------------------------------------------------------

TABLE_SIZES: Tuple[int, ...] = tuple(k << 10 for k in (128, 256, 512, 1024, 2048))
TABLE_NODES: Tuple[int, ...] = (2, 4, 8, 16)


def kernel_cell(ledgers: Sequence[Mapping[str, Any]], nodes: int, gpus: int, size: int,
                wire: WireProfile, dtype: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """A kernel's modelled time for one cell: its ledger of that layout if there is one, else the
    ledger of the most nodes (>= 2, same GPUs per node and size) extrapolated; None without either."""
    led = ledger_for(ledgers, nodes, gpus, size, dtype)
    how = "ledger"
    if led is None:
        fewer = [x for x in ledgers if x["gpus_per_node"] == gpus and x["size"] == size
                 and 2 <= x["nodes"] < nodes and (dtype is None or x.get("dtype") == dtype)]
        if not fewer:
            return None
        most = max(x["nodes"] for x in fewer)
        base = ledger_for(fewer, most, gpus, size, dtype)
        assert base is not None
        led = extrapolate(base, nodes)
        how = f"extrapolated from {most}x{gpus}"
    priced = price(led, wire)
    return {"us": priced["total_us"], "how": how, "algorithm": priced["algorithm"],
            "protocols": priced["protocols"], "kernel": priced["kernel"],
            "device_code": priced["device_code"]}


def nccl_cell(nodes: int, gpus: int, size: int, wire: WireProfile) -> Dict[str, Any]:
    """NCCL for one cell: the published figure where anchors.py has one (measured), else the
    alpha-beta model of nvrar.model.latency on the wire's machine profile (modelled)."""
    for a in ANCHORS:
        if (a.profile, a.nodes, a.gpus, a.size, a.key) == (wire.machine, nodes, gpus, size, "nccl"):
            return {"us": a.mid, "how": "measured", "range": [a.low, a.high], "source": a.source}
    us = float(predict(size, nodes, gpus, wire.machine_profile())["predicted_us"]["nccl"])
    return {"us": us, "how": "modelled", "source": f"nvrar.model.latency on {wire.machine}"}


def comparison_table(wire: "WireProfile | str", old: Sequence[Mapping[str, Any]],
                     new: Sequence[Mapping[str, Any]], gpus: Optional[int] = None,
                     sizes: Sequence[int] = TABLE_SIZES, nodes: Sequence[int] = TABLE_NODES,
                     dtype: Optional[str] = None) -> Dict[str, Any]:
    """{size: {nodes: {"old", "new", "nccl"}}} for the wire profile's machine (G from it by default)."""
    w = get_wire(wire) if isinstance(wire, str) else wire
    g = gpus or w.machine_profile().gpus_per_node
    rows: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for size in sizes:
        row = rows.setdefault(str(size), {})
        for n in nodes:
            cell: Dict[str, Any] = {"old": kernel_cell(old, n, g, size, w, dtype),
                                    "new": kernel_cell(new, n, g, size, w, dtype),
                                    "nccl": nccl_cell(n, g, size, w)}
            if cell["new"] is not None:
                cell["nccl_over_new"] = cell["nccl"]["us"] / cell["new"]["us"]
            if cell["old"] is not None:
                cell["nccl_over_old"] = cell["nccl"]["us"] / cell["old"]["us"]
            row[str(n)] = cell
    return {"wire": w.name, "machine": w.machine, "gpus_per_node": g, "table": rows, "note": DECISION_NOTE}


# --- byte floors ----------------------------------------------------------------------------------

def inter_node_byte_floor(ledger: Mapping[str, Any]) -> Dict[str, Any]:
    """The fewest inter-node bytes one PE must send in the call the ledger records, and a budget.

    Per chunk of ``len`` bytes, the PE that sends most sends in every exchange step and in one fold
    step (when N is not a power of two): ``len / G`` each for two-shot, ``len`` for one-shot.
    ``budget`` allows 1.05x of a put-with-signal step's floor and 1.05 / ll_efficiency (2.1x) of an
    LL step's (the flag half of each LL packet), by the protocol each inter-node step of the plan
    uses. Returns {"floor", "budget", "measured"} in bytes (measured: the ledger's call maximum).
    """
    _check(ledger)
    nodes, gpus = int(ledger["nodes"]), int(ledger["gpus_per_node"])
    kinds = inter_node_steps(nodes)
    sending = [k for k in kinds if k != "fold_out"]  # the busiest PE sends in one of the two folds
    protocol = {int(s["step"]): s.get("protocol") for s in ledger["plan"].get("inter_steps", [])}
    two_shot = ledger["plan"].get("algorithm", "two-shot") != "one-shot"
    ll = 1.05 / H100_NDR_IBGDA.ll_efficiency
    floor = budget = 0.0
    for chunk in _chunks(ledger):
        length = _chunk_len(ledger, chunk)
        per_step = length / gpus if two_shot else float(length)
        for i, _ in enumerate(sending):
            floor += per_step
            budget += per_step * (ll if protocol.get(i) == "ll" else 1.05)
    measured = int(_counters(ledger.get("call", {}).get("max", {}))["inter_node_bytes"])
    return {"floor": floor, "budget": budget, "measured": measured}
