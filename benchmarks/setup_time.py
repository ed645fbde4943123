"""Time to create a Communicator through nvrar's own TCP rendezvous store (RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT), on local CPU ranks.

Each rank creates and closes a Communicator ``--iters`` times after one warm-up; an iteration's
time is the slowest rank's (creation is collective: the last rank to finish sets the latency).
Prints the median and the maximum over iterations, per world size.

    python benchmarks/setup_time.py                    # 2 and 4 ranks, 10 iterations
    python benchmarks/setup_time.py --ranks 2 --iters 20 --json setup.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(iters: int, report: str) -> int:
    """One rank: warm-up, then ``iters`` timed creations (seconds, this rank's view)."""
    import nvrar

    times: List[float] = []
    for i in range(iters + 1):
        t0 = time.perf_counter()
        comm = nvrar.Communicator(timeout=60)
        dt = time.perf_counter() - t0
        comm.close()
        if i:
            times.append(dt)
    with open(report, "w") as f:
        json.dump(times, f)
    return 0


def run(world: int, iters: int, timeout: float = 300.0) -> Dict[str, float]:
    """Launch ``world`` local ranks; returns the median and max (ms) of the slowest rank per iteration."""
    with tempfile.TemporaryDirectory(prefix="nvrar-setup-") as tmp:
        return _run_in(world, iters, timeout, tmp)


def _run_in(world: int, iters: int, timeout: float, tmp: str) -> Dict[str, float]:
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        for k in ("LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
            env.pop(k, None)
        cmd = [sys.executable, os.path.abspath(__file__), "--rank-main", str(iters), os.path.join(tmp, f"{r}.json")]
        procs.append(subprocess.Popen(cmd, env=env))
    deadline = time.monotonic() + timeout
    failed = []
    for r, p in enumerate(procs):
        try:
            if p.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
                failed.append(r)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            failed.append(r)
    if failed:
        raise RuntimeError(f"setup_time: ranks {failed} of {world} failed or hung")
    per_rank = []
    for r in range(world):
        with open(os.path.join(tmp, f"{r}.json")) as f:
            per_rank.append(json.load(f))
    slowest = [max(ts) * 1e3 for ts in zip(*per_rank)]
    return {"world": world, "iters": iters, "median_ms": statistics.median(slowest), "max_ms": max(slowest)}


def main(argv: List[str]) -> int:
    if argv[:1] == ["--rank-main"]:
        return rank_main(int(argv[1]), argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes (default 2 4)")
    ap.add_argument("--iters", type=int, default=10, help="timed creations per world size (default 10)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    if args.iters < 1 or any(w < 1 for w in args.ranks):
        ap.error("--iters and --ranks must be positive")
    rows = [run(w, args.iters) for w in args.ranks]
    print("# nvrar Communicator() through the TCP store (MASTER_ADDR=127.0.0.1), slowest rank per iteration")
    print(f"# {'ranks':>5} {'iters':>5} {'median_ms':>10} {'max_ms':>10}")
    for row in rows:
        print(f"  {row['world']:>5} {row['iters']:>5} {row['median_ms']:>10.2f} {row['max_ms']:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
