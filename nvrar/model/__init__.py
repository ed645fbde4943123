"""nvrar.model: communication planner and latency model for tensor-parallel inference.

Pure Python (numpy for the fit). Submodules:

* :mod:`~nvrar.model.cards`: model cards (L, h, v, heads) with their config.json sources;
* :mod:`~nvrar.model.volume`: communication volume and call counts of TP, PP and TP x PP;
* :mod:`~nvrar.model.profiles`: machine profiles, every parameter with unit and source;
* :mod:`~nvrar.model.latency`: alpha-beta-gamma costs of NVRAR, NCCL ring/tree, flat RD;
* :mod:`~nvrar.model.fit`: least-squares calibration from ``nvrar-bench --json`` output;
* :mod:`~nvrar.model.anchors`: published measurements and the residuals of the profiles;
* :mod:`~nvrar.model.plan`: the per-request plan behind ``nvrar plan``;
* :mod:`~nvrar.model.cli`: the ``plan``, ``model`` and ``fit`` subcommands.
"""

from __future__ import annotations

from .cards import CARDS, ModelCard, get_card
from .fit import FitResult, Observation, fit, load_bench, observations_from_bench
from .latency import flat_rd_terms, nccl_terms, nvrar_terms, predict
from .plan import make_plan
from .profiles import PARAMS, PROFILES, Profile, get_profile
from .volume import (
    Volume,
    allreduce_calls,
    hybrid_volume,
    message_bytes,
    pp_volume,
    tp_volume,
)

__all__ = [
    "CARDS", "ModelCard", "get_card",
    "FitResult", "Observation", "fit", "load_bench", "observations_from_bench",
    "flat_rd_terms", "nccl_terms", "nvrar_terms", "predict",
    "make_plan",
    "PARAMS", "PROFILES", "Profile", "get_profile",
    "Volume", "allreduce_calls", "hybrid_volume", "message_bytes", "pp_volume", "tp_volume",
]
