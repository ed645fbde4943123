#!/usr/bin/env python3
"""The wire model's price of every candidate plan, cell by cell, beside the plan nvrar.settings'
GPU defaults choose (docs/gpu/wire-model.md, "How the defaults were chosen").

    python3 scripts/wire_choices.py [--wire h100-ndr-ibgda] [--dir docs/gpu/ledgers/candidates]

Reads the ledgers that scripts/wire_candidates.sh writes (NxG-SIZE-ALGORITHM-PROTOCOL.json) and
prints one Markdown row per cell: each plan's modelled us, the model's fastest, the defaults' plan
and whether they agree. The defaults' plan is computed from nvrar.settings as the executor plans a
call: one-shot up to Settings.oneshot_max(G, N), LL while the step's payload to one peer (the
message / G for two-shot, the message for one-shot) is at most LL_MAX_BYTES["cuda"]. Modelled,
never measured: a tool for decisions.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from typing import Dict, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nvrar import env, settings  # noqa: E402
from nvrar.model import wire  # noqa: E402

NAME = re.compile(r"^(\d+)x(\d+)-(\d+)([KM])-(one-shot|two-shot)-(put_signal|ll)\.json$")
PLANS = (("one-shot", "put_signal"), ("one-shot", "ll"), ("two-shot", "put_signal"), ("two-shot", "ll"))


def defaults_plan(nodes: int, gpus: int, size: int) -> Tuple[str, str]:
    st = env.resolve("cuda")
    alg = "one-shot" if size <= st.oneshot_max(gpus, nodes) else "two-shot"
    payload = size if alg == "one-shot" else size // gpus
    ll_max = settings.LL_MAX_BYTES["cuda"]
    return alg, ("ll" if 0 < ll_max and payload <= ll_max else "put_signal")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wire", default="h100-ndr-ibgda", choices=sorted(wire.WIRES))
    ap.add_argument("--dir", default=os.path.join(ROOT, "docs", "gpu", "ledgers", "candidates"))
    a = ap.parse_args()
    cells: Dict[Tuple[int, int, int], Dict[Tuple[str, str], float]] = {}
    for path in sorted(glob.glob(os.path.join(a.dir, "*.json"))):
        m = NAME.match(os.path.basename(path))
        if not m:
            continue
        n, g = int(m.group(1)), int(m.group(2))
        size = int(m.group(3)) << (10 if m.group(4) == "K" else 20)
        led = wire.load_ledger(path)
        cells.setdefault((size, n, g), {})[(m.group(5), m.group(6))] = wire.price(led, a.wire)["total_us"]
    if not cells:
        print(f"no candidate ledgers under {a.dir} (scripts/wire_candidates.sh)", file=sys.stderr)
        return 1
    print(f"# {wire.DECISION_NOTE}; wire profile {a.wire}; modelled us per call")
    print("| size | nodes | " + " | ".join(f"{x} {p}" for x, p in PLANS) + " | model's fastest | defaults | agree |")
    print("|---" * (len(PLANS) + 5) + "|")
    disagree = 0
    for (size, n, g), priced in sorted(cells.items()):
        best = min(priced, key=lambda k: priced[k])
        mine = defaults_plan(n, g, size)
        ok = mine in priced and priced[mine] <= priced[best] + 1e-9
        disagree += not ok
        text = settings.size_text(size)
        cols = " | ".join(f"{priced[p]:.2f}" if p in priced else "-" for p in PLANS)
        print(f"| {text} | {n}x{g} | {cols} | {' '.join(best)} | {' '.join(mine)} | {'yes' if ok else 'NO'} |")
    print(f"# {len(cells)} cells, the defaults' plan the model's fastest in {len(cells) - disagree}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
