#!/usr/bin/env python3
"""Read the verdict of a scripts/gpu_check.sh run from its gpu_check.log: each step's status,
elapsed time and deadline, each nvcc unit's seconds, the notes and the final status.

    python scripts/gpu_verdict.py docs/gpu/logs/DATE-HOST/gpu_check.log   (or the folder)
    python scripts/gpu_verdict.py --json LOG

The log's lines it reads (gpu_check.sh writes them):

    gpu_check plan: setup=30 wheels=25 ... budget=530          (first line: the steps and deadlines)
    step-end: NAME STATUS rc=RC elapsed=S deadline=S            (as each step ends)
    verdict: step NAME STATUS rc=RC elapsed=S deadline=S        (the verdict, in the EXIT trap)
    verdict: unit NAME set=SET seconds=S rc=RC                  (SET: smoke, rest or all)
    verdict: note TEXT
    gpu_check: status N, S s of a B s budget                    (the last line of the verdict)

STATUS is ok, failed, timeout (stopped at its deadline) or skipped. A log cut off before its
verdict (the machine taken back) is read from its step-end lines and said to be incomplete; a
planned step that never ended is "not reached" (a dry run's log lists its own steps only). Exit status: 0 for a complete verdict, 1 for an
incomplete one, 2 for a file that is no gpu_check log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Dict, List, Optional

STEP = re.compile(r"^(?:verdict: step|step-end:) (\S+) (ok|failed|timeout|skipped) rc=(\S+) elapsed=(\d+) deadline=(-?\d+)$")
UNIT = re.compile(r"^verdict: unit (\S+) set=(\S+) seconds=([\d.]+) rc=(\S+)$")
STATUS = re.compile(r"^gpu_check: status (\d+), (\d+) s of a (\d+) s budget$")
PLAN = re.compile(r"^gpu_check plan: (.*) budget=(\d+)$")


def parse(text: str) -> Dict[str, Any]:
    """The verdict of one gpu_check.log, as a dict (ValueError if it is no gpu_check log)."""
    plan: Optional[Dict[str, int]] = None
    budget = None
    verdict_steps: Dict[str, dict] = {}
    ended_steps: Dict[str, dict] = {}
    units: List[dict] = []
    notes: List[str] = []
    final = None
    dry = False
    for line in text.splitlines():
        line = line.rstrip()
        m = PLAN.match(line)
        if m and plan is None:
            plan = {k: int(v) for k, v in (kv.split("=", 1) for kv in m.group(1).split())}
            budget = int(m.group(2))
            continue
        m = STEP.match(line)
        if m:
            step = {"name": m.group(1), "status": m.group(2), "rc": m.group(3), "elapsed": int(m.group(4)),
                    "deadline": int(m.group(5))}
            (verdict_steps if line.startswith("verdict:") else ended_steps)[step["name"]] = step
            continue
        m = UNIT.match(line)
        if m:
            units.append({"name": m.group(1), "set": m.group(2), "seconds": float(m.group(3)), "rc": m.group(4)})
            continue
        if line.startswith("verdict: note "):
            notes.append(line[len("verdict: note "):])
            continue
        if line.startswith("gpu_check dry-run: budget "):
            dry = True
            continue
        m = STATUS.match(line)
        if m:
            final = {"status": int(m.group(1)), "elapsed": int(m.group(2)), "budget": int(m.group(3))}
    if plan is None:
        raise ValueError("no 'gpu_check plan:' line: not a log of scripts/gpu_check.sh")
    complete = final is not None and bool(verdict_steps)
    seen = verdict_steps if complete else ended_steps
    steps = []
    for name in ([] if dry else list(plan)) + [n for n in seen if dry or n not in plan]:
        if name in seen:
            steps.append(seen[name])
        else:
            steps.append({"name": name, "status": "not reached", "rc": "-", "elapsed": 0, "deadline": plan.get(name, 0)})
    return {"complete": complete, "dry_run": dry, "budget": budget, "plan": plan, "steps": steps, "units": units, "notes": notes,
            "final": final}


def render(v: Dict[str, Any], source: str) -> str:
    out = [f"gpu_check {'dry-run ' if v['dry_run'] else ''}verdict ({source}): " + ("complete" if v["complete"] else
                                                 "INCOMPLETE: no verdict, the run was cut off (read from its step ends)")]
    out.append(f"{'step':<13} {'status':<12} {'rc':>4} {'elapsed':>8} {'deadline':>9}")
    for s in v["steps"]:
        out.append(f"{s['name']:<13} {s['status']:<12} {s['rc']:>4} {s['elapsed']:>6} s {s['deadline']:>7} s")
    compiled = [u for u in v["units"] if u["name"] != "device-link"]
    if compiled:
        by_set: Dict[str, List[dict]] = {}
        for u in compiled:
            by_set.setdefault(u["set"], []).append(u)
        slowest = max(compiled, key=lambda u: u["seconds"])
        out.append(f"nvcc units: {len(compiled)} (" + ", ".join(f"{k} {len(us)}" for k, us in by_set.items())
                   + f"); slowest {slowest['name']} {slowest['seconds']:.1f} s ({slowest['set']})")
        for u in sorted(v["units"], key=lambda u: -u["seconds"]):
            out.append(f"  {u['name']:<34} {u['set']:<6} {u['seconds']:>6.1f} s" + ("" if u["rc"] == "0" else f"  exit {u['rc']}"))
    else:
        out.append("nvcc units: none recorded")
    if v["notes"]:
        out.append("notes:")
        out += [f"  {n}" for n in v["notes"]]
    bad = [s["name"] for s in v["steps"] if s["status"] not in ("ok", "skipped")]
    if v["final"]:
        f = v["final"]
        out.append(f"status {f['status']} ({'passed' if f['status'] == 0 else 'FAILED'}), {f['elapsed']} s of a "
                   f"{f['budget']} s budget; steps not ok: {', '.join(bad) or 'none'}")
    else:
        out.append(f"no final status; steps not ok: {', '.join(bad) or 'none'}")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", help="gpu_check.log, or the folder that holds it")
    p.add_argument("--json", action="store_true", help="the verdict as JSON")
    args = p.parse_args(argv)
    path = os.path.join(args.log, "gpu_check.log") if os.path.isdir(args.log) else args.log
    try:
        with open(path, errors="replace") as f:
            v = parse(f.read())
    except (OSError, ValueError) as exc:
        print(f"gpu_verdict: {path}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(v, indent=1) if args.json else render(v, path))
    return 0 if v["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
