"""Published all-reduce latencies the built-in profiles are calibrated against.

Copied from the table of published measurements in the project's shared notes ("ANCHORS", not
part of this repository): this module is where a reader of the repository finds them.

Each anchor names the profile it belongs to, the layout, the size, the measured range in
microseconds, which model output it is compared with, and where the number comes from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from .fit import Observation
from .latency import predict
from .profiles import Profile

__all__ = ["Anchor", "ANCHORS", "residuals", "observations"]

KB = 1024
MB = 1024 * 1024


@dataclass(frozen=True)
class Anchor:
    """A published measurement: ``low``-``high`` us for ``size`` bytes on ``nodes`` x ``gpus``."""

    profile: str
    nodes: int
    gpus: int
    size: int
    low: float
    high: float
    key: str  # model output compared: "nccl" (best of ring/tree) or an "nvrar_<variant>_<transport>"
    source: str
    calibrated: bool = True  # False: shown for context, outside the calibrated range

    @property
    def mid(self) -> float:
        return 0.5 * (self.low + self.high)


_PM_NCCL = "Perlmutter NCCL 2.21.5, nccl-tests (sparticlesteve/podman-nccl-testing)"
_PM_NVRAR = "NVRAR reference, tuned, bf16, no CUDA graphs (axonn-ai/yalis tune_results.json)"
_AZ = "Azure H100 2x8 NCCL, read off a plot (microsoft/mscclpp docs)"
_DGX = "DGX H100 1x8 NCCL (NVIDIA/dgxc-benchmarking)"

ANCHORS: Tuple[Anchor, ...] = (
    Anchor("perlmutter", 2, 4, 8 * KB, 31, 45, "nccl", _PM_NCCL, calibrated=False),
    Anchor("perlmutter", 2, 4, 128 * KB, 46, 65, "nccl", _PM_NCCL),
    Anchor("perlmutter", 2, 4, 1 * MB, 132, 143, "nccl", _PM_NCCL),
    Anchor("perlmutter", 2, 4, 2 * MB, 200, 208, "nccl", _PM_NCCL),
    Anchor("perlmutter", 2, 4, 4 * MB, 257, 259, "nccl", _PM_NCCL, calibrated=False),
    Anchor("perlmutter", 4, 4, 128 * KB, 77, 77, "nvrar_two_shot_ll", _PM_NVRAR),
    Anchor("perlmutter", 4, 4, 512 * KB, 105, 105, "nvrar_two_shot_ll", _PM_NVRAR),
    Anchor("perlmutter", 4, 4, 1 * MB, 158, 158, "nvrar_two_shot_ll", _PM_NVRAR),
    Anchor("h100-ndr400", 2, 8, 8 * KB, 42, 42, "nccl", _AZ),
    Anchor("h100-ndr400", 2, 8, 128 * KB, 50, 50, "nccl", _AZ),
    Anchor("h100-ndr400", 2, 8, 1 * MB, 89, 89, "nccl", _AZ),
    Anchor("h100-ndr400", 1, 8, 8 * KB, 17.4, 17.4, "nccl", _DGX),
    Anchor("h100-ndr400", 1, 8, 1 * MB, 27.4, 27.4, "nccl", _DGX),
    Anchor("h100-ndr400", 1, 8, 4 * MB, 54.2, 54.2, "nccl", _DGX),
)


def observations(profile_name: str, calibrated_only: bool = True) -> List[Observation]:
    """The anchors of one profile as fit observations (NCCL rows: best of ring and tree)."""
    return [
        Observation(a.key.split("_")[0], a.key.partition("_")[2] or "auto",
                    a.nodes, a.gpus, a.size, a.mid)
        for a in ANCHORS
        if a.profile == profile_name and (a.calibrated or not calibrated_only)
    ]


def residuals(profile: Profile, anchor_profile: Optional[str] = None) -> List[Dict[str, Any]]:
    """Model vs anchor for every anchor of ``anchor_profile`` (default: the profile's own name).

    ``rel_error`` is (model - mid) / mid, mid being the middle of the published range.
    """
    name = anchor_profile or profile.name
    out = []
    for a in ANCHORS:
        if a.profile != name:
            continue
        model = float(predict(a.size, a.nodes, a.gpus, profile)["predicted_us"][a.key])
        out.append({
            "key": a.key, "nodes": a.nodes, "gpus_per_node": a.gpus, "bytes": a.size,
            "measured_us": [a.low, a.high], "predicted_us": model,
            "rel_error": (model - a.mid) / a.mid, "calibrated": a.calibrated, "source": a.source,
        })
    return out
