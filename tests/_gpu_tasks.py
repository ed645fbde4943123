"""Rank-side tasks of tests/gpu (run by _worker.py). Every rank uses this host's GPU given by
NVRAR_TEST_GPU (default 0): on a one-GPU machine all ranks share it (NVSHMEM's limited
multi-process-per-GPU mode), and ranks_per_node < world makes the "inter-node" exchanges go
through NVSHMEM puts and signals."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

import nvrar
import _matrix


# How many rounds the tasks make (NVRAR_GPU_TEST_LOAD): "full" by default; scripts/gpu_check.sh
# asks for "reduced" under MPS and "minimal" without it (PEs then time-slice the GPU and every
# hand-off between them may cost a time slice), so that its test step fits its deadline.
LOAD = os.environ.get("NVRAR_GPU_TEST_LOAD", "full")
_LOADS = {"full": {"burst": 200, "replays": 1000, "max_bytes": 1 << 16},
          "reduced": {"burst": 40, "replays": 200, "max_bytes": 1 << 18},
          "minimal": {"burst": 10, "replays": 30, "max_bytes": 1 << 20}}
if LOAD not in _LOADS:
    raise ValueError(f"NVRAR_GPU_TEST_LOAD={LOAD!r}: expected one of {sorted(_LOADS)}")
SCALE = _LOADS[LOAD]

# The device deadline of every GPU task's communicator (NVRAR_GPU_TEST_TIMEOUT, seconds): a kernel
# waiting longer for a peer raises with the error record (phase, step, peer). scripts/gpu_check.sh
# sets it below the launcher's deadline (NVRAR_GPU_LAUNCH_TIMEOUT), itself below pytest-timeout's,
# so that a hang is reported by the kernel first, then by every rank's Python stack.
TEST_TIMEOUT = float(os.environ.get("NVRAR_GPU_TEST_TIMEOUT", "120"))
if not TEST_TIMEOUT > 0:
    raise ValueError(f"NVRAR_GPU_TEST_TIMEOUT={TEST_TIMEOUT!r}: expected seconds > 0")
_T0 = time.monotonic()


def progress(what: str) -> None:
    """A progress line on stderr (the launcher shows its tail when a rank fails or hangs)."""
    print(f"[rank {os.environ.get('RANK', '?')} +{time.monotonic() - _T0:.1f} s] {what}", file=sys.stderr, flush=True)


class Traced:
    """A communicator whose every all_reduce says on stderr that call k was enqueued, then that it
    synchronized (the device is synchronized after each call: the tasks read every result at once
    anyway, so the order of the work is unchanged and a hang is located to its call)."""

    def __init__(self, comm: nvrar.Communicator) -> None:
        self._comm = comm
        self.calls = 0

    def __getattr__(self, name: str):
        return getattr(self._comm, name)

    def all_reduce(self, x, *args, **kwargs):
        self.calls += 1
        k = self.calls
        res = self._comm.all_reduce(x, *args, **kwargs)
        progress(f"call {k} enqueued ({describe_call(x, args, kwargs)})")
        torch.cuda.synchronize()
        progress(f"call {k} synchronized")
        return res


def describe_call(x, args, kwargs) -> str:
    shape = tuple(getattr(x, "shape", ()))
    op = args[0] if args else kwargs.get("op", "sum")
    return f"{getattr(x, 'dtype', type(x).__name__)} {shape} {op} {kwargs.get('algorithm') or 'auto'}"


def _comm(args: dict) -> nvrar.Communicator:
    torch.cuda.set_device(int(os.environ.get("NVRAR_TEST_GPU", "0")))
    t0 = time.monotonic()
    progress(f"init: Communicator(device='cuda', ranks_per_node={args['G']}), NVRAR_NVSHMEM_INIT="
             f"{os.environ.get('NVRAR_NVSHMEM_INIT', 'auto')}, device deadline {args.get('timeout', TEST_TIMEOUT):g} s")
    comm = nvrar.Communicator(device="cuda", ranks_per_node=args["G"], max_bytes=args.get("max_bytes", SCALE["max_bytes"]),
                              timeout=args.get("timeout", TEST_TIMEOUT))
    progress(f"init done in {time.monotonic() - t0:.1f} s (rank {comm.rank} of {comm.world_size})")
    return comm


def task_gpu_smoke(args: dict) -> dict:
    """The first contact (scripts/gpu_check.sh's smoke step): nvrar's own NVSHMEM initialization, then
    one float32 call of each inter-node protocol path, checked exactly: one-shot with LL packets,
    two-shot with LL packets, two-shot with put-with-signal. LL carries an inter-node shard of at most
    NVRAR_LL_MAX_BYTES (32K on the GPU): one-shot exchanges the whole message across nodes, two-shot
    a 1/G share of it, so 4 KB and 16 KB take LL and 1 MB (shards of 512 KB and more) put-with-signal."""
    comm = Traced(_comm(args))
    rank, world = comm.rank, comm.world_size
    calls = [("one-shot LL", 1024, "one-shot"), ("two-shot LL", 4096, "two-shot"),
             ("two-shot put-with-signal", 1 << 18, "two-shot")]
    out: dict = {"failures": [], "calls": []}
    for name, n, algorithm in calls:
        base = torch.arange(n, device="cuda", dtype=torch.float32) % 251
        x = base + rank
        comm.all_reduce(x, "sum", algorithm=algorithm)
        want = base * world + sum(range(world))
        wrong = int((x != want).sum().item())
        out["calls"].append({"name": name, "bytes": n * 4, "wrong": wrong})
        if wrong:
            out["failures"].append(f"rank {rank}: {name}: {wrong} of {n} elements wrong, first "
                                   f"{x[:4].tolist()} want {want[:4].tolist()}")
    comm.check()
    progress("check() passed")
    comm.close()
    progress("closed")
    return out


def task_gpu_matrix(args: dict) -> dict:
    _matrix.DEVICE = "cuda"
    comm = Traced(_comm(args))
    report = _matrix.run_matrix(comm, quick=True)
    report["burst"] = _matrix.run_burst(comm, calls=min(args.get("burst", 200), SCALE["burst"]), seed=args.get("seed", 3), max_count=50000)
    comm.check()
    comm.close()
    return report


def task_gpu_graph(args: dict) -> dict:
    """One all_reduce captured in a CUDA graph, replayed `replays` times on fresh inputs; every
    result checked (the epoch lives on the device, so replays stay in step)."""
    comm = _comm(args)
    rank, world = comm.rank, comm.world_size
    n = args.get("count", 12345)
    x = torch.empty(n, dtype=torch.float32, device="cuda")
    src = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.fill_(1.0)
        comm.all_reduce(x)  # warm-up outside the capture
    progress("call 1 (warm-up) enqueued")
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    progress("call 1 (warm-up) synchronized")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        comm.all_reduce(x)
    progress("call 2 captured")
    wrong = 0
    base = torch.arange(n, device="cuda", dtype=torch.float32) % 13
    replays = min(args.get("replays", 1000), SCALE["replays"])
    for i in range(replays):
        src.copy_(base + (rank + i) % 7)
        x.copy_(src)
        g.replay()
        want = base * world + sum((r + i) % 7 for r in range(world))
        if i % 50 == 0 or i == replays - 1:
            progress(f"replay {i + 1} enqueued")
            torch.cuda.synchronize()
            progress(f"replay {i + 1} synchronized")
        if not torch.equal(x, want):
            wrong += 1
    comm.check()
    comm.close()
    return {"wrong_replays": wrong, "replays": replays}


def task_gpu_timeout(args: dict) -> dict:
    """The last rank never calls: the others' kernels time out, and check() raises."""
    comm = _comm(args)
    x = torch.ones(4096, device="cuda")
    comm.all_reduce(x)
    progress("call 1 enqueued")
    comm.check()
    progress("call 1 synchronized (check passed)")
    if comm.rank == comm.world_size - 1:
        time.sleep(args["timeout"] + 5)
        return {"absent": True}
    t0 = time.monotonic()
    comm.all_reduce(x)
    progress("call 2 enqueued (the last rank never calls: it must time out)")
    try:
        comm.check()
        return {"raised": None}
    except nvrar.NvrarError as exc:
        return {"raised": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - t0,
                "is_timeout": isinstance(exc, nvrar.NvrarTimeoutError), "phase": exc.phase}


def task_gpu_cupy(args: dict) -> dict:
    import cupy

    comm = _comm(args)
    with cupy.cuda.Device(int(os.environ.get("NVRAR_TEST_GPU", "0"))):
        x = cupy.arange(10000, dtype=cupy.float32) + comm.rank
        comm.all_reduce(x)
        want = cupy.arange(10000, dtype=cupy.float32) * comm.world_size + sum(range(comm.world_size))
        ok = bool(cupy.all(x == want))
        y = comm.empty(1000, "float32")  # a numpy dtype on a GPU communicator: a cupy array
        y[...] = comm.rank
        comm.all_reduce(y, "max")
        ok_empty = bool(cupy.all(y == comm.world_size - 1))
    comm.check()
    comm.close()
    return {"ok": ok, "ok_empty": ok_empty}


def task_gpu_fused(args: dict) -> dict:
    """all_reduce_add_rms_norm on CUDA tensors against the unfused reference (the GPU all_reduce,
    then nvrar._fused.reference in fp32 on the host): residual bitwise, x within 1 ulp; one-shot and
    two-shot bitwise equal; a digest of every output for the cross-rank comparison. Bad inputs
    (numpy arrays, CPU tensors) raise before any communication."""
    import hashlib

    import numpy as np

    from _fused_tasks import ALGORITHMS, DTYPES, check_case, inputs

    comm = _comm(args)
    dev = torch.device("cuda", torch.cuda.current_device())
    raised = {}
    x, r, w = inputs(comm.rank, 2, 8, torch.float32, 1)
    for name, fn in {"numpy": lambda: comm.all_reduce_add_rms_norm(x.numpy(), r.numpy(), w.numpy()),
                     "cpu": lambda: comm.all_reduce_add_rms_norm(x, r, w),
                     "mixed": lambda: comm.all_reduce_add_rms_norm(x.to(dev), r, w.to(dev))}.items():
        try:
            fn()
            raised[name] = None
        except (TypeError, ValueError) as exc:
            raised[name] = f"{type(exc).__name__}: {exc}"
    failures, checked, worst = [], 0, 0
    digest = hashlib.sha256()
    case = 0
    # The minimal load (PEs time-slicing the GPU) keeps the smallest and the largest sizes.
    all_rows, hs = args["rows"], args["hs"]
    if LOAD == "minimal":
        all_rows, hs = [all_rows[0], all_rows[-1]], [hs[0], hs[-1]]
    for dname in args["dtypes"]:
        dtype = DTYPES[dname]
        for rows in all_rows:
            for h in hs:
                case += 1
                x0, res0, w = inputs(comm.rank, rows, h, dtype, case)
                x0, res0, w = x0.to(dev), res0.to(dev), w.to(dev)
                eps = 1e-6 if case % 2 else 1e-5
                outs, bad, ulp = check_case(comm, x0, res0, w, eps, f"{dname} rows={rows} h={h}",
                                            to_host=lambda t: t.cpu(), sync=torch.cuda.synchronize)
                failures += bad
                worst = max(worst, ulp)
                checked += len(ALGORITHMS)
                for algo in ALGORITHMS:
                    for t in outs[algo]:
                        digest.update(np.ascontiguousarray(t.contiguous().view(torch.uint8).numpy()).tobytes())
    comm.check()
    comm.close()
    return {"raised": raised, "failures": failures, "checked": checked, "cases": case, "worst_ulp": worst,
            "digest": digest.hexdigest()}


# -- nvshmem4py (tests/test_nvshmem4py.py without a GPU, tests/gpu/test_nvshmem4py.py with one) ----------

def task_gpu_n4p_no_gpu(args: dict) -> dict:
    """A host without a GPU, nvshmem4py imported first: Communicator(device="cuda") must raise
    NvrarError on every rank without initializing NVSHMEM, and the process goes on."""
    import nvshmem.core as core

    from nvrar import _gpu

    out: dict = {"raised": None, "message": ""}
    try:
        nvrar.Communicator(device="cuda", timeout=30)
    except Exception as exc:  # noqa: BLE001 - the test checks the type
        out.update(raised=type(exc).__name__, message=str(exc))
    _gpu.nvshmem4py_library(core)  # nvshmem4py's bindings need its host library loaded (cuda.pathfinder)
    out["status_after"] = int(core.init_status())
    out["n4p_initialized"] = _gpu.nvshmem4py_initialized(core)
    with nvrar.Communicator(timeout=30) as comm:
        x = np.full(8, comm.rank + 1.0, np.float32)
        comm.all_reduce(x)
        out["cpu_sum"] = float(x[0])
    return out


def _n4p_uid_init(core, rank: int, world: int) -> None:
    """The user's side: nvshmem4py initialized with a unique id exchanged over torch.distributed
    (gloo), the way an application built on nvshmem4py does it, before any nvrar call."""
    import ctypes

    import torch.distributed as dist
    from cuda.core import Device

    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    uid = core.get_unique_id() if rank == 0 else core.get_unique_id(empty=True)
    box = [ctypes.string_at(uid.ptr, uid._data.nbytes) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    ctypes.memmove(uid.ptr, box[0], len(box[0]))
    dev = Device(torch.cuda.current_device())
    dev.set_current()
    core.init(device=dev, uid=uid, rank=rank, nranks=world, initializer_method="uid")


def _n4p_checks(comm: nvrar.Communicator, core, tensors: dict) -> dict:
    """all_reduce on each named tensor (nvshmem4py tensors, comm.empty(), ordinary torch memory;
    the kinds may differ per rank), each checked exactly, plus what nvrar says of its zero-copy."""
    rank, world = comm.rank, comm.world_size
    expect = float(sum(range(1, world + 1)))
    out: dict = {"failures": [], "symmetric": {}, "below_segment": {}}
    for name, t in tensors.items():
        t.fill_(rank + 1.0)
        out["symmetric"][name] = bool(comm._ex.symmetric(t.data_ptr(), t.numel() * t.element_size()))
        out["below_segment"][name] = t.data_ptr() < comm._ex.pool_address
        for algorithm in ("one-shot", "two-shot"):
            t.fill_(rank + 1.0)
            comm.all_reduce(t, algorithm=algorithm)
            torch.cuda.synchronize()
            got = t.float().cpu()
            if not bool((got == expect).all()):
                out["failures"].append(f"{name} {algorithm}: {got[:4].tolist()} != {expect}")
    comm.check()
    return out


def _n4p_calls_work(core, rank: int, world: int, n: int = 1024) -> dict:
    """nvshmem4py calls after nvrar's: a tensor, a put to the next PE on the stream, barrier_all
    (allowed in every multi-process-per-GPU mode), and the reduce where NVSHMEM allows collectives."""
    t = core.tensor((n,), dtype=torch.float32)
    src = core.tensor((n,), dtype=torch.float32)
    stream = core.NvshmemStream(torch.cuda.current_stream())
    src.fill_(float(rank))
    t.fill_(-1.0)
    core.barrier_all(stream=stream)
    core.put(t, src, remote_pe=(rank + 1) % world, stream=stream)
    core.barrier_all(stream=stream)
    torch.cuda.synchronize()
    got = float(t[0].item())
    out = {"put_ok": got == float((rank - 1) % world), "put_got": got, "reduce_ok": None}
    if int(core.init_status()) != 3:  # NVSHMEM_STATUS_LIMITED_MPG forbids collectives
        src.fill_(1.0)
        core.reduce(core.Teams.TEAM_WORLD, t, src, "sum", stream=stream)
        torch.cuda.synchronize()
        out["reduce_ok"] = bool((t == float(world)).all())
    core.free_tensor(t)
    core.free_tensor(src)
    return out


def task_gpu_n4p_join(args: dict) -> dict:
    """nvshmem4py first (the user's init), then nvrar joins it: checks, one more reference; then
    zero-copy on nvshmem4py tensors allocated before (below nvrar's segment) and after it, mixed
    kinds per rank; the user's nvshmem4py calls work; close() leaves the user's NVSHMEM up."""
    import nvshmem.core as core

    torch.cuda.set_device(int(os.environ.get("NVRAR_TEST_GPU", "0")))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _n4p_uid_init(core, rank, world)
    n = args.get("count", 40000)
    before = core.tensor((n,), dtype=torch.float32)  # allocated before nvrar's segment
    comm = nvrar.Communicator(device="cuda", ranks_per_node=args["G"], timeout=TEST_TIMEOUT)
    progress("init done (joined nvshmem4py's NVSHMEM)")
    after = core.tensor((n,), dtype=torch.float32)
    tensors = {"n4p_before": before, "n4p_after": after, "empty": comm.empty(n, torch.float32),
               "ordinary": torch.empty(n, device="cuda"),
               # buffer kinds differ per rank: even ranks reduce an nvshmem4py tensor, odd ones torch memory
               "mixed": after if rank % 2 == 0 else torch.empty(n, device="cuda")}
    out = _n4p_checks(comm, core, tensors)
    out["calls"] = _n4p_calls_work(core, rank, world)
    comm.close()
    out["status_after_close"] = int(core.init_status())
    out["calls_after_close"] = _n4p_calls_work(core, rank, world)
    core.free_tensor(before)
    core.free_tensor(after)
    core.finalize()
    return out


def task_gpu_n4p_init(args: dict) -> dict:
    """nvrar first: with nvshmem4py installed, nvrar initializes NVSHMEM through it, so that the
    user's nvshmem4py calls work afterwards; a second communicator joins; the last close()
    finalizes nvshmem4py's initialization too."""
    import nvshmem.core as core

    from nvrar import _gpu

    comm = _comm(args)
    rank, world = comm.rank, comm.world_size
    out: dict = {"n4p_initialized": _gpu.nvshmem4py_initialized(core), "status": int(core.init_status())}
    n = args.get("count", 40000)
    t = core.tensor((n,), dtype=torch.float32)  # refused ("not initialized") before this change
    second = _comm(args)
    out.update(_n4p_checks(second, core, {"n4p": t, "empty_of_first": comm.empty(n, torch.float32),
                                          "ordinary": torch.empty(n, device="cuda")}))  # staged, not zero-copy
    out["calls"] = _n4p_calls_work(core, rank, world)
    core.free_tensor(t)
    second.close()
    out["status_after_first_close"] = int(core.init_status())
    comm.close()
    out["status_after_last_close"] = int(core.init_status())
    out["n4p_initialized_after"] = _gpu.nvshmem4py_initialized(core)
    return out


TASKS = {"gpu_smoke": task_gpu_smoke, "gpu_matrix": task_gpu_matrix, "gpu_graph": task_gpu_graph, "gpu_timeout": task_gpu_timeout,
         "gpu_cupy": task_gpu_cupy, "gpu_fused": task_gpu_fused, "gpu_n4p_no_gpu": task_gpu_n4p_no_gpu,
         "gpu_n4p_join": task_gpu_n4p_join, "gpu_n4p_init": task_gpu_n4p_init}
