"""nvrar against gloo and MPI_Allreduce across hosts made of network namespaces on this machine (as root).

    sudo .venv/bin/python benchmarks/hosts_bench.py --layouts 2x2,4x1 --out bench-hosts.json

Every host is a network namespace with its own UTS, IPC, PID and mount namespaces and /dev/shm
(tests/_netns.py), joined to the others by veth pairs on a bridge: inside a host the ranks share
memory, between hosts only tcp over the veths exists.

The ranks are `nvrar-bench` itself (--backends nvrar,gloo,mpi --timing both), so the timing is
nvrar-bench's: per size, every backend verified on exact data, then timed in rounds that visit the
backends in turn; `warm` times back-to-back calls, `cold` every call after an MPI barrier; each
iteration's time is the slowest rank's, the table gives the median over the iterations.

Launcher `mpirun` (the default where mpirun and mpi4py are installed): Open MPI's mpirun runs in
the bridge namespace (which gets the address 10.99.0.254), like a login node, and starts its
daemons inside the hosts through an ssh agent written for the run (`--prtemca plm_ssh_agent`:
it maps a host's address to the pid of that host's init and `nsenter`s its net/UTS/IPC/PID/mount
namespaces, with a TMPDIR of the host's own, since the hosts share /tmp and PRRTE names its
session directory after the daemon's pid, which is alike in every host). Out-of-band and MPI
traffic are confined to 10.99.0.0/24 (oob_tcp_if_include, btl_tcp_if_include), pml ob1 with the
btls self,sm,tcp: shared memory inside a host, tcp between hosts; where the ranks outnumber the
machine's cores, mpi_yield_when_idle 1 (what Open MPI picks on a node it knows oversubscribed; no
host here can know). nvrar bootstraps over MPI.COMM_WORLD; gloo's store is on MASTER_ADDR = host
0's address (GLOO_SOCKET_IFNAME=eth0). The pieces and why each is needed: tests/_netns_mpi.py.

The ranks get this environment's NVRAR_* and UCX_* variables and PYTHONPATH (an old build beside
the new: PYTHONPATH=DIR of a `pip install --target DIR`); --backends picks the backends.

Launcher `env` (the fallback, or --launcher env): every rank started in its host with torchrun-style
variables; no MPI_Allreduce (the table says so).

What the numbers can and cannot predict: see docs/results.md ("Across hosts").
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from typing import List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import _netns  # noqa: E402
import _netns_mpi  # noqa: E402

PORT = "29533"
BACKENDS = ("nvrar", "gloo", "mpi")


def rank_program() -> List[str]:
    """nvrar-bench, as installed next to this Python (else through python -c, never -m: see nvrar.bench.launch)."""
    exe = os.path.join(os.path.dirname(sys.executable), "nvrar-bench")
    if os.path.exists(exe):
        return [exe]
    return [sys.executable, "-c", "import sys; del sys.path[0]; import nvrar.bench as m; sys.exit(m.main(sys.argv[1:]))"]


def bench_args(args: argparse.Namespace, backends: str, json_path: str) -> List[str]:
    return ["--backends", backends, "--timing", "both", "--min-bytes", str(args.min_bytes), "--max-bytes",
            str(args.max_bytes), "--algorithms", "auto", "--buffers", "ordinary", "--iters", str(args.iters),
            "--warmup", str(args.warmup), "--timeout", "120", "--json", json_path]


def passed_env() -> Tuple[str, ...]:
    """nvrar's and UCX's settings and PYTHONPATH of this environment, for the ranks (mpirun passes only what -x names)."""
    return tuple(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(("NVRAR_", "UCX_")) or k == "PYTHONPATH")


def mca_params(args: argparse.Namespace, world: int) -> Tuple[Tuple[str, str], ...]:
    """The extra MCA parameters: --mca's, and mpi_yield_when_idle 1 where the ranks outnumber this
    machine's cores (Open MPI sets it itself on a node it knows oversubscribed; here every host
    sees all cores, so it cannot know)."""
    params = [(kv.split("=", 1)[0], kv.split("=", 1)[1]) for kv in args.mca]
    if world > (os.cpu_count() or 1) and not any(k == "mpi_yield_when_idle" for k, _ in params):
        params.append(("mpi_yield_when_idle", "1"))
    return tuple(params)


def run_mpirun(mpirun: str, n: int, G: int, args: argparse.Namespace, workdir: str) -> Tuple[dict, str]:
    out = os.path.join(workdir, f"bench-{n}x{G}.json")
    log = os.path.join(workdir, f"mpirun-{n}x{G}.log")
    with _netns.Hosts(n, workdir) as hosts:
        launch = _netns_mpi.MpiHosts(hosts, workdir)
        launch.start()
        cmd = launch.command(mpirun, G, rank_program() + bench_args(args, ",".join(args.backends), out),
                             mca=mca_params(args, n * G),
                             env=("GLOO_SOCKET_IFNAME=eth0", "OMP_NUM_THREADS=1", *passed_env()))
        with open(log, "w") as f:
            f.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
            f.flush()
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                    env=_netns_mpi.mpirun_env(), start_new_session=True)
            try:
                rc: Optional[int] = proc.wait(args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                rc = None
        launch.stop()
    text = open(log, errors="replace").read()
    if rc != 0 or not os.path.exists(out):
        why = f"timed out after {args.timeout:.0f} s" if rc is None else f"exit code {rc}"
        raise SystemExit(f"hosts_bench: {n}x{G} under mpirun: {why}; the log ends:\n{text[-3000:]}")
    with open(out) as f:
        return json.load(f), " ".join(shlex.quote(c) for c in cmd)


def run_env(n: int, G: int, args: argparse.Namespace, workdir: str) -> Tuple[dict, str]:
    out = os.path.join(workdir, f"bench-{n}x{G}.json")
    argv = rank_program() + bench_args(args, ",".join(b for b in args.backends if b != "mpi"), out)
    with _netns.Hosts(n, workdir) as hosts:
        for h in range(n):
            ranks = []
            for local in range(G):
                r = h * G + local
                env = dict(os.environ)
                env.update({"RANK": str(r), "WORLD_SIZE": str(n * G), "LOCAL_RANK": str(local),
                            "LOCAL_WORLD_SIZE": str(G), "MASTER_ADDR": hosts.addr(0), "MASTER_PORT": PORT,
                            "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"})
                ranks.append({"argv": argv + ["--launched-by", "hosts_bench (namespace hosts, torchrun-style env)"],
                              "env": env, "log": os.path.join(workdir, f"bench-{n}x{G}-rank{r}.log")})
            hosts.start(h, ranks)
        codes = hosts.wait(args.timeout)
    if codes != [0] * n or not os.path.exists(out):
        logs = "".join(open(os.path.join(workdir, f"bench-{n}x{G}-rank{r}.log"), errors="replace").read()[-1500:]
                       for r in range(n * G))
        raise SystemExit(f"hosts_bench: {n}x{G}: the ranks failed ({codes}):\n{logs}")
    with open(out) as f:
        return json.load(f), "RANK=r WORLD_SIZE=... MASTER_ADDR=10.99.0.1 " + " ".join(shlex.quote(a) for a in argv)


def summarize(layout: str, data: dict, launcher: str, command: str, mpi_why: str) -> dict:
    """nvrar-bench's rows -> {(backend, bytes, timing): median_us}, plus what the table needs."""
    meta = data["meta"]
    rows = {}
    wrong = 0
    for r in data["results"]:
        rows[f"{r['backend']}/{r['bytes']}/{r['timing']}"] = r["median_us"]
        wrong += int(r["wrong"])
    skipped = dict(meta.get("skipped", {}))
    if mpi_why:
        skipped.setdefault("mpi", mpi_why)
    return {"layout": layout, "launcher": launcher, "command": command, "medians_us": rows, "wrong": wrong,
            "sizes": sorted({int(r["bytes"]) for r in data["results"]}), "skipped": skipped,
            "transports": meta.get("inter_host_transports", []), "versions": meta.get("versions", {}),
            "iters": meta.get("iters"), "bench_meta": meta}


