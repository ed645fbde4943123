"""nvrar-bench: an nccl-tests-style all-reduce latency sweep of nvrar against its peers.

    nvrar-bench                         # 2 local ranks on the CPU, 8 KB .. 16 MB
    nvrar-bench --ranks 4 --ranks-per-node 2 --json out.json --plot out.png
    mpirun -n 8 nvrar-bench             # or srun / torchrun: uses those ranks

Started bare, it launches ``--ranks`` local ranks itself (through mpirun when mpirun and mpi4py
are installed, so that the MPI_Allreduce peer can run; else as plain processes). Under a launcher
it is one of the ranks. Every measured configuration is verified on exact data (#wrong).

    nvrar-bench --backends nvrar,mpi,mpich,impi    # MPI_Allreduce of Open MPI, MPICH, Intel MPI

mpich and impi (the ``mpich`` and ``impi-rt`` wheels; NVRAR_MPICH_PREFIX / NVRAR_IMPI_PREFIX name
a pip --prefix directory) run only from a bare start: one job per MPI library, each under its own
mpiexec, one after the other, their rows merged into one table.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, List, Optional, Sequence

from ..env import parse_bytes

__all__ = ["main", "register", "build_parser"]


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_ALGORITHMS = "auto,one-shot,two-shot"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=None,
                   help="ranks to launch when started bare (default: 2 on CPU, one per visible GPU)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per (emulated) node; less than the world size runs the inter-node path")
    p.add_argument("--min-bytes", type=_size, default=8 << 10, help="smallest message (default 8K)")
    p.add_argument("--max-bytes", type=_size, default=16 << 20, help="largest message (default 16M)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "int32"], default="float32")
    p.add_argument("--op", choices=["sum", "max", "min", "avg"], default="sum")
    p.add_argument("--iters", type=int, default=100, help="timed iterations per size and backend (default 100)")
    p.add_argument("--warmup", type=int, default=10, help="untimed iterations first (default 10)")
    p.add_argument("--rounds", type=int, default=4,
                   help="the iterations are split into this many rounds over the backends (default 4)")
    p.add_argument("--backends", default="nvrar,mpi,gloo,nccl,nvshmem",
                   help="comma list of nvrar, mpi, gloo, deepspeed (CPU peers; deepspeed: its shm "
                        "inference_all_reduce, where DeepSpeed is installed), mpich, impi (MPI_Allreduce of "
                        "MPICH and Intel MPI: a bare start runs each as a job of its own under that library's "
                        "mpiexec, where its wheel is installed), nccl, nvshmem (GPU peers)")
    p.add_argument("--timing", choices=["cold", "warm", "both"], default="both",
                   help="cold: a barrier before every timed call (how tensor-parallel decode calls arrive); "
                        "warm: back-to-back calls (as nccl-tests time); both (default): every row twice")
    p.add_argument("--algorithms", default=None,
                   help=f"nvrar algorithms to measure, comma list (default {_ALGORITHMS}); add-rms-norm adds the fused "
                        "all-reduce + residual add + RMSNorm")
    p.add_argument("--algos", default=None, help=argparse.SUPPRESS)  # deprecated spelling of --algorithms
    p.add_argument("--buffers", default="ordinary,symmetric",
                   help="nvrar buffers, comma list: ordinary arrays, and/or symmetric ones from "
                        "Communicator.empty() (zero-copy); default both")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the buffers live (default cpu)")
    p.add_argument("--cuda-graph", action="store_true", help="GPU: time replays of a CUDA graph holding one call")
    p.add_argument("--launcher", choices=["auto", "mpirun", "local"], default="auto",
                   help="how a bare start launches its ranks (default: mpirun if available)")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline of every wait, seconds (default 120)")
    p.add_argument("--json", metavar="PATH", help="write results as JSON")
    p.add_argument("--launched-by", default=None, help=argparse.SUPPRESS)  # set by a bare start for its ranks
    # set by a bare start that runs several jobs (nvrar.bench.launch): the name the mpi backend's
    # rows take (mpich, impi), and where the job writes its JSON (the bare start merges them)
    p.add_argument("--mpi-name", default="mpi", help=argparse.SUPPRESS)
    p.add_argument("--job-json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")


def build_parser(prog: str = "nvrar-bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.algos is not None:
        if args.algorithms is not None and args.algorithms != args.algos:
            p.error(f"--algorithms {args.algorithms} and its deprecated spelling --algos {args.algos} disagree")
        if args.launched_by is None:  # once, not from every launched rank
            print(f"{p.prog}: note: --algos is deprecated; use --algorithms", file=sys.stderr)
        args.algorithms = args.algos
    if args.algorithms is None:
        args.algorithms = _ALGORITHMS
    if args.min_bytes <= 0 or args.max_bytes < args.min_bytes:
        p.error(f"need 0 < --min-bytes <= --max-bytes (got {args.min_bytes}, {args.max_bytes})")
    if args.iters < 1 or args.warmup < 0 or args.rounds < 1:
        p.error("--iters and --rounds must be >= 1 and --warmup >= 0")
    if args.ranks is not None and args.ranks < 1:
        p.error("--ranks must be >= 1")
    modes = [m.strip() for m in args.buffers.split(",") if m.strip()]
    if not modes or any(m not in ("ordinary", "symmetric") for m in modes):
        p.error(f"--buffers takes ordinary and/or symmetric, got {args.buffers!r}")
    if args.cuda_graph and args.device != "cuda":
        p.error("--cuda-graph needs --device cuda")
    if args.device == "cuda":
        from .. import build_info

        info = build_info()
        if not info["cuda"] or not info["gpus"]:
            p.error(f"--device cuda: {info['cuda_error']}")
        try:
            import torch
        except ImportError:
            p.error("--device cuda needs torch (CUDA tensors, the NCCL peer)")
        if not torch.cuda.is_available():
            p.error("--device cuda: this torch build sees no CUDA device (a CPU-only torch?)")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib (pip install matplotlib, or nvrar[bench])")


def run(args: argparse.Namespace, argv: Sequence[str], module: str = "nvrar.bench",
        rank_fn: Optional[Callable[[argparse.Namespace, str], int]] = None) -> int:
    """Run as one rank under a launcher (``rank_fn``, default the benchmark's run_rank), or
    launch the ranks (running ``module``'s main). nvrar.bench.tune passes its own rank_fn, so
    that this package never imports it back (no import cycle)."""
    from ..bootstrap import mpi_launched
    from .launch import spawn

    args.argv = list(argv)
    launcher = None
    if mpi_launched():
        launcher = args.launched_by or "mpirun/srun"
    elif os.environ.get("WORLD_SIZE") and os.environ.get("RANK"):
        launcher = args.launched_by or "torchrun-style env"
    if launcher is None:
        return spawn(args, argv, module)
    if rank_fn is not None:
        return rank_fn(args, launcher)
    from .runner import run_rank

    return run_rank(args, launcher)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    args = p.parse_args(argv)
    _validate(p, args)
    return run(args, argv)


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("bench", help="all-reduce latency sweep against peers (same as nvrar-bench)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)

    def handler(args: argparse.Namespace) -> int:
        _validate(p, args)
        argv: List[str] = sys.argv[2:] if len(sys.argv) > 1 and sys.argv[1] == "bench" else []
        return run(args, argv)

    p.set_defaults(func=handler)
