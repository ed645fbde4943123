"""Summarize an nvrar-bench JSON file as a markdown table: per size, nvrar (ordinary and
symmetric buffers, the auto policy) against the best peer, with the ratios the targets use.

    python benchmarks/summarize.py docs/cpu-2ranks.json [warm|cold]

One timing per table (default warm: back-to-back calls; rows of a file written before
nvrar-bench had --timing carry no timing and are warm ones).
"""

from __future__ import annotations

import json
import sys
from typing import Dict, List


def fmt(n: int) -> str:
    for unit, div in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def pick(at: List[dict], backend: str, algorithm: str = "auto", buffers: str = "ordinary",
         timing: str = "warm") -> dict:
    """The row of ``backend`` among one size's rows of that timing (nvrar: of that variant and
    buffer kind), or {}."""
    for r in at:
        if r.get("timing", "warm") != timing:
            continue
        if r["backend"] == backend and (backend != "nvrar" or (r["algorithm"] == algorithm and
                                                             r.get("buffers", "ordinary") == buffers)):
            return r
    return {}


def main(argv: List[str]) -> int:
    if len(argv) not in (1, 2) or (len(argv) == 2 and argv[1] not in ("warm", "cold")):
        print(__doc__, file=sys.stderr)
        return 2
    timing = argv[1] if len(argv) == 2 else "warm"
    with open(argv[0]) as f:
        data = json.load(f)
    rows = data["results"]
    meta = data["meta"]
    by_size: Dict[int, List[dict]] = {}
    for r in rows:
        by_size.setdefault(r["bytes"], []).append(r)
    peers = sorted({r["backend"] for r in rows if r["backend"] != "nvrar"})
    head = ["size", "nvrar auto (us)", "nvrar auto, symmetric (us)"] + [f"{p} (us)" for p in peers]
    head += ["nvrar / best peer", "symmetric / best peer", "busbw nvrar (GB/s)"]
    print(f"{meta['world_size']} ranks ({meta['ranks_per_node']} per node), {meta['dtype']} {meta['op']}, {timing} "
          f"timing, "
          f"median of the per-iteration maximum over ranks, {meta['iters']} iterations; memcpy "
          f"{meta['memcpy_gbps']:.1f} GB/s (1 core)\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for size in sorted(by_size):
        at = by_size[size]
        nv = pick(at, "nvrar", timing=timing)
        sym = pick(at, "nvrar", buffers="symmetric", timing=timing)
        peer_rows = [pick(at, p, timing=timing) for p in peers]
        best = min((r["median_us"] for r in peer_rows if r), default=None)
        cells = [fmt(size), f"{nv.get('median_us', float('nan')):.1f}", f"{sym.get('median_us', float('nan')):.1f}"]
        cells += [f"{r['median_us']:.1f}" if r else "-" for r in peer_rows]
        cells += [f"{nv['median_us'] / best:.2f}x" if nv and best else "-",
                  f"{sym['median_us'] / best:.2f}x" if sym and best else "-",
                  f"{nv.get('busbw_gbps', float('nan')):.2f}"]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
