"""Tasks of the cross-host tests (tests/test_hosts.py), run by _worker.py on every rank: on
network-namespace hosts (tests/_netns.py) and, for the bitwise comparison, on one host with the
same layout emulated (ranks_per_node)."""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from typing import Any, Dict, List

import numpy as np

import nvrar
import _matrix

OPS = ("sum", "max", "min", "avg")
ALGORITHMS = ("one-shot", "two-shot")
# Odd counts: shard bounds that do not divide; 70001 float32 spans several 64 KB chunks.
COUNTS = (1, 3, 127, 1021, 4099, 70001)


def _error(exc: BaseException) -> Dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc), "is_nvrar": isinstance(exc, nvrar.NvrarError),
            **{k: getattr(exc, k, None) for k in ("rank", "peer", "phase", "step", "epoch", "kind")}}


def _inputs(rank: int, count: int, seed: int, dtype: Any) -> np.ndarray:
    """Random values whose sums round differently in every order: the result's bits depend on the
    reduction order, so equal digests mean the same order (the round is canonical)."""
    rng = np.random.default_rng([seed, rank, count])
    if np.dtype(dtype) == np.int32:
        return rng.integers(-1000, 1000, count, dtype=np.int32)
    return (rng.standard_normal(count) * 10).astype(dtype)


def task_hosts_matrix(args: dict) -> dict:
    """The exact matrix (correct values, bitwise across ranks), then the order-sensitive matrix
    (dtypes x ops x odd counts x algorithms on random data): one digest per case, to compare with
    the same layout emulated on one host."""
    if os.environ.get("NVRAR_TEST_HIDE_UCX") == "1":
        sys.modules["libucx"] = None  # type: ignore[assignment]  # `import libucx` raises ImportError
    comm = nvrar.Communicator(ranks_per_node=args["G"], max_bytes=args.get("max_bytes", 65536),
                              timeout=args.get("timeout", 60))
    report: Dict[str, Any] = {"matrix": _matrix.run_matrix(comm, quick=True)}
    cases: Dict[str, str] = {}
    types = [("float32", np.float32), ("float16", np.float16), ("int32", np.int32)]
    torch = _matrix._torch()
    for name, dt in types:
        for op in OPS:
            for algorithm in ALGORITHMS:
                for count in COUNTS:
                    x = _inputs(comm.rank, count, 11, dt)
                    y = comm.all_reduce(x, op, algorithm=algorithm)
                    cases[f"{name}/{op}/{algorithm}/{count}"] = hashlib.sha256(y.tobytes()).hexdigest()
    if torch is not None:  # bfloat16 exists only as a torch dtype
        for op in OPS:
            for algorithm in ALGORITHMS:
                for count in COUNTS:
                    x = torch.from_numpy(_inputs(comm.rank, count, 13, np.float32)).to(torch.bfloat16)
                    y = comm.all_reduce(x, op, algorithm=algorithm)
                    cases[f"bfloat16/{op}/{algorithm}/{count}"] = hashlib.sha256(
                        y.view(torch.int16).numpy().tobytes()).hexdigest()
    report["cases"] = cases
    report["transports"] = {str(r): comm._ex.link_transports(r) for r in range(comm.world_size)}
    report["landings"] = list(comm._ex.link_landings())  # (applied as they arrived, landed in a zone)
    report["host"] = os.uname().nodename
    report["settings"] = {"ll_max_bytes": comm.settings.ll_max_bytes, "hd_min_bytes": comm.settings.hd_min_bytes}
    comm.close()
    return report


def task_hosts_mismatch(args: dict) -> dict:
    """Every rank calls all_reduce on its own count (args["counts"][rank]), chosen by the test so
    that the 16-bit call signatures collide: the flag words match, the call descriptions do not.
    The output sits in front of a canary; no peer may write past it, and no rank may return."""
    comm = nvrar.Communicator(ranks_per_node=args["G"], max_bytes=args["max_bytes"], timeout=args["timeout"])
    n, canary_n = args["counts"][comm.rank], 64 << 10
    buf = np.full(n + canary_n, -7.0, dtype=np.float32)
    x, canary = buf[:n], buf[n:]
    x[:] = comm.rank + 1.0
    out: Dict[str, Any] = {"error": None}
    t0 = time.monotonic()
    try:
        comm.all_reduce(x, "sum", algorithm="two-shot")
    except Exception as exc:
        out["error"] = _error(exc)
    out["elapsed"] = time.monotonic() - t0
    time.sleep(0.5)  # a peer's stray writes, if any, land before the canary is read
    out["canary_intact"] = bool(np.all(canary == -7.0))
    comm.close()
    return out


