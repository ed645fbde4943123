"""Where the microseconds of one CPU all_reduce go: the per-phase breakdown of docs/design.md.

    python benchmarks/call_phases.py one                 # one rank: the Python and binding layers
    mpirun -n 2 python benchmarks/call_phases.py two     # 2 ranks: cold and warm, layer by layer

One rank: thread CPU time per call (robust to a loaded host); two ranks: wall time. Every
number is a median over many calls of the layer alone, the layers measured one after the
other in the same process (run the old and the new build alternately to compare them: the
timings are ratios within one run, never absolute). `two` prints rank 0's view; cold puts an
MPI barrier before each timed call, warm times back-to-back calls; then, per size and timing,
rank 0's phases inside the C++ call (`phase ...`: the call, waits, reductions, copies,
cross-memory transfers, flag stores, puts to other hosts, and the rest; per phase the median
over the calls, from the executor's phase timing). Prints one JSON object per line (tag, size, us) after a
human-readable table.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable, Dict, List

import numpy as np


def med_us(fn: Callable[[], Any], n: int = 20000, reps: int = 7) -> float:
    """Median over `reps` loops of `n` calls of this thread's CPU time per call (us): on a loaded
    host the CPU time a call consumes stays put where its wall time does not."""
    for _ in range(min(n, 2000)):
        fn()
    best = []
    for _ in range(reps):
        t0 = time.thread_time_ns()
        for _ in range(n):
            fn()
        best.append((time.thread_time_ns() - t0) / n / 1e3)
    return float(np.median(best))


def one_rank() -> List[Dict[str, Any]]:
    import torch

    import nvrar
    from nvrar import _arrays
    from nvrar.bootstrap import SingleBootstrap

    rows = []
    with nvrar.Communicator(group=SingleBootstrap()) as c:
        t = torch.zeros(2048)  # 8 KB float32
        a = np.zeros(2048, np.float32)
        ex = c._ex
        ptr, cnt, code = t.data_ptr(), t.numel(), 0
        acode = c._algorithm
        steps = [
            ("comm.all_reduce(torch 8KB)", lambda: c.all_reduce(t)),
            ("comm.all_reduce(numpy 8KB)", lambda: c.all_reduce(a)),
            ("_arrays.torch_info", lambda: _arrays.torch_info(t, "x", write=True)),
            ("torch attrs (data_ptr, numel, dtype)", lambda: (t.data_ptr(), t.numel(), t.dtype)),
            ("binding ex.all_reduce (world 1)", lambda: ex.all_reduce(ptr, ptr, cnt, code, 0, acode)),
            ("pybind property read (ex.epoch)", lambda: ex.epoch),
        ]
        for name, fn in steps:
            rows.append({"tag": name, "bytes": 8192, "us": med_us(fn)})
    return rows


def two_ranks() -> List[Dict[str, Any]]:
    import torch

    import nvrar
    from nvrar.bootstrap import preload_ucx_across_hosts

    preload_ucx_across_hosts()  # (ranks on several hosts: before mpi4py loads Open MPI's own UCX)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rows = []
    c = nvrar.Communicator()
    ex = c._ex
    for size in (8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20):
        n = size // 4
        t = torch.zeros(n)
        a = np.zeros(n, np.float32)
        s = c.empty(n, np.float32)
        s[...] = 0
        ptr = t.data_ptr()
        acode = c._algorithm
        layers = [
            ("torch", lambda t=t: c.all_reduce(t)),
            ("numpy", lambda a=a: c.all_reduce(a)),
            ("empty()", lambda s=s: c.all_reduce(s)),
            ("binding", lambda ptr=ptr, n=n, acode=acode: ex.all_reduce(ptr, ptr, n, 0, 0, acode)),
        ]
        iters = 400 if size <= (128 << 10) else 150
        for name, fn in layers:
            for timing in ("warm", "cold"):
                for _ in range(20):
                    fn()
                ts = np.empty(iters)
                world.Barrier()
                for i in range(iters):
                    if timing == "cold":
                        world.Barrier()
                    t0 = time.perf_counter_ns()
                    fn()
                    ts[i] = (time.perf_counter_ns() - t0) / 1e3
                tmax = np.empty_like(ts)
                world.Allreduce(ts, tmax, op=MPI.MAX)
                rows.append({"tag": f"{timing} {name}", "bytes": size, "us": float(np.median(tmax))})
        # Inside the C++ call (rank 0's own phases, CpuExecutor phase timing, which adds a few
        # clock reads per call): per phase the median over the calls of its us in one call;
        # "other" is the call minus the phases (checks, plan lookup, round bookkeeping).
        keys = ("call_ns", "wait_ns", "reduce_ns", "copy_ns", "cma_ns", "signal_ns", "remote_ns")
        for timing in ("warm", "cold") if hasattr(ex, "set_phase_timing") else ():  # (older builds: none)
            ex.set_phase_timing(True)
            per_call = np.zeros((iters, len(keys)))
            world.Barrier()
            for i in range(iters):
                if timing == "cold":
                    world.Barrier()
                c.all_reduce(t)
                pt = ex.take_phase_times()
                per_call[i] = [pt[k] / 1e3 for k in keys]
            ex.set_phase_timing(False)
            other = per_call[:, 0] - per_call[:, 1:].sum(axis=1)
            for j, k in enumerate(keys):
                rows.append({"tag": f"{timing} phase {k[:-3]}", "bytes": size, "us": float(np.median(per_call[:, j]))})
            rows.append({"tag": f"{timing} phase other", "bytes": size, "us": float(np.median(other))})
    c.close()
    return rows if world.rank == 0 else []


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "one"
    rows = one_rank() if mode == "one" else two_ranks()
    for r in rows:
        print(f"{r['tag']:40s} {r['bytes']:>8d} {r['us']:9.2f} us")
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
