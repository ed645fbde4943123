"""One rank of a multi-process test: `python _worker.py TASK ARGS_JSON REPORT_PATH`.

Bootstraps a Communicator from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
runs TASK, and writes a JSON report. Exit status 0 means the task ran to its end."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback

# The launcher (_launch.py) ends a rank past its deadline with SIGTERM first: every thread's Python
# stack goes to stderr, then the default action ends the process. Registered before the imports.
faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)

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


def task_mismatch_bounds(args: dict) -> dict:
    """Each rank calls all_reduce on its own count (args["count"]), chosen by the test so that the
    16-bit call signatures collide. The output sits in front of a canary (private memory, or the
    next block of the symmetric heap with where="pool"); a peer must never write past it."""
    comm = nvrar.Communicator(ranks_per_node=args["G"], timeout=args.get("timeout", 30))
    n, rank = args["count"], comm.rank
    canary_n = 64 << 10
    if args.get("where") == "pool":
        x = comm.empty(n, np.float32)
        canary = comm.empty(canary_n, np.float32)
        canary[:] = -7.0
    else:
        buf = np.full(n + canary_n, -7.0, dtype=np.float32)
        x = buf[:n]
        canary = buf[n:]
    x[:] = rank + 1.0
    out = {}
    t0 = time.monotonic()
    try:
        comm.all_reduce(x, "sum", algorithm=args.get("algorithm"))
        out["error"] = None
        out["result_ok"] = bool(np.all(x == sum(range(1, comm.world_size + 1))))
    except Exception as exc:
        out["error"] = error_fields(exc)
    out["elapsed"] = time.monotonic() - t0
    time.sleep(0.5)  # let a peer's stray writes, if any, land before looking
    out["canary_intact"] = bool(np.all(canary == -7.0))
    return out


def nan_inputs(rank: int, n: int) -> np.ndarray:
    """Float32 values of one rank: specials (NaNs of several payloads and signs, infinities,
    signed zeros) mixed with ordinary values, differently on every rank."""
    rng = np.random.default_rng(1000 + rank)
    specials = np.array([0x7fc00000, 0xffc00000, 0x7f800001, 0x7fc12345, 0xff812345,  # NaNs (quiet, signalling)
                         0x7f800000, 0xff800000, 0x00000000, 0x80000000], dtype=np.uint32).view(np.float32)
    v = rng.standard_normal(n).astype(np.float32)
    pick = rng.random(n) < 0.3
    v[pick] = specials[rng.integers(0, len(specials), int(pick.sum()))]
    v[:2] = (0.0, -0.0) if rank % 2 == 0 else (-0.0, 0.0)  # signed zeros in both orders
    return v


def nan_rule(vals: np.ndarray, op: str) -> np.ndarray:
    """The rule of csrc/protocol/types.h over the rows of `vals` (float32): any NaN gives the
    canonical quiet NaN 0x7fc00000; otherwise the largest (smallest) value, with +0 > -0 in
    either order."""
    with np.errstate(invalid="ignore"):
        ref = vals.max(0) if op == "max" else vals.min(0)
    zero = ref == 0
    sign = np.signbit(vals)
    if op == "max":
        ref[zero] = np.where(np.any((vals == 0) & ~sign, 0), 0.0, -0.0)[zero]
    else:
        ref[zero] = np.where(np.any((vals == 0) & sign, 0), -0.0, 0.0)[zero]
    ref[np.isnan(vals).any(0)] = np.uint32(0x7fc00000).view(np.float32)
    return ref


def task_nan(args: dict) -> dict:
    """max/min with NaN, inf and signed zeros, in every floating dtype and both variants: the
    result bits against nan_rule (and torch.amax/amin up to the sign of zero)."""
    import hashlib

    import torch

    comm = nvrar.Communicator(ranks_per_node=args["G"], max_bytes=args.get("max_bytes", 8192), timeout=60)
    W, rank = comm.world_size, comm.rank
    out: dict = {"checks": 0, "failures": [], "digests": {}}
    for n in args["counts"]:
        f32 = np.stack([nan_inputs(r, n) for r in range(W)])
        for dt in ("float32", "float16", "bfloat16"):
            if dt == "bfloat16":
                inputs = torch.from_numpy(f32).to(torch.bfloat16)
                vals = inputs.float().numpy()
            else:
                inputs = f32.astype(dt)
                vals = inputs.astype(np.float32)
            for op in ("max", "min"):
                ref = nan_rule(vals, op)
                nan = np.isnan(ref)
                # torch agrees on everything but the order-dependent sign of a zero result.
                t = torch.from_numpy(vals)
                tref = (t.amax(0) if op == "max" else t.amin(0)).numpy()
                assert np.array_equal(np.isnan(tref), nan) and np.array_equal(tref[~nan], ref[~nan]), (dt, op)
                for algorithm in ("one-shot", "two-shot"):
                    if dt == "bfloat16":
                        x = inputs[rank].clone()
                        comm.all_reduce(x, op, algorithm=algorithm)
                        got = x.view(torch.int16).numpy().view(np.uint16)
                        want = torch.from_numpy(ref).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy()
                        want[nan] = 0x7fc0
                    else:
                        x = inputs[rank].copy()
                        comm.all_reduce(x, op, algorithm=algorithm)
                        ut = np.uint32 if dt == "float32" else np.uint16
                        got = x.view(ut)
                        want = ref.astype(dt).view(ut).copy()
                        want[nan] = 0x7fc00000 if dt == "float32" else 0x7e00
                    key = f"{n}/{op}/{dt}/{algorithm}"
                    out["checks"] += 1
                    bad = np.flatnonzero(got != want)
                    if bad.size:
                        i = int(bad[0])
                        out["failures"].append(f"{key}: {bad.size} wrong, first at {i}: got {int(got[i]):#x}, want "
                                               f"{int(want[i]):#x}, inputs {[float(v) for v in vals[:, i]]}")
                    out["digests"][key] = hashlib.sha256(got.tobytes()).hexdigest()
    comm.close()
    return out


def task_sigint(args: dict) -> dict:
    """Ranks in `waiters` call all_reduce while the others stay away (sleep `absent_s`, then call).
    A waiter writes its pid to args["pidfile"] + rank once it is about to wait; the test sends
    SIGINT to rank `victim` and reports when; every rank reports what it raised and when."""
    # A process inherits its launcher's SIGINT disposition and signal mask: Python installs its
    # KeyboardInterrupt handler only where SIGINT was not ignored, and never unblocks it. The test
    # is about nvrar's handling, not the launcher's state, so restore both (and report them).
    inherited = {"handler": str(signal.getsignal(signal.SIGINT)),
                 "blocked": signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    comm = nvrar.Communicator(ranks_per_node=args["G"], timeout=args["timeout"])
    rank = comm.rank
    out: dict = {"inherited": inherited}
    x = np.ones(args.get("count", 100000), np.float32)
    if rank in args["waiters"]:
        with open(f"{args['pidfile']}{rank}.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(f"{args['pidfile']}{rank}.tmp", f"{args['pidfile']}{rank}")
    else:
        time.sleep(args["absent_s"])
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
        out["error"] = None
    except BaseException as exc:  # KeyboardInterrupt included: that is the point
        out["error"] = error_fields(exc)
    out["raised_at"] = time.time()
    out["elapsed"] = time.monotonic() - t0
    try:
        comm.all_reduce(np.ones(4, np.float32))
        out["after"] = None
    except Exception as exc:
        out["after"] = error_fields(exc)
    return out


def task_closed_peer(args: dict) -> dict:
    """Rank `victim` closes its communicator (mode "close"; "gc": drops its last reference;
    "close_live": close() while an empty() block is alive) after `calls` good calls, and lives on
    for `linger_s`. The others call once more: they must raise at once, naming it."""
    import gc

    comm = nvrar.Communicator(ranks_per_node=args["G"], timeout=args["timeout"])
    rank, victim, mode = comm.rank, args["victim"], args["mode"]
    x = np.ones(args.get("count", 1000), np.float32)
    for _ in range(args.get("calls", 2)):
        comm.all_reduce(x)
    out: dict = {}
    if rank == victim:
        block = None
        if mode == "close_live":
            block = comm.empty(16, np.float32)
        if mode == "gc":
            del comm
            gc.collect()
        else:
            comm.close()
        time.sleep(args["linger_s"])
        out["lived"] = block is None or block.size == 16
        return out
    time.sleep(0.3)  # the victim closes first (a call already waiting must notice it too)
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
        out["error"] = None
    except Exception as exc:
        out["error"] = error_fields(exc)
    out["elapsed"] = time.monotonic() - t0
    return out


def task_stop(args: dict) -> dict:
    """Rank `victim` stops itself with SIGSTOP before call `at` (a helper process kills it later);
    the others report when their call raised."""
    import signal
    import subprocess

    comm = nvrar.Communicator(ranks_per_node=args["G"], timeout=args["timeout"])
    rank = comm.rank
    out: dict = {"calls_ok": 0}
    for i in range(args["at"] + 1):
        x = np.ones(args.get("count", 100000), np.float32)
        if i == args["at"] and rank == args["victim"]:
            subprocess.Popen(["sh", "-c", f"sleep {args['kill_after_s']}; kill -9 {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            comm.all_reduce(x)
            out["calls_ok"] += 1
        except Exception as exc:
            out["error"] = error_fields(exc)
            out["elapsed"] = time.monotonic() - t0
            return out
    return out


def task_phase_times(args: dict) -> dict:
    """The executor's phase timing (benchmarks/call_phases.py): off, nothing is kept; on, every
    call is counted and its phases lie within it."""
    comm = nvrar.Communicator()
    ex = comm._ex
    W = comm.world_size
    small = np.ones(2048, np.float32)
    large = np.ones(1 << 18, np.float32)
    comm.all_reduce(small)
    off = ex.take_phase_times()
    ex.set_phase_timing(True)
    ok = True
    for _ in range(10):
        small.fill(1)
        large.fill(1)
        comm.all_reduce(small, algorithm="one-shot")
        comm.all_reduce(large, algorithm="two-shot")
        ok = ok and bool((small == W).all() and (large == W).all())
    on = ex.take_phase_times()
    after = ex.take_phase_times()
    ex.set_phase_timing(False)
    comm.close()
    return {"off": off, "on": on, "after": after, "ok": ok}


def task_crowded(args: dict) -> dict:
    """Random calls with their results checked while other processes keep every core busy (the
    test starts them; NOTE [waiting], csrc/cpu/executor.cpp)."""
    comm = nvrar.Communicator(max_bytes=args.get("max_bytes", 1 << 20), timeout=args.get("timeout", 60))
    comm._ex.set_phase_timing(True)
    t0 = time.monotonic()
    burst = _matrix.run_burst(comm, calls=args["calls"], seed=args.get("seed", 11), max_count=args.get("max_count", 1 << 18))
    seconds = time.monotonic() - t0
    times = comm._ex.take_phase_times()
    comm.close()
    return {"burst": burst, "calls": times["calls"], "seconds": seconds}


def task_ways(args: dict) -> dict:
    """NOTE [cross-memory or staged] (csrc/cpu/executor.cpp): two-shot calls on ordinary arrays
    above the cross-memory threshold, each checked bit for bit; per call, which way this rank took
    (cross-memory transfers counted by the phase timing, or none: staged)."""
    comm = nvrar.Communicator(timeout=60)
    ex = comm._ex
    W, r = comm.world_size, comm.rank
    n = args["count"]
    ex.set_phase_timing(True)
    ways, exact = [], True
    for i in range(args["calls"]):
        xs = [np.random.default_rng(1000 * i + k).standard_normal(n).astype(np.float32) for k in range(W)]
        want = xs[0].copy()
        for k in range(1, W):
            want += xs[k]  # the canonical order: local ranks 0, 1, ...
        a = xs[r].copy()
        comm.all_reduce(a, algorithm="two-shot")
        exact = exact and a.tobytes() == want.tobytes()
        ways.append("cma" if ex.take_phase_times()["cma_ns"] > 0 else "staged")
    way_calls = list(ex.way_calls)
    comm.close()
    return {"ways": ways, "exact": exact, "way_calls": way_calls,
            "cma_enabled": bool(ex.cma_enabled) if hasattr(ex, "cma_enabled") else None}


def task_stage_ways(args: dict) -> dict:
    """NOTE [streaming stage-in] (csrc/cpu/executor.cpp): one-shot calls on ordinary arrays (an
    odd count, and an input that starts 4 bytes into its buffer), each checked bit for bit; per
    call, the store kind this rank's stage-in took (from the counts of stage_calls), and the bytes
    it staged with streaming stores."""
    comm = nvrar.Communicator(timeout=60)
    ex = comm._ex
    W, r = comm.world_size, comm.rank
    n = args["count"]
    kinds, exact = [], True
    streamed0 = ex.streamed_bytes
    for i in range(args["calls"]):
        xs = [np.random.default_rng(1000 * i + k).standard_normal(n).astype(np.float32) for k in range(W)]
        want = xs[0].copy()
        for k in range(1, W):
            want += xs[k]  # the canonical order: local ranks 0, 1, ...
        buf = np.zeros(n + 1, np.float32)
        a = buf[1:]  # 4 bytes past a 64-byte boundary
        a[:] = xs[r]
        before = list(ex.stage_calls)
        comm.all_reduce(a, algorithm="one-shot")
        after = list(ex.stage_calls)
        exact = exact and a.tobytes() == want.tobytes()
        kinds.append("plain" if after[0] > before[0] else "stream" if after[1] > before[1] else "fixed")
    out = {"kinds": kinds, "exact": exact, "stage_calls": list(ex.stage_calls),
           "streamed_bytes": ex.streamed_bytes - streamed0, "bytes": 4 * n}
    comm.close()
    return out


def task_algo_ways(args: dict) -> dict:
    """NOTE [one-shot or two-shot] (csrc/cpu/executor.cpp): auto calls on ordinary arrays of the
    sizes in args["counts"] in turn (one size class each), back to back (every input made before
    the first call, every result checked bit for bit against the canonical sum after the last);
    per call the algorithm the leader's choice gave it (from the counts of algorithm_calls: "one",
    "two", or "fixed" where no choice was made) and what algorithm_for said before the call."""
    comm = nvrar.Communicator(timeout=60)
    ex = comm._ex
    W, r = comm.world_size, comm.rank
    counts, calls = args["counts"], args["calls"]
    xs = [[np.random.default_rng(100 * c + k).standard_normal(n).astype(np.float32) for k in range(W)]
          for c, n in enumerate(counts)]
    wants = []
    for per_rank in xs:
        want = per_rank[0].copy()
        for k in range(1, W):
            want += per_rank[k]  # the canonical order: local ranks 0, 1, ...
        wants.append(want)
    bufs = [xs[i % len(counts)][r].copy() for i in range(calls)]
    took, said = [], []
    for a in bufs:
        said.append(comm.algorithm_for(a.nbytes))
        before = ex.algorithm_calls
        comm.all_reduce(a)
        after = ex.algorithm_calls
        took.append("one" if after[1] > before[1] else "two" if after[0] > before[0] else "fixed")
    exact = all(np.array_equal(a.view(np.int32), wants[i % len(counts)].view(np.int32)) for i, a in enumerate(bufs))
    out = {"took": took, "said": said, "exact": exact, "algorithm_calls": list(ex.algorithm_calls),
           "adapt_max": comm.settings.oneshot_adapt_max(W)}
    comm.close()
    return out


def _my_segment_bytes(comm) -> bytes:
    """The bytes of my own shared-memory segment, read through my mapping of it (its file is
    unlinked once every rank attached): the mapping /proc/self/maps names after it."""
    import ctypes

    name = comm._ex.segment_name.lstrip("/")
    with open("/proc/self/maps") as f:
        for line in f:
            if name in line:
                lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
                return ctypes.string_at(lo, hi - lo)
    raise AssertionError(f"no mapping of {name} in /proc/self/maps")


def task_rotation(args: dict) -> dict:
    """NOTE [rotating stage-in] (csrc/protocol/round.h): `calls` one-shot calls, then as many
    two-shot calls staged through the segment (NVRAR_CMA=0), of 8 KB each, every call's input
    this rank's own (rank * 1000 + call + 0.5); then, per algorithm, how many of those inputs
    (one-shot: whole; two-shot: the part that is the peer's shard) are still in my segment's file,
    and whether every result was exact."""
    comm = nvrar.Communicator(timeout=60)
    W, r = comm.world_size, comm.rank
    n, calls = 2048, args["calls"]
    exact, found = True, {}
    for algorithm in ("one-shot", "two-shot"):
        inputs = []
        for k in range(calls):
            x = np.full(n, r * 1000 + k + 0.5, np.float32)
            inputs.append(x.copy())
            comm.all_reduce(x, algorithm=algorithm)
            exact = exact and bool(np.all(x == np.float32(sum(q * 1000 + k + 0.5 for q in range(W)))))
        seg = _my_segment_bytes(comm)
        half = n // 2 * 4
        parts = [x.tobytes() if algorithm == "one-shot" else
                 (x.tobytes()[half:] if r == 0 else x.tobytes()[:half]) for x in inputs]
        found[algorithm] = sum(p in seg for p in parts)
    comm.close()
    return {"found": found, "exact": exact}


def task_one_core(args: dict) -> dict:
    """NOTE [sharing a core] (csrc/cpu/executor.cpp): the communicator is made while the ranks may
    run on every core (so it spins before it yields), then every rank moves itself to one core.
    Back-to-back 8 KB calls, each checked; the median time per call and the share under 100 us."""
    comm = nvrar.Communicator(timeout=60)
    W = comm.world_size
    a = np.ones(2048, np.float32)
    comm.all_reduce(a)
    os.sched_setaffinity(0, {args["cpu"]})
    times, exact = [], True
    for i in range(args["calls"]):
        a.fill(float(comm.rank + i))
        t0 = time.perf_counter()
        comm.all_reduce(a)
        times.append(time.perf_counter() - t0)
        exact = exact and bool((a == float(sum(range(W)) + W * i)).all())
    comm.close()
    us = np.array(times) * 1e6
    return {"median_us": float(np.median(us)), "under_100us": float((us < 100).mean()), "exact": exact}


def task_move_apart(args: dict) -> dict:
    """NOTE [moving apart] (csrc/cpu/executor.cpp): ranks made where they may run on 2 CPUs (c0,
    c1; a process the test started spins on c1), then every rank pinned to c0 for `pinned` calls,
    then allowed c0 and c1 again: 2 ranks on c0 and the spinner on c1 look balanced to the
    scheduler. Returns each later call's CPU, the moves the executor made and the final mask."""
    c0, c1 = args["cpus"]
    os.sched_setaffinity(0, {c0, c1})
    comm = nvrar.Communicator(timeout=60)
    W = comm.world_size
    a = np.ones(2048, np.float32)
    comm.all_reduce(a)
    exact = True

    def call(i: int) -> None:
        nonlocal exact
        a.fill(float(comm.rank + i))
        comm.all_reduce(a)
        exact = exact and bool((a == float(sum(range(W)) + W * i)).all())

    os.sched_setaffinity(0, {c0})
    for i in range(args["pinned"]):
        call(i)
    moves_pinned = comm._ex.cpu_moves
    os.sched_setaffinity(0, {c0, c1})
    import ctypes

    getcpu = ctypes.CDLL(None).sched_getcpu
    cpus = []
    for i in range(args["calls"]):
        call(i)
        cpus.append(int(getcpu()))
    out = {"cpus": cpus, "moves_pinned": moves_pinned, "moves": comm._ex.cpu_moves,
           "mask": sorted(os.sched_getaffinity(0)), "exact": exact}
    comm.close()
    return out


TASKS = {"phase_times": task_phase_times, "one_core": task_one_core, "move_apart": task_move_apart, "crowded": task_crowded, "ways": task_ways, "stage_ways": task_stage_ways, "algo_ways": task_algo_ways, "rotation": task_rotation, "close_race": task_close_race, "matrix": task_matrix, "jitter": task_jitter, "fault": task_fault, "badinput": task_badinput,
         "torchgroup": task_torchgroup, "mismatch_bounds": task_mismatch_bounds, "nan": task_nan, "sigint": task_sigint,
         "closed_peer": task_closed_peer, "stop": task_stop}


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


def task_chatty(args: dict) -> dict:
    """The launcher's own test: the last rank writes `bytes` to stdout and to stderr (far more than
    a pipe holds) and then leaves a flag file; rank 0 waits for that flag, as a rank's kernel waits
    for a peer that is still printing its progress. A launcher that drains one rank's output at a
    time never lets the last rank finish writing while it waits for rank 0."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == world - 1:
        line = "x" * 99 + "\n"
        for _ in range(args["bytes"] // len(line)):
            sys.stdout.write(line)
            sys.stderr.write(line)
        sys.stdout.flush()
        sys.stderr.flush()
        open(args["flag"], "w").close()
        return {"wrote": args["bytes"]}
    until = time.monotonic() + args["wait"]
    while not os.path.exists(args["flag"]) and time.monotonic() < until:
        time.sleep(0.01)
    return {"saw_flag": os.path.exists(args["flag"])}


TASKS["chatty"] = task_chatty


def main() -> int:
    task, args, report_path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    if task not in TASKS and task.startswith("seg_"):
        import _seg_tasks

        TASKS.update(_seg_tasks.TASKS)
    elif task not in TASKS and task.startswith("fused_"):
        import _fused_tasks

        TASKS.update(_fused_tasks.TASKS)
    elif task not in TASKS and task.startswith("det_"):
        import _det_tasks

        TASKS.update(_det_tasks.TASKS)
    elif task not in TASKS and task.startswith("hosts_"):
        import _hosts_tasks

        TASKS.update(_hosts_tasks.TASKS)
    elif task not in TASKS and task.startswith("gpusetup"):
        import _gpu_setup_tasks

        TASKS.update(_gpu_setup_tasks.TASKS)
    elif task not in TASKS and task.startswith("engines_"):
        import _engines_tasks

        TASKS.update(_engines_tasks.TASKS)
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
    if "torch" in sys.modules:
        # The exit handlers run (nvrar's closes every communicator still open), then the process
        # leaves without the interpreter's and C++ libraries' teardown: after a torch task, about
        # one run in 12 of test_fused's 2-rank torch.compile task aborted there ("terminate called
        # without an active exception", SIGABRT, rank 1, its report already written). Its core
        # dump: gloo's worker thread (ProcessGroupGloo::runLoop) destroyed the last barrier's
        # AsyncWork while the interpreter finalized; freeing its tensors takes the GIL, CPython
        # exits a thread that asks for the GIL then (take_gil -> pthread_exit), and the forced
        # unwind through the noexcept destructor calls std::terminate. torch's teardown, not nvrar's.
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
