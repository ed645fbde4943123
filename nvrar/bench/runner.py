"""One rank of the benchmark: set up the backends, sweep the sizes, time, verify, report."""

from __future__ import annotations

import datetime
import os
import platform
import socket
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .. import __version__
from ..bootstrap import SingleBootstrap, mpi_launched, preload_ucx_across_hosts
from ..communicator import Communicator
from . import report
from .fused import FUSED_ALGO, NvrarFusedBackend
from .mpilibs import PEERS
from .backends import (DTYPES, Backend, DeepSpeedBackend, GlooBackend, MPIBackend, NCCLBackend, NvrarBackend, NvshmemBackend,
                       available_cpu_model, cpu_count, gpu_model)

__all__ = ["run_rank", "sizes_between"]


def sizes_between(lo: int, hi: int) -> List[int]:
    if lo <= 0:
        raise ValueError(f"the smallest size must be positive, got {lo}")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 2
    return out


def contribution(rank: int, count: int) -> np.ndarray:
    i = np.arange(count, dtype=np.int64)
    return ((i * 7 + rank * 3) % 11 - 5).astype(np.float64)


def expected(world: int, count: int, op: str, dtype: str) -> np.ndarray:
    xs = np.stack([contribution(r, count) for r in range(world)])
    if op == "sum":
        v = xs.sum(axis=0)
    elif op == "max":
        v = xs.max(axis=0)
    elif op == "min":
        v = xs.min(axis=0)
    else:
        s = xs.sum(axis=0)
        v = np.trunc(s / world) if dtype == "int32" else (s.astype(np.float32) * (np.float32(1) / np.float32(world)))
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(np.asarray(v, np.float32)).to(torch.bfloat16).float().numpy().astype(np.float64)
    return np.asarray(v).astype(DTYPES[dtype][0]).astype(np.float64)


