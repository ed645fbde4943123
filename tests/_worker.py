"""One rank of a multi-process test: `python _worker.py TASK ARGS_JSON REPORT_PATH`.

Bootstraps a Communicator from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
runs TASK, and writes a JSON report. Exit status 0 means the task ran to its end."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import nvrar  # noqa: E402
import _matrix  # noqa: E402


def error_fields(exc: BaseException) -> dict:
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "is_timeout": isinstance(exc, nvrar.NvrarTimeoutError),
        "is_nvrar": isinstance(exc, nvrar.NvrarError),
        **{k: getattr(exc, k, None) for k in ("rank", "peer", "phase", "step", "epoch", "observed", "kind")},
    }


def task_matrix(args: dict) -> dict:
    comm = nvrar.Communicator(ranks_per_node=args["G"], max_bytes=args.get("max_bytes", 8192),
                              timeout=args.get("timeout", 60))
    report = _matrix.run_matrix(comm, quick=args.get("quick", False))
    report["burst"] = _matrix.run_burst(comm, calls=args.get("burst", 300), seed=args.get("seed", 1))
    report["cma_enabled"] = comm._ex.cma_enabled
    comm.close()
    return report


def task_jitter(args: dict) -> dict:
    comm = nvrar.Communicator(ranks_per_node=args["G"], max_bytes=args.get("max_bytes", 4096),
                              timeout=args.get("timeout", 60))
    report = {"burst": _matrix.run_burst(comm, calls=args["calls"], seed=args.get("seed", 7), max_count=3000)}
    report["epoch"] = comm._ex.epoch
    comm.close()
    return report


def task_fault(args: dict) -> dict:
    """Rank `victim` misbehaves at call `at`: 'die' (exits), 'absent' (never calls, sleeps),
    'count'/'dtype'/'op' (calls with a different signature). Others call normally."""
    comm = nvrar.Communicator(ranks_per_node=args["G"], timeout=args["timeout"])
    rank, victim, mode = comm.rank, args["victim"], args["mode"]
    n = args.get("count", 1000)
    out = {"calls_ok": 0}
    for i in range(args["at"] + 1):
        x = np.full(n, 1.0, dtype=np.float32)
        op = "sum"
        if i == args["at"] and rank == victim:
            if mode == "die":
                os._exit(3)
            if mode == "absent":
                time.sleep(args["timeout"] + 2)
                out["slept"] = True
                return out
            if mode == "count":
                x = np.full(n + 1, 1.0, dtype=np.float32)
            if mode == "dtype":
                x = np.full(n, 1, dtype=np.int32)
            if mode == "op":
                op = "max"
        t0 = time.monotonic()
        try:
            comm.all_reduce(x, op)
            out["calls_ok"] += 1
        except Exception as exc:  # the point of the test: report what was raised, and when
            out["error"] = error_fields(exc)
            out["elapsed"] = time.monotonic() - t0
            # A failed communicator stays failed.
            try:
                comm.all_reduce(np.ones(4, np.float32))
                out["after"] = "no error"
            except Exception as exc2:
                out["after"] = error_fields(exc2)
            return out
    return out


def task_badinput(args: dict) -> dict:
    """Every rank makes the same bad calls (each must raise before communicating), then a good one."""
    import torch

    comm = nvrar.Communicator(ranks_per_node=args["G"], timeout=20)
    raised = {}
    cases = _matrix.bad_input_cases(torch)
    for name, (fn, _, _) in cases.items():
        try:
            fn(comm)
            raised[name] = None
        except Exception as exc:
            raised[name] = {"type": type(exc).__name__, "message": str(exc)}
    x = np.full(100, float(comm.rank), dtype=np.float32)
    comm.all_reduce(x)
    expect = float(sum(range(comm.world_size)))
    return {"raised": raised, "good_call_ok": bool(np.all(x == expect)), "epoch": comm._ex.epoch}


def task_torchgroup(args: dict) -> dict:
    from _torch_tasks import finish

    """Bootstrap over torch.distributed (gloo): the default group, then a subgroup."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    with nvrar.Communicator(ranks_per_node=args["G"]) as comm:
        out["bootstrap"] = comm.bootstrap
        rep = _matrix.run_matrix(comm, quick=True)
        out["matrix"] = rep
        x = torch.full((1000,), float(rank))
        comm.all_reduce(x, dist.ReduceOp.SUM)
        out["sum_ok"] = bool(torch.all(x == sum(range(world))))
    members = [0, world - 1]
    sub = dist.new_group(members)
    if rank in members:
        with nvrar.Communicator(group=sub, ranks_per_node=1) as comm:
            x = torch.full((5000,), float(rank), dtype=torch.bfloat16)
            comm.all_reduce(x, "max")
            out["sub"] = {"rank": comm.rank, "world": comm.world_size, "max_ok": bool(torch.all(x == world - 1))}
    finish()
    return out


def task_close_race(args: dict) -> dict:
    """Rank 0: a thread waits in all_reduce (rank 1 never calls) while the main thread closes the
    communicator: the call must raise, close must return, nothing may crash."""
    import threading

    comm = nvrar.Communicator(ranks_per_node=args["G"], timeout=30)
    if comm.rank != 0:
        time.sleep(4)
        return {"waited": True}
    out = {}

    def call():
        try:
            comm.all_reduce(np.ones(100000, np.float32))
            out["thread"] = "no error"
        except Exception as exc:
            out["thread"] = f"{type(exc).__name__}: {exc}"

    t = threading.Thread(target=call)
    t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    comm.close()
    out["close_s"] = time.monotonic() - t0
    t.join(timeout=20)
    out["joined"] = not t.is_alive()
    return out


TASKS = {"close_race": task_close_race, "matrix": task_matrix, "jitter": task_jitter, "fault": task_fault, "badinput": task_badinput,
         "torchgroup": task_torchgroup}


def task_store(args: dict) -> dict:
    """Rendezvous through the TCP store (rank `late` arrives `delay` s late), then `calls`
    all-reduces of rank-dependent values, each checked exactly."""
    if os.environ.get("RANK") == str(args.get("late", -1)):
        time.sleep(args.get("delay", 0.0))
    comm = nvrar.Communicator(timeout=args.get("timeout", 60))
    W, ok = comm.world_size, 0
    for i in range(args.get("calls", 5)):
        x = np.full(1000 + i, float(comm.rank + 1 + i), dtype=np.float32)
        comm.all_reduce(x)
        ok += bool(np.all(x == float(sum(r + 1 + i for r in range(W)))))
    comm.close()
    return {"checked": ok}


TASKS["store"] = task_store


def main() -> int:
    task, args, report_path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    if task not in TASKS and task.startswith("fused_"):
        import _fused_tasks

        TASKS.update(_fused_tasks.TASKS)
    elif task not in TASKS and task.startswith("gpu_"):
        import _gpu_tasks

        TASKS.update(_gpu_tasks.TASKS)
    elif task not in TASKS:
        import _torch_tasks

        TASKS.update(_torch_tasks.TASKS)
    try:
        report = TASKS[task](args)
        code = 0
    except Exception as exc:
        report = {"exception": error_fields(exc), "traceback": traceback.format_exc()}
        traceback.print_exc()
        code = 1
    raw_rank = os.environ.get("RANK", "0")
    report["rank"] = int(raw_rank) if raw_rank.strip().isdigit() else raw_rank  # a bad RANK is a test case
    with open(report_path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(report_path + ".tmp", report_path)
    return code


if __name__ == "__main__":
    sys.exit(main())
