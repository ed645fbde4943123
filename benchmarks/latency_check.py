"""The CPU latency check (docs/results.md, "CPU latency check"), in one run (driven by
benchmarks/latency_check.sh).

    python benchmarks/latency_check.py --old-path DIR [--budget-s 450] [--json out.json]

Starts several mpirun jobs that stay alive side by side: the old build (its package directory
first on PYTHONPATH) and the new one (the nvrar this Python imports) on 2 ranks, and the new one
on 4 ranks. Only one job measures at a time: the others sleep in a blocking read of their FIFO,
so that a measurement of one build has the cores to itself, and the builds and peers take turns
size by size (several rounds, interleaved), so that a disturbance of the machine hits them alike.

Measured (float32 sum, torch CPU tensors, median over the calls of the per-call maximum over the
ranks): cold = an MPI barrier before every timed call (how TP decode calls arrive), warm = back to
back (as nccl-tests time). Peers: DeepSpeed's shm all-reduce (deepspeed.comm.inference_all_reduce,
where DeepSpeed is installed) and MPI_Allreduce (mpi4py). One rank: the time of one 8 KB torch
call. Copy bandwidth with every rank copying at once, for the memory-bandwidth floor at 8-16 MB.
Prints a table per part, then every target ratio with PASS or FAIL, then the verdict line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import numpy as np

KB, MB = 1 << 10, 1 << 20


def sizes(lo: int, hi: int) -> List[int]:
    out = []
    s = lo
    while s <= hi:
        out.append(s)
        s *= 2
    return out


def fmt(n: int) -> str:
    return f"{n // MB}M" if n >= MB else f"{n // KB}K"


# -- worker: one rank of one job -------------------------------------------------------------------
class Worker:
    def __init__(self, peers: bool) -> None:
        from mpi4py import MPI

        import torch

        self.MPI, self.torch = MPI, torch
        self.world = MPI.COMM_WORLD
        self.rank, self.size = self.world.rank, self.world.size
        import nvrar
        from nvrar.bootstrap import SingleBootstrap

        self.nvrar = nvrar
        self.comm = nvrar.Communicator()
        self.single = nvrar.Communicator(group=SingleBootstrap()) if self.rank == 0 else None
        self.ds: Any = None
        self.ds_reason = "not requested"
        if peers:
            self.ds_reason = self._init_deepspeed()

    def _init_deepspeed(self) -> str:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            import deepspeed
            import deepspeed.comm as dc
        except Exception as exc:  # not installed, or an import that fails on this host
            return f"DeepSpeed is not installed or does not import ({type(exc).__name__}: {exc})"
        port = self.world.bcast(_free_port() if self.rank == 0 else None, root=0)
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.size), LOCAL_RANK=str(self.rank),
                          LOCAL_SIZE=str(self.size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        try:
            deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        except Exception as exc:
            return f"deepspeed.init_distributed failed ({type(exc).__name__}: {exc})"
        torch = self.torch
        if not (hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_")):
            return "DeepSpeed's shm op did not build on this host (inference_all_reduce would fall back to gloo)"
        self.ds = dc
        from nvrar.bench.backends import release_deepspeed_segment

        release_deepspeed_segment(dc, self.rank, self.world.Barrier)
        return ""

    def call_fn(self, backend: str, n: int) -> Any:
        torch = self.torch
        t = torch.zeros(n)
        if backend == "nvrar":
            c = self.comm
            return lambda: c.all_reduce(t)
        if backend == "deepspeed":
            dc, op = self.ds, self.ds.ReduceOp.SUM
            return lambda: dc.inference_all_reduce(t, op)
        if backend == "mpi":
            a, w, inplace, s = t.numpy(), self.world, self.MPI.IN_PLACE, self.MPI.SUM
            return lambda: w.Allreduce(inplace, a, op=s)
        raise ValueError(backend)

    def measure(self, backend: str, nbytes: int, timing: str, iters: int) -> Dict[str, Any]:
        fn = self.call_fn(backend, nbytes // 4)
        for _ in range(max(3, min(20, iters // 5))):
            fn()
        ts = np.empty(iters)
        barrier, clock = self.world.Barrier, time.perf_counter_ns
        barrier()
        for i in range(iters):
            if timing == "cold":
                barrier()
            t0 = clock()
            fn()
            ts[i] = (clock() - t0) / 1e3
        tmax = np.empty_like(ts)
        self.world.Allreduce(ts, tmax, op=self.MPI.MAX)
        return {"us": [float(v) for v in tmax]}

    def single_call(self, iters: int) -> Dict[str, Any]:
        """Rank 0 alone: wall time of one 8 KB torch all_reduce on a one-rank communicator."""
        if self.rank != 0:
            return {}
        t = self.torch.zeros(2048)
        c = self.single
        for _ in range(2000):
            c.all_reduce(t)
        out = []
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            for _ in range(2000):
                c.all_reduce(t)
            out.append((time.perf_counter_ns() - t0) / 2000 / 1e3)
        return {"us": out}

    def copy_bw(self, n: int) -> Dict[str, Any]:
        """GB/s one rank copies (bytes copied per second) with a copy of n bytes, while every rank
        copies at once. n is the message size of the floor it serves: the call's working set then
        sits in the same level of the memory hierarchy as the copy's (a 64 MB copy measures DRAM,
        which an 8 MB two-shot call, 4 MB shards, does not reach on a host with a large L3)."""
        src, dst = np.ones(n, np.uint8), np.empty(n, np.uint8)
        np.copyto(dst, src)
        rates = []
        for _ in range(5):
            self.world.Barrier()
            t0 = time.perf_counter()
            np.copyto(dst, src)
            rates.append(n / (time.perf_counter() - t0) / 1e9)
        mine = float(np.median(rates))
        return {"gbps": min(self.world.allgather(mine))}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_main(args: argparse.Namespace) -> int:
    w = Worker(args.peers)
    cmd_path = os.path.join(args.dir, f"cmd.{args.job}.{w.rank}")
    os.mkfifo(cmd_path)
    w.world.Barrier()
    info = {"ready": True, "ds_reason": w.ds_reason, "nvrar": os.path.dirname(w.nvrar.__file__),
            "algorithm_2M": w.comm.algorithm_for(2 * MB)}
    # One write end (rank 0) and one read end (the coordinator), both kept open for the whole
    # run: a FIFO reopened per answer could hand the reader the previous writer's end of file.
    done = open(os.path.join(args.dir, f"done.{args.job}"), "w") if w.rank == 0 else None
    if done is not None:
        done.write(json.dumps(info) + "\n")
        done.flush()
    with open(cmd_path) as cmds:  # blocks (no CPU) until the coordinator opens it
        for line in cmds:
            req = json.loads(line)
            if req["what"] == "quit":
                break
            if req["what"] == "single":
                res = w.single_call(req["iters"])
            elif req["what"] == "copy":
                res = w.copy_bw(int(req["bytes"]))
            else:
                res = w.measure(req["backend"], req["bytes"], req["timing"], req["iters"])
            if done is not None:
                done.write(json.dumps(res) + "\n")
                done.flush()
    w.comm.close()
    if w.single is not None:
        w.single.close()
    return 0


# -- coordinator ------------------------------------------------------------------------------------
class Job:
    def __init__(self, name: str, ranks: int, pythonpath: Optional[str], peers: bool, d: str) -> None:
        self.name, self.ranks, self.dir = name, ranks, d
        mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
        if not os.path.exists(mpirun):
            mpirun = shutil.which("mpirun") or "mpirun"
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_osc="^ucx")
        env.pop("PYTHONPATH", None)
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        cmd = [mpirun, "-n", str(ranks), "--oversubscribe", sys.executable, os.path.abspath(__file__), "worker",
               "--job", name, "--dir", d] + (["--peers"] if peers else [])
        self.done_path = os.path.join(d, f"done.{name}")
        os.mkfifo(self.done_path)
        self.proc = subprocess.Popen(cmd, env=env, cwd=d)
        self.done = open(self.done_path)  # blocks until rank 0 opens its end
        self.info = self._read()
        self.cmds = []
        for r in range(ranks):
            path = os.path.join(d, f"cmd.{name}.{r}")
            while not os.path.exists(path):
                time.sleep(0.01)
            self.cmds.append(open(path, "w"))

    def _read(self) -> Dict[str, Any]:
        line = self.done.readline()  # blocks until rank 0 answers
        if not line:
            raise RuntimeError(f"job {self.name} ended without an answer (exit {self.proc.poll()})")
        return json.loads(line)

    def ask(self, **req: Any) -> Dict[str, Any]:
        for f in self.cmds:
            f.write(json.dumps(req) + "\n")
            f.flush()
        return self._read()

    def close(self) -> None:
        for f in self.cmds:
            try:
                f.write(json.dumps({"what": "quit"}) + "\n")
                f.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.done.close()


def iters_for(nbytes: int, ranks: int) -> int:
    base = 300 if nbytes <= 256 * KB else 120 if nbytes <= 2 * MB else 40
    return max(20, base // (3 if ranks > 2 else 1))


def floor_us(nbytes: int, copy_gbps: float, algorithm: str) -> Dict[str, Any]:
    """The memory-bandwidth floor of one 2-rank call on ordinary buffers (docs/results.md):
    the bytes the algorithm must read and write per rank at the measured copy bandwidth (a copy
    of B bytes reads B and writes B, so it touches 2B in B / copy_gbps)."""
    s = nbytes
    if algorithm == "two-shot":
        # cross-memory two-shot, G = 2 (shard s/2): fetch the peer's half of my shard (read s/2,
        # write s/2 into scratch), reduce it with mine into my output (read s, write s/2), push
        # my reduced shard into the peer's output (read s/2, write s/2).
        touched = (s / 2 + s / 2) + (s + s / 2) + (s / 2 + s / 2)
        how = "two-shot: cma fetch s/2 (r+w) + reduce (r s, w s/2) + cma push s/2 (r+w) = 3.5 s touched"
    else:
        touched = 2 * s + 2 * s + s  # stage-in copy (r+w s), reduce (r 2s, w s)
        how = "one-shot: stage-in s (r+w) + reduce (r 2s, w s) = 5 s touched"
    us = touched / 2 / (copy_gbps * 1e9) * 1e6
    return {"floor_us": us, "touched_bytes": touched, "how": how}


def coordinator(args: argparse.Namespace) -> int:
    t_start = time.time()

    def stat(v: List[float]) -> float:
        return float(np.quantile(v, args.quantile))

    d = tempfile.mkdtemp(prefix="nvrar-latency-")
    jobs: Dict[str, Job] = {}
    results: Dict[str, Any] = {"old_new": [], "peers": [], "single": {}, "copy": {}}
    try:
        print(f"# load: {os.getloadavg()}; statistic: quantile {args.quantile} of the per-call times", flush=True)
        jobs["old"] = Job("old", 2, args.old_path, False, d)
        jobs["new"] = Job("new", 2, None, True, d)
        print(f"# old nvrar: {jobs['old'].info['nvrar']}; new nvrar: {jobs['new'].info['nvrar']}", flush=True)
        ds_reason = jobs["new"].info["ds_reason"]
        peers = ["nvrar", "mpi"] + ([] if ds_reason else ["deepspeed"])
        if ds_reason:
            print(f"# deepspeed skipped: {ds_reason}", flush=True)

        # (a) old vs new, 2 ranks, cold and warm, 8K-2M; one rank 8 KB
        rounds = args.rounds
        acc: Dict[Any, List[float]] = {}
        for r in range(rounds):
            for s in sizes(8 * KB, 2 * MB):
                for timing in ("cold", "warm"):
                    for build in (("old", "new") if r % 2 == 0 else ("new", "old")):
                        res = jobs[build].ask(what="measure", backend="nvrar", bytes=s, timing=timing,
                                              iters=iters_for(s, 2) // rounds + 10)
                        acc.setdefault((build, s, timing), []).extend(res["us"])
            for build in ("old", "new"):
                acc.setdefault((build, "single"), []).extend(jobs[build].ask(what="single", iters=5)["us"])
            if time.time() - t_start > args.budget_s / 2:
                print(f"# budget: old vs new stopped after round {r + 1}", flush=True)
                break
        print("\n## (a) old build vs new, 2 ranks, torch float32 sum, us (per-call max over ranks)")
        print(f"{'size':>6} {'cold old':>9} {'cold new':>9} {'ratio':>6} {'warm old':>9} {'warm new':>9} {'ratio':>6}")
        for s in sizes(8 * KB, 2 * MB):
            row = {"bytes": s}
            for timing in ("cold", "warm"):
                o, n = (stat(acc[(b, s, timing)]) for b in ("old", "new"))
                row[timing] = {"old_us": o, "new_us": n, "ratio": n / o}
            results["old_new"].append(row)
            c, w = row["cold"], row["warm"]
            print(f"{fmt(s):>6} {c['old_us']:9.2f} {c['new_us']:9.2f} {c['ratio']:6.2f} "
                  f"{w['old_us']:9.2f} {w['new_us']:9.2f} {w['ratio']:6.2f}")
        so, sn = (stat(acc[(b, "single")]) for b in ("old", "new"))
        results["single"] = {"old_us": so, "new_us": sn, "ratio": sn / so}
        print(f"one rank, 8 KB torch call: old {so:.2f} us, new {sn:.2f} us, ratio {sn / so:.2f}", flush=True)
        jobs.pop("old").close()

        # (b) peers, cold, 2 ranks then 4 ranks, 8K-16M
        for s in (8 * MB, 16 * MB, 64 * MB):
            results["copy"][s] = jobs["new"].ask(what="copy", bytes=s)["gbps"]
        for ranks in (2, 4):
            if ranks == 4:
                jobs.pop("new").close()
                jobs["new4"] = Job("new4", 4, None, True, d)
            job = jobs["new" if ranks == 2 else "new4"]
            acc = {}
            for r in range(rounds):
                for s in sizes(8 * KB, 16 * MB):
                    for b in (peers if r % 2 == 0 else peers[::-1]):
                        res = job.ask(what="measure", backend=b, bytes=s, timing="cold",
                                      iters=iters_for(s, ranks) // rounds + 5)
                        acc.setdefault((b, s), []).extend(res["us"])
                if time.time() - t_start > args.budget_s:
                    print(f"# budget: {ranks} ranks stopped after round {r + 1}", flush=True)
                    break
            print(f"\n## (b) peers, cold, {ranks} ranks, us")
            print(f"{'size':>6} " + " ".join(f"{b:>10}" for b in peers) + "  nvrar/best-peer")
            for s in sizes(8 * KB, 16 * MB):
                row: Dict[str, Any] = {"ranks": ranks, "bytes": s}
                for b in peers:
                    row[b] = stat(acc[(b, s)])
                best = min(row[b] for b in peers if b != "nvrar")
                row["ratio_best"] = row["nvrar"] / best
                if "deepspeed" in row:
                    row["ratio_ds"] = row["nvrar"] / row["deepspeed"]
                results["peers"].append(row)
                print(f"{fmt(s):>6} " + " ".join(f"{row[b]:10.2f}" for b in peers) + f"  {row['ratio_best']:.2f}")
            sys.stdout.flush()
    finally:
        for j in jobs.values():
            j.close()
        shutil.rmtree(d, ignore_errors=True)

    # -- the target ratios ------------------------------------------------------------------------
    checks: List[Any] = []
    copy = results["copy"]
    print("\n## memory-bandwidth floor (2 ranks, ordinary buffers): copy bandwidth per rank with both ranks "
          "copying at once, copies of the message's size: "
          + ", ".join(f"{fmt(s)} {g:.2f} GB/s" for s, g in sorted(copy.items())))
    for row in results["peers"]:
        if row["ranks"] != 2:
            continue
        s = row["bytes"]
        if s <= 2 * MB and "ratio_ds" in row:
            checks.append((f"cold 2 ranks {fmt(s)}: nvrar/deepspeed = {row['ratio_ds']:.2f} <= 0.67", row["ratio_ds"] <= 0.67))
        elif s >= 8 * MB:
            gbps = copy[s]
            fl = floor_us(s, gbps, "two-shot")
            row["floor"] = fl
            near = row["nvrar"] / fl["floor_us"]
            print(f"{fmt(s)}: {fl['how']}: {fl['touched_bytes'] / MB:.1f} MB touched / 2 / {gbps:.2f} GB/s = "
                  f"{fl['floor_us']:.1f} us; nvrar {row['nvrar']:.1f} us = {near:.2f}x the floor")
            ok = near <= 1.25 or ("ratio_ds" in row and row["ratio_ds"] <= 0.67)
            ds = f"nvrar/deepspeed = {row['ratio_ds']:.2f}, " if "ratio_ds" in row else ""
            checks.append((f"cold 2 ranks {fmt(s)}: {ds}nvrar/floor = {near:.2f} (<= 0.67 vs deepspeed or <= 1.25 "
                           "vs floor)", ok))
    for row in results["peers"]:
        if row["ranks"] == 4:
            checks.append((f"cold 4 ranks {fmt(row['bytes'])}: nvrar/best peer = {row['ratio_best']:.2f} <= 0.8",
                           row["ratio_best"] <= 0.8))
    for row in results["old_new"]:
        for timing in ("cold", "warm"):
            r = row[timing]["ratio"]
            checks.append((f"{timing} 2 ranks {fmt(row['bytes'])}: new/old = {r:.2f} <= 1.0", r <= 1.0))
    sr = results["single"]["ratio"]
    checks.append((f"one rank 8 KB torch: new/old = {sr:.2f} <= 1.0 (new {results['single']['new_us']:.2f} us)",
                   sr <= 1.0))
    print("\n## target ratios")
    for text, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    fails = sum(1 for _, ok in checks if not ok)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(results, checks=[{"check": t, "pass": ok} for t, ok in checks]), f, indent=1)
    print(f"# load: {os.getloadavg()}; {time.time() - t_start:.0f} s")
    print(f"latency_check: {len(checks) - fails} passed, {fails} failed")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", nargs="?", default="coordinator", choices=["coordinator", "worker"])
    p.add_argument("--old-path", help="directory holding the old build's nvrar package (pip install --target)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over builds and peers (default 3)")
    p.add_argument("--budget-s", type=float, default=420, help="stop adding rounds after this long (default 420)")
    p.add_argument("--json", help="write every number and check here")
    p.add_argument("--quantile", type=float, default=0.5,
                   help="statistic of the per-call times (default 0.5: the median, as the targets are stated; a "
                        "lower one, e.g. 0.2, sees through a host loaded by other work)")
    p.add_argument("--job")
    p.add_argument("--dir")
    p.add_argument("--peers", action="store_true")
    args = p.parse_args()
    if args.role == "worker":
        return worker_main(args)
    if not args.old_path:
        p.error("--old-path is required")
    return coordinator(args)


if __name__ == "__main__":
    sys.exit(main())