def fmt_bytes(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def print_table(res: dict) -> None:
    med = res["medians_us"]
    have = [b for b in BACKENDS if any(k.startswith(b + "/") for k in med)]
    print(f"\n{res['layout']} (launcher: {res['launcher']}; inter-host transports: "
          f"{', '.join(res['transports']) or 'not reported'}; {res['versions'].get('mpi', 'no MPI')}; "
          f"{res['iters']} iterations; #wrong: {res['wrong']})")
    for name, why in sorted(res["skipped"].items()):
        print(f"  skipped {name}: {why}")
    peers = [b for b in have if b != "nvrar"]
    head = ["size"]
    for timing in ("warm", "cold"):
        head += [f"{b} {timing} (us)" for b in have] + [f"{b}/nvrar {timing}" for b in peers]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for size in res["sizes"]:
        cells = [fmt_bytes(size)]
        for timing in ("warm", "cold"):
            vals = {b: med.get(f"{b}/{size}/{timing}") for b in have}
            cells += [f"{vals[b]:.0f}" if vals[b] is not None else "-" for b in have]
            nv = vals.get("nvrar")
            cells += [f"{vals[b] / nv:.2f}" if vals[b] is not None and nv else "-" for b in peers]
        print("| " + " | ".join(cells) + " |")


def summarize_runs(runs: List[dict]) -> dict:
    """Several runs of one layout -> per size and timing: nvrar's time (the median of the runs'
    medians) and every peer's same-run ratio peer/nvrar (the median over the runs, with min and
    max). On 4 ranks and 2 cores one run's ratio moves by up to 2x at some sizes: a claim needs
    several runs."""
    out: dict = {"layout": runs[0]["layout"], "runs": len(runs), "sizes": runs[0]["sizes"], "nvrar_us": {},
                 "ratios": {}}
    for size in runs[0]["sizes"]:
        for timing in ("warm", "cold"):
            key = f"{size}/{timing}"
            nv = [r["medians_us"].get(f"nvrar/{key}") for r in runs]
            if any(v is None or v <= 0 for v in nv):
                continue
            out["nvrar_us"][key] = statistics.median(nv)
            for b in BACKENDS[1:]:
                peer = [r["medians_us"].get(f"{b}/{key}") for r in runs]
                if any(v is None for v in peer):
                    continue
                q = [pv / n for pv, n in zip(peer, nv)]
                out["ratios"][f"{b}/{key}"] = {"median": statistics.median(q), "min": min(q), "max": max(q)}
    return out


def print_summary(sm: dict) -> None:
    peers = [b for b in BACKENDS[1:] if any(k.startswith(b + "/") for k in sm["ratios"])]
    print(f"\n{sm['layout']}, {sm['runs']} runs: nvrar's time is the median of the runs' medians; a ratio "
          "peer/nvrar is the median of the same-run ratios (min-max)")
    head = ["size"]
    for timing in ("warm", "cold"):
        head += [f"nvrar {timing} (us)"] + [f"{b}/nvrar {timing}" for b in peers]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for size in sm["sizes"]:
        cells = [fmt_bytes(size)]
        for timing in ("warm", "cold"):
            nv = sm["nvrar_us"].get(f"{size}/{timing}")
            cells.append(f"{nv:.0f}" if nv is not None else "-")
            for b in peers:
                q = sm["ratios"].get(f"{b}/{size}/{timing}")
                cells.append(f"{q['median']:.2f} ({q['min']:.2f}-{q['max']:.2f})" if q else "-")
        print("| " + " | ".join(cells) + " |")
    # the cross-host targets, on the medians: faster than gloo at every size, than MPI at 128 KB-2 MB
    for b, lo, hi in (("gloo", 0, 1 << 62), ("mpi", 128 << 10, 2 << 20)):
        for timing in ("warm", "cold"):
            qs = {size: sm["ratios"][f"{b}/{size}/{timing}"]["median"] for size in sm["sizes"]
                  if lo <= size <= hi and f"{b}/{size}/{timing}" in sm["ratios"]}
            if not qs:
                continue
            slow = [fmt_bytes(size) for size, q in qs.items() if q <= 1.0]
            span = "every size" if b == "gloo" else "128 KB-2 MB"
            print(f"# {sm['layout']} {timing}: nvrar faster than {b} at {span} (median ratio > 1): "
                  + ("yes" if not slow else "no, not at " + ", ".join(slow))
                  + f"; lowest median {min(qs.values()):.2f}")


def _size(text: str) -> int:
    from nvrar.env import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="2x2,4x1", help="hosts x ranks per host, comma-separated (default 2x2,4x1)")
    p.add_argument("--min-bytes", type=_size, default=4 << 10, help="smallest message (default 4K)")
    p.add_argument("--max-bytes", type=_size, default=16 << 20, help="largest message (default 16M); sizes double")
    p.add_argument("--iters", type=int, default=40, help="timed iterations per size, backend and timing (default 40)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations first (default 5)")
    p.add_argument("--launcher", choices=["auto", "mpirun", "env"], default="auto",
                   help="mpirun: Open MPI across the namespace hosts, with MPI_Allreduce; env: torchrun-style "
                        "variables, nvrar and gloo only; auto (default): mpirun where it and mpi4py are installed")
    p.add_argument("--mca", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra Open MPI MCA parameter for the mpirun launch (repeatable)")
    p.add_argument("--timeout", type=float, default=1800.0, help="deadline of one layout's run, seconds (default 1800)")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help="comma-separated, of nvrar,gloo,mpi (default all three; mpi needs the mpirun launcher)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every layout this many times (the layouts alternate), then print per layout the "
                        "median of the runs with each ratio's range (default 1)")
    p.add_argument("--out", default="", help="write the results as JSON here")
    args = p.parse_args(argv)
    layouts = []
    for layout in args.layouts.split(","):
        try:
            n, g = (int(v) for v in layout.strip().split("x"))
        except ValueError:
            p.error(f"--layouts: {layout!r} is not HOSTSxRANKS (e.g. 2x2)")
        if n < 2 or g < 1:
            p.error(f"--layouts: {layout!r}: need at least 2 hosts and 1 rank per host")
        layouts.append((n, g))
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not args.backends or any(b not in BACKENDS for b in args.backends):
        p.error(f"--backends: choose from {','.join(BACKENDS)}")
    if any("=" not in kv for kv in args.mca):
        p.error("--mca takes KEY=VALUE")
    if args.iters < 1 or args.warmup < 0 or args.min_bytes <= 0 or args.max_bytes < args.min_bytes:
        p.error("need --iters >= 1, --warmup >= 0 and 0 < --min-bytes <= --max-bytes")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    why = _netns.why_not()
    if why:
        raise SystemExit(f"hosts_bench: {why}")
    mpirun, mpi_why = ("", "--launcher env: the ranks are not started by mpirun") if args.launcher == "env" else _netns_mpi.find_mpirun()
    if args.launcher == "mpirun" and not mpirun:
        raise SystemExit(f"hosts_bench: --launcher mpirun: {mpi_why}")
    if not mpirun:
        print(f"hosts_bench: no MPI_Allreduce ({mpi_why}); nvrar and gloo with torchrun-style variables", file=sys.stderr)
    results = []
    with tempfile.TemporaryDirectory(prefix="nvrar-hb-") as tmp:
        for run in range(args.repeat):
            for n, g in layouts:
                if mpirun:
                    data, command = run_mpirun(mpirun, n, g, args, tmp)
                else:
                    data, command = run_env(n, g, args, tmp)
                res = summarize(f"{n}x{g}", data, "mpirun" if mpirun else "env", command, "" if mpirun else mpi_why)
                res["run"] = run + 1
                if args.repeat > 1:
                    print(f"\n# run {run + 1} of {args.repeat}")
                print_table(res)
                results.append(res)
    summaries = []
    for n, g in layouts:
        runs = [r for r in results if r["layout"] == f"{n}x{g}"]
        sm = summarize_runs(runs)
        summaries.append(sm)
        print_summary(sm)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"load": os.getloadavg(), "results": results, "summaries": summaries}, f, indent=1)
    if any(r["wrong"] for r in results):
        raise SystemExit("hosts_bench: some results were wrong (#wrong > 0)")


if __name__ == "__main__":
    main()
