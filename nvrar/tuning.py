"""Tuning tables: the file format, load and save, and the table built from measured rows.
`nvrar tune` (nvrar.bench.tune) measures, per message size, nvrar's variants against the process
group's native all-reduce on the current topology, and writes the winner of every size to a JSON
file; nvrar.torch loads the table that matches its (device, world size, ranks per node). This
module sits below both: it imports neither the benchmark package nor torch.

File (NVRAR_TUNING_FILE, default ~/.cache/nvrar/tuning.json):

    {"format": "nvrar-tuning-1",
     "tables": [{"device": "cpu", "world_size": 4, "ranks_per_node": 2,
                 "buckets": [{"max_bytes": 8192, "choice": "one-shot"}, ...,
                             {"max_bytes": null, "choice": "native"}],
                 "measured": {...}}]}

A message of n bytes takes the choice of the first bucket with n <= max_bytes.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

from . import env
from .selector import NATIVE, Table

__all__ = ["FORMAT", "tuning_path", "load_table", "save_table", "buckets_from_measurements"]

FORMAT = "nvrar-tuning-1"


def tuning_path() -> str:
    return os.path.expanduser(env.get_str("NVRAR_TUNING_FILE") or "~/.cache/nvrar/tuning.json")


def _read(path: str) -> Dict[str, Any]:
    with open(path) as f:
        data = json.load(f)
    if data.get("format") != FORMAT or not isinstance(data.get("tables"), list):
        raise ValueError(f"{path} is not an nvrar tuning file (format {FORMAT!r})")
    return data


def load_table(device: str, world_size: int, ranks_per_node: int, path: Optional[str] = None) -> Optional[Table]:
    """The table for this topology, or None (no file, or no table for it). A file that exists but
    cannot be read is an error: silently falling back would hide a broken deployment."""
    path = path or tuning_path()
    if not os.path.exists(path):
        return None
    data = _read(path)
    for t in data["tables"]:
        if (t.get("device"), t.get("world_size"), t.get("ranks_per_node")) == (device, world_size, ranks_per_node):
            return Table(device, world_size, ranks_per_node, t["buckets"], source=path)
    return None


def save_table(table: Table, measured: Dict[str, Any], path: Optional[str] = None) -> str:
    """Add or replace the table of its topology in the file; returns the path."""
    path = path or tuning_path()
    data: Dict[str, Any] = {"format": FORMAT, "tables": []}
    if os.path.exists(path):
        data = _read(path)
    key = (table.device, table.world_size, table.ranks_per_node)
    data["tables"] = [t for t in data["tables"]
                      if (t.get("device"), t.get("world_size"), t.get("ranks_per_node")) != key]
    entry = table.to_json()
    entry["measured"] = measured
    data["tables"].append(entry)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def buckets_from_measurements(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per size the fastest of nvrar's variants and the native backend; neighbouring sizes with the
    same winner merge into one bucket; sizes above the largest measured go native."""
    sizes = sorted({r["bytes"] for r in rows})
    winners = []
    for size in sizes:
        at = [r for r in rows if r["bytes"] == size and r["wrong"] == 0]
        if not at:  # nothing ran correctly at this size: leave it to the native backend
            winners.append((size, NATIVE))
            continue
        best = min(at, key=lambda r: r["median_us"])
        winners.append((size, NATIVE if best["backend"] != "nvrar" else best["algorithm"]))
    buckets: List[Dict[str, Any]] = []
    for size, choice in winners:
        if buckets and buckets[-1]["choice"] == choice:
            buckets[-1]["max_bytes"] = size
        else:
            buckets.append({"max_bytes": size, "choice": choice})
    buckets.append({"max_bytes": None, "choice": NATIVE})
    if len(buckets) > 1 and buckets[-2]["choice"] == NATIVE:
        buckets.pop(-2)
    return buckets
