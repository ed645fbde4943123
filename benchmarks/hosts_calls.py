"""Where the time of one call across namespace hosts goes: back-to-back nvrar calls of one size (as root).

    sudo .venv/bin/python benchmarks/hosts_calls.py --hosts 4 --bytes 512K --iters 2000

Starts --hosts namespace hosts x --ranks-per-host ranks (tests/_netns.py: own network, UTS, IPC,
PID and mount namespaces and /dev/shm each, tcp over veths between them), bootstrapping through
nvrar's store with torchrun-style variables, and times --iters back-to-back float32 sums of
--bytes on ordinary numpy buffers after --warmup untimed ones. Per rank it prints the median call
(wall time), the process CPU time per call (user + system: on a saturated machine the wall time
follows the sum of the ranks' CPU times over the cores), the executor's phase timing per call
(waits, reductions, copies, puts to other hosts) and the pieces from other hosts applied on
arrival against those that landed in a zone first (NOTE [landings], csrc/protocol/round.h).

--sysctl KEY=VALUE (repeatable) is set inside every host's network namespace before the ranks
start (e.g. net.ipv4.tcp_autocorking=0); --pin 0,0,1,1 runs rank r on CPU Cr only (which ranks
share a core decides much of a call's time where the ranks outnumber the cores). NVRAR_* and
UCX_* variables of this environment reach the ranks, and so does PYTHONPATH (an old build beside
the new: a `pip install --target DIR`), as in hosts_bench.py.
Used for the analysis under "Across hosts" in docs/results.md. --json writes the per-rank records.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, HERE)


def rank_main(nbytes: int, iters: int, warmup: int, out: str, cpu: int) -> None:
    """One rank: the calls, then its record in `out`."""
    import numpy as np

    import nvrar

    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})

    comm = nvrar.Communicator()
    ex = comm._ex
    x = np.zeros(nbytes // 4, np.float32)
    for _ in range(warmup):
        comm.all_reduce(x)
    ex.take_phase_times()
    before = ex.link_landings()
    ex.set_phase_timing(True)
    times = np.empty(iters)
    cpu0 = time.process_time()
    for i in range(iters):
        t0 = time.perf_counter_ns()
        comm.all_reduce(x)
        times[i] = (time.perf_counter_ns() - t0) / 1e3
    cpu_us = (time.process_time() - cpu0) / iters * 1e6
    phases = ex.take_phase_times()
    ex.set_phase_timing(False)
    after = ex.link_landings()
    x.fill(1)
    comm.all_reduce(x)
    ok = bool((x == comm.world_size).all())
    rec = {"rank": comm.rank, "world": comm.world_size, "bytes": nbytes, "iters": iters,
           "median_us": float(np.median(times)), "p90_us": float(np.percentile(times, 90)), "cpu_us_per_call": cpu_us,
           "phases_us_per_call": {k[:-3]: v / iters / 1e3 for k, v in phases.items() if k.endswith("_ns")},
           "on_arrival": after[0] - before[0], "in_zone": after[1] - before[1], "checked": ok}
    comm.close()
    with open(out, "w") as f:
        json.dump(rec, f)


def run(args: argparse.Namespace) -> List[dict]:
    import _netns
    from hosts_bench import passed_env

    why = _netns.why_not()
    if why is not None:
        raise SystemExit(f"hosts_calls: {why}")
    n, G = args.hosts, args.ranks_per_host
    tmp = tempfile.mkdtemp(prefix="nvrar-hosts-calls-")
    passed = dict(kv.split("=", 1) for kv in passed_env())
    passed["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
    with _netns.Hosts(n, tmp) as hosts:
        for ns in hosts.ns:
            for kv in args.sysctl:
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", kv], check=True, timeout=30)
        for h in range(n):
            ranks = []
            for local in range(G):
                r = h * G + local
                env = dict(passed, RANK=str(r), WORLD_SIZE=str(n * G), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(G),
                           MASTER_ADDR=hosts.addr(0), MASTER_PORT=str(args.port), OMP_NUM_THREADS="1",
                           NVRAR_SESSION_SECRET=args.secret)
                argv = [sys.executable, os.path.abspath(__file__), "--rank", "--bytes", str(args.bytes), "--iters",
                        str(args.iters), "--warmup", str(args.warmup), "--out", os.path.join(tmp, f"rank{r}.json"),
                        "--cpu", str(args.pin[r] if args.pin else -1)]
                ranks.append({"argv": argv, "env": env, "log": os.path.join(tmp, f"rank{r}.log")})
            hosts.start(h, ranks)
        codes = hosts.wait(args.timeout)
    recs = []
    for r in range(n * G):
        path = os.path.join(tmp, f"rank{r}.json")
        if not os.path.exists(path):
            log = open(os.path.join(tmp, f"rank{r}.log"), errors="replace").read()[-3000:]
            raise SystemExit(f"hosts_calls: rank {r} left no record (host exit codes {codes}); its log ends:\n{log}")
        with open(path) as f:
            recs.append(json.load(f))
    return recs


def main(argv: Optional[List[str]] = None) -> None:
    from hosts_bench import _size

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=4, help="namespace hosts (default 4)")
    p.add_argument("--ranks-per-host", type=int, default=1, help="ranks on each host (default 1)")
    p.add_argument("--bytes", type=_size, default=512 << 10, help="message size (default 512K)")
    p.add_argument("--iters", type=int, default=2000, help="timed calls (default 2000)")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls first (default 20)")
    p.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                   help="set in every host's network namespace before the ranks start (repeatable)")
    p.add_argument("--pin", default="", metavar="C0,C1,...",
                   help="rank r runs on CPU Cr only (sched_setaffinity; default: where the kernel puts it)")
    p.add_argument("--port", type=int, default=29561, help="MASTER_PORT on host 0 (default 29561)")
    p.add_argument("--secret", default="", help="NVRAR_SESSION_SECRET for the ranks (default: a fresh random one)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run (default 600)")
    p.add_argument("--json", default="", help="write the per-rank records here")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--cpu", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank:
        rank_main(args.bytes, args.iters, args.warmup, args.out, args.cpu)
        return
    if args.hosts < 1 or args.ranks_per_host < 1 or args.iters < 1 or args.warmup < 0 or args.bytes < 4:
        p.error("--hosts, --ranks-per-host and --iters must be >= 1, --warmup >= 0, --bytes >= 4")
    try:
        args.pin = [int(c) for c in args.pin.split(",")] if args.pin else []
    except ValueError:
        p.error(f"--pin takes one CPU number per rank, comma-separated; got {args.pin!r}")
    if args.pin and (len(args.pin) != args.hosts * args.ranks_per_host
                     or not set(args.pin) <= os.sched_getaffinity(0)):
        p.error(f"--pin needs {args.hosts * args.ranks_per_host} CPUs, each one of {sorted(os.sched_getaffinity(0))}")
    args.secret = args.secret or os.urandom(16).hex()
    recs = run(args)
    print(f"# {args.hosts} hosts x {args.ranks_per_host}, {args.bytes} bytes float32 sum, {args.iters} back-to-back calls"
          + (f", sysctl {' '.join(args.sysctl)}" if args.sysctl else "")
          + (f", rank r on CPU {','.join(map(str, args.pin))}[r]" if args.pin else ""))
    for r in recs:
        ph = " ".join(f"{k} {v:.1f}" for k, v in r["phases_us_per_call"].items())
        print(f"rank {r['rank']}: median {r['median_us']:.0f} us, p90 {r['p90_us']:.0f} us, CPU {r['cpu_us_per_call']:.0f} "
              f"us/call; phases (us/call): {ph}; pieces on arrival {r['on_arrival']}, in a zone {r['in_zone']}; "
              f"checked {'ok' if r['checked'] else 'WRONG'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(recs, f, indent=1)
    if not all(r["checked"] for r in recs):
        raise SystemExit("hosts_calls: a rank's check after the timed calls failed")


if __name__ == "__main__":
    main()
