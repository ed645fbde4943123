"""How a one-shot call's stage-in is written, and where one-shot beats two-shot, measured side
by side in one run (NOTE [streaming stage-in], csrc/cpu/executor.cpp; docs/results.md).

    mpirun -n 2 --oversubscribe python benchmarks/stage_in.py stores [--busy] [--rounds 6] [--calls 150]
    mpirun -n 2 --oversubscribe python benchmarks/stage_in.py algorithms [--busy] [--sizes 32K,64K,128K]

`stores`: one-shot calls on three communicators of the same ranks, built with
NVRAR_STREAM_STAGING=0 (plain stores), 1 (streaming stores) and auto (the leader's timed
choice). `algorithms`: one communicator (auto stage-in), explicit one-shot, explicit two-shot and
auto calls. Both: torch float32 tensors, in place, cold (nvrar's spin barrier before every call,
as benchmarks/latency_check.py), 2 ranks on one host; each round measures every variant at every
size (`--calls` calls each; per call the slower rank's time), the variants interleaved, so that
a change of the host's state between rounds meets them all. Before each round rank 0 takes the
host's state mark: the median ns of a cache-line round trip between CPUs 0 and 1
(nvrar._C.line_round_trip_ns). `--busy` starts one spinning process (as latency_check --busy)
for the timed part. Prints, per size and variant, the median us of every round, then one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("stores", "algorithms"))
    ap.add_argument("--sizes", default=None, help="message sizes (default 8K,16K,32K,64K for stores, 32K,64K,128K "
                                                  "for algorithms)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=150)
    ap.add_argument("--busy", action="store_true", help="one spinning process beside the ranks")
    a = ap.parse_args()

    from mpi4py import MPI

    import torch

    import nvrar
    import nvrar._C as C
    from nvrar.bench import spin_barrier as sb
    from nvrar.env import parse_bytes

    world = MPI.COMM_WORLD
    rank = world.rank
    if world.size != 2:
        raise SystemExit("stage_in.py: run it on 2 ranks (mpirun -n 2 --oversubscribe ...)")
    sizes = [parse_bytes(s) for s in (a.sizes or ("8K,16K,32K,64K" if a.what == "stores" else
                                                  "32K,64K,128K")).split(",")]
    comms: Dict[str, Any] = {}
    if a.what == "stores":
        saved = os.environ.get("NVRAR_STREAM_STAGING")
        for mode in ("0", "1", "auto"):
            os.environ["NVRAR_STREAM_STAGING"] = mode
            comms[{"0": "plain", "1": "streaming", "auto": "auto"}[mode]] = nvrar.Communicator()
        if saved is None:
            del os.environ["NVRAR_STREAM_STAGING"]
        else:
            os.environ["NVRAR_STREAM_STAGING"] = saved
        variants = [(name, c, "one-shot") for name, c in comms.items()]
    else:
        comms["auto"] = nvrar.Communicator()
        variants = [(alg, comms["auto"], alg) for alg in ("one-shot", "two-shot", "auto")]
    path = world.bcast(os.path.join(tempfile.gettempdir(), f"nvrar-stage-in-{os.getpid()}") if rank == 0 else None)
    barrier = sb.SpinBarrier(path, rank, 2).wait
    spinner = None
    if a.busy and rank == 0:
        spinner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.monotonic() + 600\n"
                                    "while time.monotonic() < t: pass"])
    res: Dict[str, Dict[int, List[float]]] = {name: {s: [] for s in sizes} for name, _, _ in variants}
    probes: List[float] = []
    try:
        for _ in range(a.rounds):
            world.Barrier()
            if rank == 0:
                if spinner is not None:
                    spinner.send_signal(signal.SIGSTOP)
                probes.append(statistics.median(C.line_round_trip_ns(0, 1, 2000, 3)))
                if spinner is not None:
                    spinner.send_signal(signal.SIGCONT)
            world.Barrier()
            for s in sizes:
                for name, c, alg in variants:
                    t = torch.ones(s // 4)
                    for _ in range(10):
                        c.all_reduce(t, algorithm=alg)
                    ts = np.empty(a.calls)
                    for i in range(a.calls):
                        barrier()
                        t0 = time.perf_counter_ns()
                        c.all_reduce(t, algorithm=alg)
                        ts[i] = (time.perf_counter_ns() - t0) / 1e3
                    slowest = np.empty_like(ts)
                    world.Allreduce(ts, slowest, op=MPI.MAX)
                    res[name][s].append(float(np.median(slowest)))
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
        world.Barrier()
        if rank == 0 and os.path.exists(path):
            os.unlink(path)
    if rank != 0:
        return
    print(f"# {a.what}{' (busy)' if a.busy else ''}: line round trip before each round, ns: "
          + " ".join(str(round(p)) for p in probes))
    for s in sizes:
        for name, _, _ in variants:
            print(f"{s >> 10:>5}K {name:>10}: " + " ".join(f"{v:7.2f}" for v in res[name][s])
                  + f"   median {statistics.median(res[name][s]):.2f}")
    stats = {name: {"stage_calls": list(c._ex.stage_calls), "way_calls": list(c._ex.way_calls)}
             for name, c in comms.items()}
    print(json.dumps({"what": a.what, "busy": a.busy, "line_round_trip_ns": probes,
                      "us": {name: {str(s): v for s, v in r.items()} for name, r in res.items()}, "ways": stats}))
    for c in comms.values():
        c.close()


if __name__ == "__main__":
    main()
