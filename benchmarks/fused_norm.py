"""Fused all-reduce + residual add + RMSNorm (Communicator.all_reduce_add_rms_norm) against the
unfused sequence, interleaved in the same run on the same ranks, medians per size:

  fused   comm.all_reduce_add_rms_norm(x, residual, w)
  nvrar   comm.all_reduce(x); residual += x; x = F.rms_norm(residual, (h,), w, eps)
  gloo    dist.all_reduce(x) (gloo);  the same add and norm

    python benchmarks/fused_norm.py                         # 2 local ranks, bf16, h 4096/8192, batch 1..16
    python benchmarks/fused_norm.py --fused-algo one-shot    # the fused call one-shot, the rest auto
    python benchmarks/fused_norm.py --ranks 4 --ranks-per-node 2 --algo two-shot
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(args.ranks), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    import nvrar

    comm = nvrar.Communicator(ranks_per_node=args.ranks_per_node or None)
    dtype = getattr(torch, args.dtype)
    eps = 1e-6
    rows = []
    for h in args.hidden:
        w = (torch.rand(h) + 0.5).to(dtype)
        for batch in args.batch:
            g = torch.Generator().manual_seed(rank)
            x0 = torch.randn(batch, h, generator=g).to(dtype)
            r0 = torch.randn(batch, h, generator=torch.Generator().manual_seed(5)).to(dtype)
            bufs = {k: (x0.clone(), r0.clone()) for k in ("fused", "nvrar", "gloo")}

            def fused(bufs=bufs, x0=x0, w=w) -> None:
                x, r = bufs["fused"]
                x.copy_(x0)
                comm.all_reduce_add_rms_norm(x, r, w, eps, algorithm=args.fused_algo)

            def unfused(kind: str, bufs=bufs, x0=x0, w=w, h=h) -> None:
                x, r = bufs[kind]
                x.copy_(x0)
                if kind == "nvrar":
                    comm.all_reduce(x, algorithm=args.algo)
                else:
                    dist.all_reduce(x)
                r.add_(x)
                x.copy_(F.rms_norm(r, (h,), w, eps))

            fns = {"fused": fused, "nvrar": lambda: unfused("nvrar"), "gloo": lambda: unfused("gloo")}
            times = {k: [] for k in fns}
            for it in range(args.warmup + args.iters):
                for k, fn in fns.items():  # interleaved: load changes hit every variant alike
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    dt = time.perf_counter() - t0
                    if it >= args.warmup:
                        times[k].append(dt)
            med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            # the slowest rank's median decides (all ranks wait for it)
            allmed = [None] * args.ranks
            dist.all_gather_object(allmed, med)
            worst = {k: max(m[k] for m in allmed) for k in med}
            rows.append({"h": h, "batch": batch, "dtype": args.dtype, "us": worst,
                         "fused_over_nvrar": worst["fused"] / worst["nvrar"],
                         "variant": comm.algorithm_for(batch * h * x0.element_size(), args.algo),
                         "fused_variant": args.fused_algo or "auto"})
            if rank == 0:
                print(f"h={h:5d} batch={batch:3d} {rows[-1]['variant']:8s} fused ({rows[-1]['fused_variant']}) {worst['fused']:8.1f} us  "
                      f"nvrar+add+norm {worst['nvrar']:8.1f} us  gloo+add+norm {worst['gloo']:8.1f} us  "
                      f"fused/nvrar {rows[-1]['fused_over_nvrar']:.2f}", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "ranks_per_node": args.ranks_per_node, "algo": args.algo, "rows": rows},
                      f, indent=1)
    comm.close()
    dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=0, help="emulated nodes (default: all ranks on one node)")
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--algo", default=None, help="one-shot / two-shot (default: auto)")
    p.add_argument("--fused-algo", default=None, help="variant of the fused call only (default: --algo)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.fused_algo is None:
        args.fused_algo = args.algo
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(args, port), nprocs=args.ranks, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
