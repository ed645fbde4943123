"""nvrar against gloo across hosts made of network namespaces on this machine (as root).

    sudo .venv/bin/python benchmarks/hosts_bench.py --layouts 2x2,4x1 --out bench-hosts.json

Every host is a network namespace with its own UTS, IPC, PID and mount namespaces and /dev/shm
(tests/_netns.py), joined to the others by veth pairs on a bridge: inside a host the ranks share
memory, between hosts only tcp over the veths exists. Each rank runs this file with --rank; the
ranks form a torch.distributed gloo group (GLOO_SOCKET_IFNAME=eth0), nvrar bootstraps over it
(its inter-host half then runs over UCX on the same veths). For every size both libraries run in
the same processes, interleaved.

Timing (implemented here: `nvrar-bench --timing` is not on main yet):
  warm  back-to-back calls after 3 warm-up calls; per rank the mean time of one call; the table
        reports the slowest rank's.
  cold  every timed call alone after a gloo barrier and 2 ms of idleness (the ranks enter nearly
        together, caches and the peers' progress loops idle); per rank the median; slowest rank.
MPI_Allreduce is not measured: Open MPI would have to start its daemons inside every namespace
host (an rsh agent running `nsenter` into a host's namespaces) and route its out-of-band traffic
through the bridge namespace; not done (docs/results.md).

What the numbers can and cannot predict: see docs/results.md ("Across hosts").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SIZES = [4 << 10, 16 << 10, 64 << 10, 128 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 16 << 20]


def _iters(nbytes: int, warm: bool) -> int:
    if nbytes >= 4 << 20:
        return 8 if warm else 5
    return 40 if warm else 15


def rank_main(out_path: str, sizes) -> None:
    import datetime

    import numpy as np
    import torch
    import torch.distributed as dist

    import nvrar

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    G = int(os.environ["LOCAL_WORLD_SIZE"])
    comm = nvrar.Communicator(group=dist.group.WORLD, ranks_per_node=G, timeout=120)
    rows = []
    for nbytes in sizes:
        n = nbytes // 4
        x_np = np.ones(n, dtype=np.float32)
        x_t = torch.ones(n, dtype=torch.float32)

        def run_nvrar(x=x_np):
            comm.all_reduce(x)

        def run_gloo(x=x_t):
            dist.all_reduce(x)

        for name, fn in (("nvrar", run_nvrar), ("gloo", run_gloo)):
            for _ in range(3):
                fn()
            dist.barrier()
            k = _iters(nbytes, True)
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            warm = (time.perf_counter() - t0) / k
            colds = []
            for _ in range(_iters(nbytes, False)):
                dist.barrier()
                time.sleep(0.002)
                t0 = time.perf_counter()
                fn()
                colds.append(time.perf_counter() - t0)
            rows.append({"lib": name, "bytes": nbytes, "warm_s": warm, "cold_s": statistics.median(colds)})
        x_np.fill(1.0)
        comm.all_reduce(x_np)
        assert (x_np == world).all(), "nvrar: wrong sum"
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    transports = sorted({comm._ex.link_transports(r) for r in range(world)} - {""})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"ranks": gathered, "transports": transports}, f)
    comm.close()
    dist.destroy_process_group()


def run_layout(n_hosts: int, G: int, sizes, workdir: str) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import _netns

    out = os.path.join(workdir, f"bench-{n_hosts}x{G}.json")
    with _netns.Hosts(n_hosts, workdir) as hosts:
        for h in range(n_hosts):
            ranks = []
            for local in range(G):
                r = h * G + local
                env = dict(os.environ)
                env.update({"RANK": str(r), "WORLD_SIZE": str(n_hosts * G), "LOCAL_RANK": str(local),
                            "LOCAL_WORLD_SIZE": str(G), "MASTER_ADDR": hosts.addr(0), "MASTER_PORT": "29533",
                            "GLOO_SOCKET_IFNAME": "eth0", "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
                ranks.append({"argv": [sys.executable, os.path.abspath(__file__), "--rank", out,
                                       "--sizes", ",".join(map(str, sizes))],
                              "env": env, "log": os.path.join(workdir, f"bench-rank{r}.log")})
            hosts.start(h, ranks)
        codes = hosts.wait(3600)
    if codes != [0] * n_hosts or not os.path.exists(out):
        logs = "".join(open(os.path.join(workdir, f"bench-rank{r}.log")).read()[-2000:] for r in range(n_hosts * G))
        raise SystemExit(f"{n_hosts}x{G}: the ranks failed ({codes}):\n{logs}")
    with open(out) as f:
        data = json.load(f)
    table = {}
    for rank_rows in data["ranks"]:
        for row in rank_rows:
            key = (row["lib"], row["bytes"])
            cur = table.setdefault(key, {"warm_s": 0.0, "cold_s": 0.0})
            cur["warm_s"] = max(cur["warm_s"], row["warm_s"])  # the slowest rank
            cur["cold_s"] = max(cur["cold_s"], row["cold_s"])
    return {"layout": f"{n_hosts}x{G}", "transports": data["transports"],
            "rows": [{"lib": k[0], "bytes": k[1], **v} for k, v in sorted(table.items(), key=lambda kv: kv[0][1])]}


def fmt_bytes(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def print_table(res: dict) -> None:
    rows = {(r["lib"], r["bytes"]): r for r in res["rows"]}
    sizes = sorted({b for _, b in rows})
    print(f"\n{res['layout']} (inter-host transports: {', '.join(res['transports'])})")
    print("| size | nvrar warm (us) | gloo warm (us) | gloo/nvrar warm | nvrar cold (us) | gloo cold (us) | gloo/nvrar cold |")
    print("|---|---|---|---|---|---|---|")
    for b in sizes:
        nv, gl = rows[("nvrar", b)], rows[("gloo", b)]
        print(f"| {fmt_bytes(b)} | {nv['warm_s'] * 1e6:.0f} | {gl['warm_s'] * 1e6:.0f} | "
              f"{gl['warm_s'] / nv['warm_s']:.2f} | {nv['cold_s'] * 1e6:.0f} | {gl['cold_s'] * 1e6:.0f} | "
              f"{gl['cold_s'] / nv['cold_s']:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="message sizes in bytes (comma-separated)")
    p.add_argument("--layouts", default="2x2,4x1", help="hosts x ranks per host, comma-separated")
    p.add_argument("--out", default="", help="write the results as JSON here")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.rank:
        rank_main(args.rank, sizes)
        return
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import _netns

    why = _netns.why_not()
    if why:
        raise SystemExit(f"hosts_bench: {why}")
    results = []
    with tempfile.TemporaryDirectory(prefix="nvrar-hosts-bench-") as tmp:
        for layout in args.layouts.split(","):
            n, g = (int(v) for v in layout.split("x"))
            res = run_layout(n, g, sizes, tmp)
            print_table(res)
            results.append(res)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"load": os.getloadavg(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
