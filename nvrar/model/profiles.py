"""Machine profiles: the alpha-beta(-gamma) parameters of the latency model, each with a source.

A latency parameter (``*_us``) is an alpha in microseconds. A bandwidth parameter (``*_GBps``,
1 GB/s = 1e9 B/s = 1e3 B/us) enters the model as its inverse, a beta in us per byte. The gamma
(reduction and local-copy cost) is the inverse of ``hbm_bw_GBps``. Every cost in
:mod:`nvrar.model.latency` is a linear combination of these alphas and betas, which is what lets
:mod:`nvrar.model.fit` calibrate them by linear least squares.

Sources are cited per field in ``Profile.sources``. "ANCHORS" means the table of published
measurements and hardware constants in the project's shared notes, not part of this repository
(each row there names its own origin; the measurements are in :mod:`nvrar.model.anchors`); "fit: ..." means the value was chosen so that the model reproduces the named
measurement (see docs/planner.md for the residuals).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Dict, Mapping

__all__ = [
    "Profile",
    "PARAMS",
    "PROFILES",
    "get_profile",
    "linear_value",
    "with_linear_values",
]

# name -> (unit, meaning). The order is the order of the fit's unknowns.
PARAMS: Dict[str, tuple] = {
    "nvrar_overhead_us": ("us", "fixed cost of one nvrar call: kernel launches and host work"),
    "nvl_alpha_us": ("us", "one intra-node phase: flag store and peer poll over NVLink"),
    "nvl_bw_GBps": ("GB/s", "NVLink bandwidth per GPU, one direction (beta = 1/bw)"),
    "hbm_bw_GBps": ("GB/s", "local memory bandwidth: stage-in copy and reduction (gamma = 1/bw)"),
    "net_ll_alpha_us": ("us", "one inter-node step with low-latency flag-in-word packets"),
    "net_signal_alpha_us": ("us", "one inter-node step with put-with-signal"),
    "net_bw_GBps": ("GB/s", "NVSHMEM put bandwidth per NIC (beta = 1/bw)"),
    "nccl_base_us": ("us", "NCCL fixed cost per call: launch plus NCCL's base latency"),
    "nccl_nvl_alpha_us": ("us", "NCCL latency of one NVLink step"),
    "nccl_ring_net_alpha_us": ("us", "NCCL ring latency of one inter-node step"),
    "nccl_tree_net_alpha_us": ("us", "NCCL tree latency of one inter-node tree level"),
    "nccl_ring_bw_GBps": ("GB/s", "NCCL ring bus bandwidth across nodes (beta = 1/bw)"),
    "nccl_tree_bw_GBps": ("GB/s", "NCCL tree bus bandwidth across nodes (beta = 1/bw)"),
    "nccl_intra_bw_GBps": ("GB/s", "NCCL bus bandwidth within one node (beta = 1/bw)"),
}

_BANDWIDTHS = frozenset(name for name, (unit, _) in PARAMS.items() if unit == "GB/s")


@dataclass(frozen=True)
class Profile:
    """One machine: its shape, its latency-model parameters (see ``PARAMS``) and their sources."""

    name: str
    description: str
    gpus_per_node: int
    nics_per_node: int
    nvrar_overhead_us: float
    nvl_alpha_us: float
    nvl_bw_GBps: float
    hbm_bw_GBps: float
    net_ll_alpha_us: float
    net_signal_alpha_us: float
    net_bw_GBps: float
    nccl_base_us: float
    nccl_nvl_alpha_us: float
    nccl_ring_net_alpha_us: float
    nccl_tree_net_alpha_us: float
    nccl_ring_bw_GBps: float
    nccl_tree_bw_GBps: float
    nccl_intra_bw_GBps: float
    sources: Dict[str, str] = field(default_factory=dict, compare=False)

    def params(self) -> Dict[str, float]:
        """The model parameters, by name, in their physical units."""
        return {name: float(getattr(self, name)) for name in PARAMS}

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Profile":
        known = {f.name for f in fields(cls)}
        missing = known - set(data) - {"sources"}
        if missing:
            raise ValueError(f"profile is missing {sorted(missing)}")
        return cls(**{k: v for k, v in data.items() if k in known})

    def updated(self, **values: Any) -> "Profile":
        """A copy with some parameters replaced (unknown names raise TypeError)."""
        return replace(self, **values)


def linear_value(profile: Profile, name: str) -> float:
    """The value the model multiplies: an alpha in us, or for a bandwidth its beta in us/byte."""
    value = float(getattr(profile, name))
    return 1.0 / (value * 1e3) if name in _BANDWIDTHS else value


def with_linear_values(profile: Profile, values: Mapping[str, float]) -> Profile:
    """Inverse of :func:`linear_value`: a copy of ``profile`` with alphas/betas replaced."""
    physical: Dict[str, Any] = {
        name: (1.0 / (v * 1e3) if name in _BANDWIDTHS else v) for name, v in values.items()
    }
    return replace(profile, **physical)


# --- sources shared by the profiles -------------------------------------------------------------
_NCCL_TUNING = "NCCL src/graph/tuning.cc (github.com/NVIDIA/nccl)"
_LAUNCH = "ANCHORS: kernel launch about 2.6 us minimum"
_REF_OVERHEAD = (
    "6 kernel launches per call in the reference implementation (the project's shared notes: its known defects) "
    "x 2.6 us (ANCHORS kernel launch); no CUDA graphs, as in the reference measurement"
)
_NVL_PHASE = (
    "assumption: one phase = flag store + poll, about two NVLink hops; NCCL's per-step NVLink LL "
    "latency is 0.47-0.6 us (ANCHORS, " + _NCCL_TUNING + ")"
)
_SIGNAL = (
    "assumption: put-with-signal adds a second ordered network operation (the signal) to each step, "
    "taken as 1.25x the LL step; no published measurement"
)

# Where a profile's NCCL constants follow NCCL's own tuning rules rather than a fit.
_NCCL_RULE_SOURCES = {
    "nccl_base_us": "NCCL baseLat ring LL 6.6 us (" + _NCCL_TUNING + ") + " + _LAUNCH,
    "nccl_tree_net_alpha_us": (
        "ring value x 5.0/2.7, NCCL's tree/ring network LL latency ratio (" + _NCCL_TUNING + ")"
    ),
    "nccl_tree_bw_GBps": "0.9 x ring bus bandwidth, NCCL's tree rule (" + _NCCL_TUNING + ")",
}

PERLMUTTER = Profile(
    name="perlmutter",
    description="NERSC Perlmutter GPU node: 4x A100-40GB on NVLink3, 4x Slingshot-11 NICs (200 Gb/s)",
    gpus_per_node=4,
    nics_per_node=4,
    nvrar_overhead_us=15.6,
    nvl_alpha_us=1.0,
    nvl_bw_GBps=300.0,
    hbm_bw_GBps=1555.0,
    net_ll_alpha_us=23.5,
    net_signal_alpha_us=29.4,
    net_bw_GBps=12.9,
    nccl_base_us=9.2,
    nccl_nvl_alpha_us=0.47,
    nccl_ring_net_alpha_us=13.2,
    nccl_tree_net_alpha_us=24.4,
    nccl_ring_bw_GBps=22.0,
    nccl_tree_bw_GBps=19.8,
    nccl_intra_bw_GBps=150.0,
    sources={
        "gpus_per_node": "ANCHORS: 4x A100 per Perlmutter node",
        "nics_per_node": "ANCHORS: 4 Slingshot-11 NICs per Perlmutter GPU node",
        "nvrar_overhead_us": _REF_OVERHEAD,
        "nvl_alpha_us": _NVL_PHASE,
        "nvl_bw_GBps": "ANCHORS: NVLink3 300 GB/s per direction per GPU",
        "hbm_bw_GBps": "NVIDIA A100 datasheet: 1555 GB/s HBM2 (A100-40GB)",
        "net_ll_alpha_us": (
            "fit: NVRAR reference, 16x A100, 128 KB / 512 KB / 1 MB = 77 / 105 / 158 us (ANCHORS); "
            "Slingshot has no IBGDA, every put goes through NVSHMEM's CPU proxy"
        ),
        "net_signal_alpha_us": _SIGNAL,
        "net_bw_GBps": (
            "fit: same NVRAR reference anchor (as LL packets); about half the 23-24 GB/s a Slingshot NIC achieves "
            "(ANCHORS), which the CPU-proxied puts do not reach"
        ),
        **_NCCL_RULE_SOURCES,
        "nccl_nvl_alpha_us": "NCCL hwLat NVLink ring LL 0.47 us (" + _NCCL_TUNING + ")",
        "nccl_ring_net_alpha_us": (
            "fit: NCCL 2.21.5 at 2x4, 128 KB / 1 MB / 2 MB = 46-65 / 132-143 / 200-208 us (ANCHORS); "
            "NCCL's own constant is 2.7 us, aws-ofi-nccl on Slingshot costs more"
        ),
        "nccl_ring_bw_GBps": (
            "fit: same 2x4 anchor; close to one Slingshot NIC's achieved 23-24 GB/s (ANCHORS)"
        ),
        "nccl_intra_bw_GBps": (
            "assumption: half the NVLink3 300 GB/s for NCCL at 128 KB-2 MB (no A100 single-node "
            "anchor)"
        ),
    },
)

_H100_NCCL_SOURCES = {
    **_NCCL_RULE_SOURCES,
    "nccl_nvl_alpha_us": (
        "NCCL hwLat NVLink ring LL 0.47 us (" + _NCCL_TUNING + "); with the base, reproduces DGX "
        "H100 1x8 8 KB = 17.4 us (ANCHORS)"
    ),
    "nccl_ring_net_alpha_us": "fit: Azure H100 2x8 NCCL 8 KB / 128 KB / 1 MB = 42 / 50 / 89 us (ANCHORS)",
    "nccl_ring_bw_GBps": (
        "fit: Azure H100 2x8 anchor; close to one NDR400 NIC's achieved 46-48 GB/s (ANCHORS)"
    ),
    "nccl_intra_bw_GBps": "fit: DGX H100 1x8 NCCL 1 MB / 4 MB = 27.4 / 54.2 us (ANCHORS)",
}

H100_NDR400 = Profile(
    name="h100-ndr400",
    description="8x H100-SXM on NVLink4 (NVSwitch), 8x InfiniBand NDR400 NICs per node",
    gpus_per_node=8,
    nics_per_node=8,
    nvrar_overhead_us=15.6,
    nvl_alpha_us=1.0,
    nvl_bw_GBps=370.0,
    hbm_bw_GBps=3350.0,
    net_ll_alpha_us=5.7,
    net_signal_alpha_us=7.1,
    net_bw_GBps=47.0,
    nccl_base_us=9.2,
    nccl_nvl_alpha_us=0.47,
    nccl_ring_net_alpha_us=5.7,
    nccl_tree_net_alpha_us=10.6,
    nccl_ring_bw_GBps=44.0,
    nccl_tree_bw_GBps=39.6,
    nccl_intra_bw_GBps=183.0,
    sources={
        "gpus_per_node": "DGX H100 / Azure ND H100 v5: 8 GPUs per node",
        "nics_per_node": "DGX H100 / Azure ND H100 v5: one 400 Gb/s NIC per GPU",
        "nvrar_overhead_us": _REF_OVERHEAD,
        "nvl_alpha_us": _NVL_PHASE,
        "nvl_bw_GBps": "ANCHORS: NVLink4 450 GB/s per direction, 370-377 GB/s measured",
        "hbm_bw_GBps": "NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3",
        "net_ll_alpha_us": (
            "assumption: one GPU-initiated (IBGDA) RDMA write + flag costs what one NCCL ring network "
            "step costs on the same fabric (nccl_ring_net_alpha_us); no NVRAR measurement on IB"
        ),
        "net_signal_alpha_us": _SIGNAL,
        "net_bw_GBps": "ANCHORS: InfiniBand NDR400 46-48 GB/s achieved per NIC (IBGDA reaches it)",
        **_H100_NCCL_SOURCES,
    },
)

H200_NDR400 = H100_NDR400.updated(
    name="h200",
    description="8x H200-SXM on NVLink4 (NVSwitch), 8x InfiniBand NDR400 NICs per node",
    hbm_bw_GBps=4800.0,
    sources={
        **H100_NDR400.sources,
        "hbm_bw_GBps": "NVIDIA H200 datasheet: 4.8 TB/s HBM3e",
        "nvl_bw_GBps": "ANCHORS: NVLink4 (H100/H200) 450 GB/s per direction, 370-377 GB/s measured",
        **{
            name: "carried over from h100-ndr400 (same NVLink4, NDR400 and NCCL; no H200 anchor): "
            + text
            for name, text in _H100_NCCL_SOURCES.items()
        },
    },
)

PROFILES: Dict[str, Profile] = {p.name: p for p in (PERLMUTTER, H100_NDR400, H200_NDR400)}


def get_profile(name_or_path: str) -> Profile:
    """A built-in profile by name, or a profile saved as JSON (e.g. by ``nvrar fit``)."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    if os.path.isfile(name_or_path):
        with open(name_or_path, encoding="utf-8") as fh:
            data = json.load(fh)
        return Profile.from_dict(data.get("profile", data))
    raise KeyError(
        f"unknown profile {name_or_path!r}: not a file and not one of {', '.join(sorted(PROFILES))}"
    )