class Control:
    """The benchmark's own coordination (barrier, per-iteration max, #wrong verdicts, gathers),
    never nvrar grading itself: MPI.COMM_WORLD where the ranks run under mpirun (mpi4py), else
    the gloo group of torch.distributed whenever it is initialized, else a separate nvrar CPU
    communicator (a run without torch or MPI).

    Not gloo where MPI is there: with gloo as the control channel, every rank's gloo tcp loop
    thread was measured busy (17-21% of a core, in epoll_wait returning at once) while the other
    backends were timed, likely on a peer's early message for a collective this rank had not
    reached yet, and every backend timed beside gloo slowed down (4 ranks on 2 cores: nvrar's
    back-to-back 4 KB call 103 -> 497 us, MPI's 79 -> 163 us; docs/results.md)."""

    def __init__(self, comm: Optional[Communicator], timeout: float) -> None:
        self.comm = comm
        self.timeout = timeout  # every MPI wait of the channel (gloo's: its group's; nvrar's: its own)
        self.mpi = _mpi_world()
        self.kind = "mpi" if self.mpi is not None else ("gloo" if comm is None else "nvrar")
        spin = self._spin_barrier() if self.mpi is not None else None
        # before every cold-timed call: the spin barrier where it serves, else the channel's own
        self.timed_barrier = spin.wait if spin is not None else self.barrier

    def _spin_barrier(self) -> Any:
        """nvrar/bench/spin_barrier.py, the same barrier before the timed calls in every MPI
        library's job (each MPI_Barrier would leave its own exit skew inside the timed calls):
        where the ranks share one host, no more of them than its CPUs. Rank 0 makes the file
        with a random word in it, every rank maps it and checks that it sees the word (ranks of
        other hosts with the same host name would not), and rank 0 unlinks it at once."""
        import tempfile

        from . import spin_barrier

        world = self.mpi
        self.barrier()  # every rank is there (within the deadline): the blocking gathers cannot wait long
        placed = world.allgather((socket.gethostname(), spin_barrier.my_cpus()))
        if not spin_barrier.usable(len({h for h, _ in placed}), [c for _, c in placed]):
            return None
        made = None
        if world.Get_rank() == 0:
            fd, path = tempfile.mkstemp(prefix="nvrar-bench-barrier-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            word = int.from_bytes(os.urandom(7), "little") + 1
            os.ftruncate(fd, spin_barrier.LINE * world.Get_size())
            os.pwrite(fd, word.to_bytes(8, "little"), 8)  # rank 0's CPU cell, until its first wait
            os.close(fd)
            made = (path, word)
        path, word = world.bcast(made, root=0)
        sb = None
        try:
            sb = spin_barrier.SpinBarrier(path, world.Get_rank(), world.Get_size(), self.timeout, create=False)
            seen = sb.cells[1] == word
        except OSError:
            seen = False
        self.barrier()  # every rank has mapped it (or failed to)
        if world.Get_rank() == 0:
            os.unlink(path)
        if not all(world.allgather(seen)):
            if sb is not None:
                sb.close()
            return None
        return sb

    def _finish(self, req: Any, what: str) -> None:
        """Polls an MPI request to completion within the deadline: a rank that never arrives
        ends this one with an error (and mpirun then the job), not a hang."""
        deadline = time.monotonic() + self.timeout
        polls = 0
        while not req.Test():
            polls += 1
            if polls % 1024 == 0 and time.monotonic() > deadline:
                raise SystemExit(f"nvrar-bench: rank {self.mpi.Get_rank()}: the benchmark's own {what} (MPI) waited "
                                 f"{self.timeout:.0f} s (--timeout) for the other ranks")

    def barrier(self) -> None:
        """The channel's barrier; also the one before each cold-timed call where the spin barrier
        does not serve (timed_barrier: ranks on several hosts, or more ranks than CPUs)."""
        if self.mpi is not None:
            self._finish(self.mpi.Ibarrier(), "barrier")
        elif self.comm is None:
            import torch.distributed as dist

            dist.barrier()
        else:
            self.comm.all_reduce(np.zeros(1, np.int32))

    def max(self, values: np.ndarray) -> np.ndarray:
        if self.mpi is not None:
            from mpi4py import MPI

            mine = np.ascontiguousarray(values)
            out = np.empty_like(mine)
            self._finish(self.mpi.Iallreduce(mine, out, op=MPI.MAX), "maximum")
            return out
        if self.comm is None:
            import torch
            import torch.distributed as dist

            t = torch.from_numpy(np.ascontiguousarray(values))
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.numpy()
        return self.comm.all_reduce(values, "max")

    def gather(self, value: Any) -> List[Any]:
        if self.mpi is not None:
            self.barrier()  # every rank is there (within the deadline): the gather cannot wait long
            return list(self.mpi.allgather(value))
        import torch.distributed as dist

        out: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out


def _mpi_world() -> Any:
    if not mpi_launched():
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD


def memcpy_gbps() -> float:
    n = 16 << 20
    src = np.ones(n, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return n / float(np.median(times)) / 1e9


def call_overhead_us() -> float:
    with Communicator(group=SingleBootstrap()) as c:
        x = np.zeros(2, np.float32)
        for _ in range(2000):
            c.all_reduce(x)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(20000):
                c.all_reduce(x)
            best = min(best, (time.perf_counter() - t0) / 20000)
    return best * 1e6


def versions(backends: List[Backend]) -> Dict[str, str]:
    v = {"nvrar": __version__, "python": platform.python_version(), "numpy": np.__version__}
    torch = sys.modules.get("torch")
    if torch is not None:
        v["torch"] = torch.__version__
    for b in backends:
        if isinstance(b, MPIBackend) and b.skip_reason is None:
            v[b.name] = b.version
    return v


def setup_torch_dist(device: str, want: bool) -> Optional[str]:
    """Initialize torch.distributed for the gloo/NCCL peers; returns a skip reason or None."""
    if not want:
        return "not requested"
    try:
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed (pip install torch)"
    if not dist.is_available():
        return "this torch build has no torch.distributed"
    if dist.is_initialized():
        return None
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        init = "env://"
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    elif mpi_launched():
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, world = comm.rank, comm.size
        addr = None
        if rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            # rank 0's address for the others: MASTER_ADDR where the user set it (mpirun -x
            # MASTER_ADDR=...), else its host name's; a failure travels to every rank (none waits)
            host = os.environ.get("MASTER_ADDR", "").strip() or (socket.gethostname() if world > 1 else "127.0.0.1")
            try:
                addr = f"tcp://{socket.gethostbyname(host)}:{port}"
            except OSError as exc:
                addr = (f"error: rank 0's host name {host!r} does not resolve ({exc}); set MASTER_ADDR to rank 0's "
                        "address (mpirun -x MASTER_ADDR=...)")
        init = comm.bcast(addr, root=0)
        if init.startswith("error: "):
            return f"torch.distributed: {init[7:]}"
    else:
        return "no launcher environment for torch.distributed"
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    return None


def time_calls(b: Backend, buf: Any, op: str, iters: int, device: str, graph: bool = False,
               barrier: Optional[Any] = None) -> np.ndarray:
    """Per-iteration latency (us) on this rank. GPU: CUDA events around each call (or around each
    replay of a CUDA graph holding one call). ``barrier`` (cold timing): called before every
    timed call, outside the timed span."""
    out = np.empty(iters, np.float32)
    if device == "cuda" and b.name in ("nccl", "nvshmem", "nvrar"):
        import torch

        run = lambda: b.call(buf, op)  # noqa: E731
        if graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                b.call(buf, op)  # warm-up outside the capture, as torch requires
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                b.call(buf, op)
            run = g.replay
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for i in range(iters):
            if barrier is not None:
                torch.cuda.synchronize()
                barrier()
            events[i][0].record()
            run()
            events[i][1].record()
        torch.cuda.synchronize()
        for i, (s, e) in enumerate(events):
            out[i] = s.elapsed_time(e) * 1e3
        return out
    clock = time.perf_counter_ns
    if barrier is not None:
        for i in range(iters):
            barrier()
            t0 = clock()
            b.call(buf, op)
            out[i] = (clock() - t0) / 1e3
        return out
    for i in range(iters):
        t0 = clock()
        b.call(buf, op)
        out[i] = (clock() - t0) / 1e3
    return out


def verify(b: Backend, buf: Any, ctl: Control, count: int, args: Any, world: int, rank: int) -> int:
    """# of elements that differ from the exact result after one call on exact data, worst rank."""
    b.fill(buf, contribution(rank, count))
    b.call(buf, args.op)
    b.synchronize()
    wrong = int(np.count_nonzero(b.read(buf) != expected(world, count, args.op, args.dtype)))
    return int(ctl.max(np.array([wrong], np.int32))[0])


def measure_size(backends: List[Backend], ctl: Control, size: int, args: Any, world: int,
                 rank: int) -> List[Dict[str, Any]]:
    """Verify, then time every backend at one size. The iterations are split into rounds that
    visit the backends in turn, so that a passing disturbance of the machine hits them alike."""
    esize = DTYPES[args.dtype][2]
    count = size // esize
    size = count * esize  # what actually moves (a size that is not a whole number of elements rounds down)
    bufs: List[Tuple[Backend, Any, int, List[Any]]] = []  # (backend, buffer, #wrong, times per round)
    for b in backends:
        buf = b.alloc(count, args.dtype)
        wrong = verify(b, buf, ctl, count, args, world, rank)
        b.fill(buf, np.zeros(count))  # timing on zeros: no denormals, no overflow to inf
        bufs.append((b, buf, wrong, []))
    timings = ["cold", "warm"] if args.timing == "both" else [args.timing]
    rounds = max(1, min(args.rounds, args.iters))
    times: Dict[Tuple[int, str], List[Any]] = {}
    for r in range(rounds):
        n = args.iters // rounds + (1 if r < args.iters % rounds else 0)
        for i, (b, buf, _, _t) in enumerate(bufs):
            for _ in range(args.warmup if r == 0 else min(args.warmup, 2)):
                b.call(buf, args.op)
            for timing in timings:
                b.synchronize()
                ctl.barrier()
                barrier = ctl.timed_barrier if timing == "cold" else None
                times.setdefault((i, timing), []).append(
                    ctl.max(time_calls(b, buf, args.op, n, args.device, args.cuda_graph, barrier)))
    rows = []
    for (i, timing), ts in times.items():
        b, _buf, wrong, _t = bufs[i]
        t = np.concatenate(ts)
        median = float(np.median(t))
        algbw = size / median / 1e3 if median > 0 else 0.0
        rows.append({
            "backend": b.name,
            "algorithm": b.algorithm,
            "buffers": b.buffers,
            "label": b.label if len(timings) == 1 else f"{b.label} ({timing})",
            "timing": timing,
            "bytes": size,
            "count": count,
            "dtype": args.dtype,
            "op": args.op,
            "median_us": median,
            "p99_us": float(np.percentile(t, 99)),
            "min_us": float(np.min(t)),
            "algbw_gbps": algbw,
            "busbw_gbps": algbw * 2 * (world - 1) / world if world > 1 else algbw,
            "wrong": wrong,
        })
        if isinstance(b, MPIBackend):  # which MPI library: several can be in one table (nvrar.bench.launch)
            rows[-1]["library_version"] = b.library_version
    del bufs
    return rows


def run_rank(args: Any, launcher: str, collect: bool = False) -> Any:
    """Run the sweep as one rank. Returns the exit code, or with ``collect`` the result rows on
    rank 0 (each with ``_world`` and ``_ranks_per_node``) and None on the other ranks."""
    names = [s.strip() for s in args.backends.split(",") if s.strip()]
    gpu = args.device == "cuda"
    shared_gpu = False
    if gpu:
        # The GPU run needs torch: CUDA tensors, the NCCL peer and (across hosts) the control channel.
        import torch

        local = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID",
                    os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))))
        torch.cuda.set_device(local % max(1, torch.cuda.device_count()))
    if mpi_launched():  # before setup_torch_dist imports mpi4py
        preload_ucx_across_hosts()
    want_torch = gpu or (("gloo" in names or "deepspeed" in names) and not gpu)
    torch_skip = setup_torch_dist(args.device, want_torch)
    if gpu and torch_skip:
        raise SystemExit(f"nvrar-bench --device cuda needs torch.distributed: {torch_skip}")
    # every symmetric buffer of one size at once: nvrar's symmetric rows, the NVSHMEM peer's two
    n_sym = ("symmetric" in args.buffers) * len([a for a in args.algorithms.split(",") if a.strip()])
    n_sym += 2 if (gpu and "nvshmem" in names) else 0
    heap = max(32 << 20, n_sym * (args.max_bytes + 4096) + (1 << 20))
    ctl_comm = None if (torch_skip is None or _mpi_world() is not None) else Communicator(
        ranks_per_node=args.ranks_per_node, timeout=args.timeout, heap_bytes=1 << 16)
    comm = Communicator(ranks_per_node=args.ranks_per_node, timeout=args.timeout, heap_bytes=heap, device=args.device)
    ctl = Control(ctl_comm, args.timeout)
    rank, world = comm.rank, comm.world_size
    job_json = getattr(args, "job_json", None)
    if job_json and rank == 0:  # one job of a bare start: it waits for this before its deadline
        with open(job_json + ".ready", "w"):
            pass
    out = sys.stdout if rank == 0 else None
    if gpu:
        import torch

        places = ctl.gather((socket.gethostname(), torch.cuda.current_device()))
        shared_gpu = len(set(places)) < len(places)

    backends: List[Backend] = []
    skipped: Dict[str, str] = {}
    if "nvrar" in names:
        algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
        modes = [m.strip() for m in args.buffers.split(",") if m.strip()]
        backends += [NvrarBackend(comm, a, mode == "symmetric") for mode in modes for a in algorithms if a != FUSED_ALGO]
        if FUSED_ALGO in algorithms:
            backends.append(NvrarFusedBackend(comm))
    if "mpi" in names:
        mpi_name = getattr(args, "mpi_name", "mpi")
        backends.append(MPIBackend(mpi_name) if args.device == "cpu" else _skip(mpi_name, "CPU peer; GPU runs compare NCCL"))
    for peer in PEERS:
        if peer in names:  # a bare start runs these as jobs of their own (nvrar.bench.launch)
            backends.append(_skip(peer, f"measured only by a bare start of nvrar-bench, which runs it as a job of its "
                                        f"own under {PEERS[peer].title}'s mpiexec (one process loads one MPI library); "
                                        f"these ranks were started by {launcher}"))
    if "gloo" in names:
        backends.append(GlooBackend(None, torch_skip) if args.device == "cpu" else _skip("gloo", "CPU peer"))
    if "deepspeed" in names:
        backends.append(DeepSpeedBackend(torch_skip) if args.device == "cpu" else _skip("deepspeed", "CPU peer"))
    if "nccl" in names:
        if not gpu:
            backends.append(_skip("nccl", "needs a GPU (--device cuda)"))
        elif shared_gpu:
            backends.append(_skip("nccl", "several ranks share a GPU, which NCCL does not allow"))
        else:
            backends.append(NCCLBackend(None, torch_skip))
    if "nvshmem" in names:
        backends.append(NvshmemBackend(args.device, comm if gpu else None, shared_gpu))
    for b in backends:
        if b.skip_reason:
            skipped[b.name] = b.skip_reason
    active = [b for b in backends if not b.skip_reason]

    meta: Dict[str, Any] = {
        "nvrar_version": __version__,
        "world_size": world,
        "ranks_per_node": comm.ranks_per_node,
        "num_nodes": comm.num_nodes,
        "device": args.device,
        "hardware": (f"{gpu_model()} ({'GPUs shared by several ranks' if shared_gpu else 'one GPU per rank'})"
                     if gpu else f"{available_cpu_model()} ({cpu_count()} cores)"),
        "dtype": args.dtype,
        "op": args.op,
        "iters": args.iters,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "timing": args.timing,
        "cuda_graph": bool(args.cuda_graph),
        "launcher": launcher,
        "bootstrap": comm.bootstrap,
        "buffers": args.buffers,
        "host": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["nvrar-bench"] + [a for a in args.argv if a != "--launched-by" and a != args.launched_by]),
        "skipped": skipped,
        "control": ctl.kind,  # the benchmark's own barriers, maxima and verdicts (Control)
    }
    links = getattr(comm._ex, "link_transports", None) if not gpu else None
    if links is not None and torch_skip is None:  # across hosts: the UCX transports of every rank's links
        mine = sorted({links(r) for r in range(world)} - {""})
        meta["inter_host_transports"] = sorted({t for ts in ctl.gather(mine) for t in ts})
    ctl.barrier()
    meta["memcpy_gbps"] = memcpy_gbps() if rank == 0 else 0.0  # the host's; GPU runs compare peers only
    meta["call_overhead_us"] = call_overhead_us() if rank == 0 else 0.0
    ctl.barrier()
    meta["versions"] = versions(backends)
    if out:
        report.print_lines(report.header_lines(meta) + report.table_header(), out)

    results: List[Dict[str, Any]] = []
    esize = DTYPES[args.dtype][2]
    sizes = [s for s in sizes_between(args.min_bytes, args.max_bytes) if s >= esize]
    runnable = []
    for b in active:
        reason = b.supports(args.dtype, args.op)
        if reason:
            skipped.setdefault(b.label, reason)
        else:
            runnable.append(b)
    for size in sizes:
        rows = measure_size(runnable, ctl, size, args, world, rank)
        results += rows
        if out:
            for timing in ("cold", "warm"):  # speed-ups compare rows of one timing
                report.print_lines(report.format_rows([r for r in rows if r["timing"] == timing]), out)
            print(f"[nvrar-bench] {report.fmt_size(size)} done", file=sys.stderr, flush=True)
    if out:
        wrong = sum(r["wrong"] for r in results)
        print(f"# total #wrong: {wrong}", file=out)
        if job_json:  # the bare start merges the jobs' results, writes --json and --plot
            report.write_json(job_json, meta, results)
        elif args.json:
            report.write_json(args.json, meta, results)
            print(f"# wrote {args.json}", file=out)
        if args.plot and not job_json:
            report.write_plot(args.plot, meta, results)
            print(f"# wrote {args.plot}", file=out)
        out.flush()
    ctl.barrier()
    for b in active:
        b.close()
    comm.close()
    if ctl_comm is not None:
        ctl_comm.close()
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None and torch_mod.distributed.is_available() and torch_mod.distributed.is_initialized():
        torch_mod.distributed.destroy_process_group()
    if collect:
        return [dict(r, _world=world, _ranks_per_node=meta["ranks_per_node"]) for r in results] if rank == 0 else None
    return 1 if any(r["wrong"] for r in results) else 0


def _skip(name: str, reason: str) -> Backend:
    b = Backend()
    b.name = name
    b.skip_reason = reason
    return b