def task_hosts_fault(args: dict) -> dict:
    """Back-to-back calls (every result checked) until one raises. 'stop' victim: stops itself
    (SIGSTOP) at call `at`; the other faults come from outside (the test kills a host or takes a
    link down once every rank wrote its `ready` file)."""
    comm = nvrar.Communicator(ranks_per_node=args["G"], timeout=args["timeout"], max_bytes=1 << 20)
    rank, W = comm.rank, comm.world_size
    n = args.get("count", 1 << 18)
    x = np.empty(n, dtype=np.float32)
    want = np.float32(W * (W + 1) // 2)
    out: Dict[str, Any] = {"calls_ok": 0, "wrong": 0}
    ready = os.path.join(args["dir"], f"ready-{rank}")
    try:
        for i in range(args.get("max_calls", 1 << 30)):
            if rank == args.get("victim") and args["mode"] == "stop" and i == args["at"]:
                os.kill(os.getpid(), signal.SIGSTOP)
            x.fill(rank + 1)
            comm.all_reduce(x)
            if not (x == want).all():
                out["wrong"] += 1
            out["calls_ok"] += 1
            if i == 3:
                with open(ready, "w") as f:
                    f.write(str(time.time()))
    except Exception as exc:
        out["raised_at"] = time.time()
        out["exception"] = _error(exc)
    comm.close()
    return out


def task_hosts_torch(args: dict) -> dict:
    """The `nvrar` backend across hosts: a TP MLP under DTensor (parallelize_module), bitwise
    equal to the same module on a gloo group and to the unsharded one, served by nvrar."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    import nvrar.torch as nt
    import _torch_tasks

    torch.set_num_threads(1)
    dist.init_process_group("nvrar", timeout=datetime.timedelta(seconds=120))
    world = dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ref_mesh = DeviceMesh.from_group(gloo, "cpu", mesh_dim_names=("ref",))
    res: Dict[str, Any] = {"dtensor": _torch_tasks.dtensor_cases(mesh, ref_mesh, None, nt, dist.group.WORLD)}
    t = torch.arange(5000.0) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    res["value"] = bool(torch.equal(t, torch.arange(5000.0) * (world * (world + 1) // 2)))
    res["stats"] = nt.stats()
    if world == 4:  # 2 hosts x 2 ranks: a (dp, tp) mesh, tp inside a host and dp across hosts
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        ref = {rs: dist.new_group(list(rs), backend="gloo") for rs in ((0, 1), (2, 3), (0, 2), (1, 3))}
        res["subgroups"] = {}
        for dim in ("dp", "tp"):
            g = mesh2.get_group(dim)
            ranks = tuple(dist.get_process_group_ranks(g))
            x = torch.randn(70001, generator=torch.Generator().manual_seed(1000 + dist.get_rank())) * 10
            y = x.clone()
            dist.all_reduce(x, group=g)
            dist.all_reduce(y, group=ref[ranks])
            res["subgroups"][dim] = {"ranks": list(ranks), "equal_gloo": bool(torch.equal(x, y)),
                                     "nonzero": bool(torch.count_nonzero(x) > 0), "stats": nt.stats(g)}
    nt.reset()
    _torch_tasks.finish()
    return res


FORGED = ("outside", "oversized", "beyond", "abort-data", "two-puts")


def task_hosts_forged(args: dict) -> dict:
    """Rank 0 sends rank 1 (on another host) each malformed message of CpuExecutor::debug_forge
    (data outside the zones, more than a zone, a piece past its put, data with the abort cell,
    pieces of two puts into one cell), as a faulty or hostile peer could; rank 1's link must refuse
    every one, and its next call raise a protocol violation."""
    comm = nvrar.Communicator(ranks_per_node=1, timeout=args["timeout"])
    rank = comm.rank
    x = np.ones(4096, dtype=np.float32)
    comm.all_reduce(x)
    out: Dict[str, Any] = {"first_ok": bool((x == comm.world_size).all())}
    forged = os.path.join(args["dir"], "forged")
    counted = os.path.join(args["dir"], "counted")

    def wait_file(path: str) -> None:
        deadline = time.monotonic() + 60
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(path)
            time.sleep(0.01)

    if rank == 0:
        for what in FORGED:
            comm._ex._debug_forge(1, what)
        open(forged, "w").close()
        wait_file(counted)
    else:
        wait_file(forged)
        until = time.monotonic() + 10
        while comm._ex.link_refused() < len(FORGED) and time.monotonic() < until:
            comm._ex.link_progress()
            time.sleep(0.001)
        time.sleep(0.2)  # a message refused late would show up here
        comm._ex.link_progress()
        out["refused"] = comm._ex.link_refused()
        open(counted, "w").close()
    try:
        x.fill(1)
        comm.all_reduce(x)
        out["second_ok"] = bool((x == comm.world_size).all())
    except Exception as exc:
        out["exception"] = _error(exc)
    comm.close()
    return out


TASKS = {name[len("task_"):]: fn for name, fn in list(globals().items()) if name.startswith("task_hosts_")}
__all__: List[str] = ["TASKS"]
