"""Calibrate a machine profile from measured latencies by linear least squares.

Input: the JSON that ``nvrar-bench --json`` writes::

    {"meta": {"world_size": W, "ranks_per_node": G, ...},
     "results": [{"backend": "nvrar" | "nccl" | ..., "algorithm": str, "bytes": int,
                  "median_us": float, "wrong": int, ...}, ...]}

Rows of backend "nvrar" and "nccl" are used (others, and rows with ``wrong`` > 0, are skipped).
Each row becomes an observation whose modeled cost is a linear combination of profile
parameters (:mod:`nvrar.model.latency`). The ``algorithm`` string narrows the candidates:
"one"/"two"/"hier" pick the NVRAR variant, "ll"/"signal"/"put" the transport, "flat" flat
recursive doubling, "ring"/"tree" the NCCL algorithm; anything else ("auto") means the fastest
candidate under the current parameters, re-chosen after each solve until the choice is stable.

The solve minimises relative errors, sum_i ((model_i - measured_i) / measured_i)^2, over the
scaled unknowns x_j = theta_j / theta0_j (theta0: the starting profile), plus a weak prior
``prior_weight * (x_j - 1)`` per unknown. The prior only decides what the data cannot: a parameter
that no row depends on, or a combination the rows cannot separate (e.g. launch overhead and alpha
measured on a single layout), stays at the starting profile. Parameters that would turn negative
are pinned at a floor and the rest re-solved. Fitting several files (several layouts) separates
more parameters. Solved with numpy.linalg.lstsq.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Sequence, Tuple

import numpy as np

from .latency import NVRAR_VARIANTS, Terms, evaluate, flat_rd_terms, nccl_terms, nvrar_terms
from .profiles import PARAMS, Profile, linear_value, with_linear_values

__all__ = [
    "BACKENDS",
    "Observation",
    "FitResult",
    "observations_from_bench",
    "load_bench",
    "fit",
]

BACKENDS: Tuple[str, ...] = ("nvrar", "nccl")
_FLOOR = 0.02  # smallest allowed x_j = theta_j / theta0_j


@dataclass(frozen=True)
class Observation:
    """One measured all-reduce latency and the algorithm(s) that may have produced it."""

    backend: str
    algorithm: str
    nodes: int
    gpus: int
    size: int
    measured_us: float

    def candidates(self, profile: Profile) -> Dict[str, Terms]:
        """The modeled costs this row may correspond to, by name."""
        alg = self.algorithm.lower().replace("-", "_")
        tokens = set(alg.replace("/", "_").split("_"))
        args = (self.size, self.nodes, self.gpus)
        if self.backend == "nccl":
            algos = [a for a in ("ring", "tree") if a in alg] or ["ring", "tree"]
            return {f"nccl_{a}": nccl_terms(*args, algorithm=a) for a in algos}
        transports = [t for t, keys in (("ll", ("ll",)), ("signal", ("signal", "put")))
                      if tokens & set(keys)] or ["ll", "signal"]
        if "flat" in alg:
            return {f"flat_rd_{t}": flat_rd_terms(*args, profile, t) for t in transports}
        variants = [v for v, keys in (("one_shot", ("one", "oneshot")),
                                      ("two_shot", ("two", "twoshot", "hier")))
                    if any(k in alg for k in keys)] or ["two_shot", "one_shot"]
        return {
            f"nvrar_{v}_{t}": nvrar_terms(*args, profile, v, t)
            for v, t in NVRAR_VARIANTS if v in variants and t in transports
        }


def observations_from_bench(doc: Mapping[str, Any], backends: Sequence[str] = BACKENDS,
                            stat: str = "median_us") -> List[Observation]:
    """Observations from one ``nvrar-bench --json`` document."""
    meta = doc.get("meta", {})
    world = int(meta["world_size"])
    gpus = int(meta.get("ranks_per_node") or world)
    if world % gpus:
        raise ValueError(f"world_size {world} is not a multiple of ranks_per_node {gpus}")
    out = []
    for row in doc.get("results", []):
        if row.get("backend") not in backends or row.get("wrong", 0):
            continue
        value = float(row[stat])
        if value <= 0 or int(row["bytes"]) <= 0:
            continue
        out.append(Observation(row["backend"], str(row.get("algorithm", "")), world // gpus, gpus,
                               int(row["bytes"]), value))
    return out


def load_bench(paths: Iterable[str], backends: Sequence[str] = BACKENDS,
               stat: str = "median_us") -> List[Observation]:
    """Observations from several benchmark JSON files (one layout per file)."""
    out: List[Observation] = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            out.extend(observations_from_bench(json.load(fh), backends, stat))
    return out


@dataclass
class FitResult:
    """The calibrated profile, what was fitted, and how well it matches each row."""

    profile: Profile
    fitted: List[str]
    rows: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def rms_rel_error(self) -> float:
        errs = [r["rel_error"] for r in self.rows]
        return float(np.sqrt(np.mean(np.square(errs)))) if errs else 0.0

    def to_dict(self) -> Dict[str, Any]:
        return {"profile": self.profile.to_dict(), "fitted": self.fitted,
                "rms_rel_error": self.rms_rel_error, "rows": self.rows}


def _choose(obs: Sequence[Observation], profile: Profile) -> List[Tuple[str, Terms]]:
    chosen = []
    for o in obs:
        cands = o.candidates(profile)
        name = min(cands, key=lambda k: evaluate(cands[k], profile))
        chosen.append((name, cands[name]))
    return chosen


def _solve(chosen: Sequence[Tuple[str, Terms]], obs: Sequence[Observation], start: Profile,
           names: List[str], prior_weight: float) -> Dict[str, float]:
    if not names:
        return {}
    theta0 = np.array([linear_value(start, n) for n in names])
    rows = len(obs)
    a = np.zeros((rows, len(names)))
    b = np.ones(rows)
    fixed_part = np.zeros(rows)
    for i, ((_, terms), o) in enumerate(zip(chosen, obs)):
        for name, coef in terms.items():
            if name in names:
                a[i, names.index(name)] = coef * theta0[names.index(name)] / o.measured_us
            else:
                fixed_part[i] += coef * linear_value(start, name) / o.measured_us
    b -= fixed_part
    free = np.ones(len(names), dtype=bool)
    x = np.ones(len(names))
    for _ in range(len(names) + 1):
        # Pinned unknowns move to the right-hand side; the prior keeps the rest well posed.
        rhs = b - a[:, ~free] @ x[~free]
        k = int(free.sum())
        lhs = np.vstack([a[:, free], prior_weight * np.eye(k)])
        rhs = np.concatenate([rhs, prior_weight * np.ones(k)])
        x[free] = np.linalg.lstsq(lhs, rhs, rcond=None)[0]
        low = free & (x < _FLOOR)
        if not low.any():
            break
        x[low] = _FLOOR
        free &= ~low
    return {n: float(theta0[j] * x[j]) for j, n in enumerate(names)}


def fit(observations: Sequence[Observation], start: Profile, *,
        fix: Iterable[str] = (), prior_weight: float = 1e-2, max_rounds: int = 20,
        label: str = "benchmark JSON") -> FitResult:
    """Fit ``start``'s alphas and betas to ``observations``; return the calibrated profile."""
    obs = list(observations)
    if not obs:
        raise ValueError("no usable rows: need nvrar or nccl results with bytes > 0 and wrong == 0")
    fix = set(fix)
    unknown = fix - set(PARAMS)
    if unknown:
        raise ValueError(f"cannot fix unknown parameters {sorted(unknown)}; known: {list(PARAMS)}")
    profile = start
    chosen = _choose(obs, profile)
    for _ in range(max_rounds):
        used = {n for _, terms in chosen for n, c in terms.items() if c}
        names = [n for n in PARAMS if n in used and n not in fix]
        profile = with_linear_values(start, _solve(chosen, obs, start, names, prior_weight))
        again = _choose(obs, profile)
        if [n for n, _ in again] == [n for n, _ in chosen]:
            break
        chosen = again
    sources = dict(start.sources)
    for n in names:
        sources[n] = f"fit: {label} ({len(obs)} rows), started from {start.name}"
    profile = profile.updated(name=f"{start.name}-fit", sources=sources)
    rows = []
    for (name, terms), o in zip(chosen, obs):
        model = evaluate(terms, profile)
        rows.append({"backend": o.backend, "algorithm": o.algorithm, "model": name,
                     "nodes": o.nodes, "gpus_per_node": o.gpus, "bytes": o.size,
                     "measured_us": o.measured_us, "predicted_us": model,
                     "rel_error": (model - o.measured_us) / o.measured_us})
    return FitResult(profile, names, rows)
