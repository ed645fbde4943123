"""A tensor-parallel transformer block, timed per decode step with the process group's native
all-reduce and with nvrar, in the same run, on the same ranks.

Each layer: column-parallel QKV projection (h -> 3h/t), a token-local mixing of q, k, v,
row-parallel output projection (h/t -> h) + all-reduce + residual, then column-parallel
up-projection (h -> f/t), ReLU, row-parallel down-projection (f/t -> h) + all-reduce + residual:
two all-reduces per layer, as in Megatron-style TP. Weights and inputs are small integers and
activations are reduced modulo a prime after each layer, so every value is an exact integer in
float32 and the outputs of the two backends must be bitwise identical (checked every step).

    python benchmarks/tp_decode.py                     # 2 local CPU ranks, gloo vs nvrar
    torchrun --nproc-per-node 4 benchmarks/tp_decode.py --layers 8 --hidden 2048
    mpirun -n 4 python benchmarks/tp_decode.py --json tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

MODULUS = 251.0  # float32: activations and partial sums stay far below 2^24, so every value is exact


class TPBlock(torch.nn.Module):
    """Rank `rank`'s shard of an L-layer TP transformer block."""

    def __init__(self, hidden: int, ffn: int, layers: int, world: int, rank: int, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: str = "cpu", density: float = 0.1,
                 modulus: float = MODULUS) -> None:
        super().__init__()
        self.modulus = modulus
        if hidden % world or ffn % world:
            raise ValueError(f"hidden ({hidden}) and ffn ({ffn}) must be divisible by the TP degree {world}")
        self.hidden, self.world = hidden, world
        g = torch.Generator().manual_seed(seed)

        def weight(rows: int, cols: int) -> torch.Tensor:
            # Full matrix from a seed shared by every rank, then this rank's shard: the sum over
            # ranks of the row-parallel partial products equals the unsharded product exactly.
            full = torch.randint(-1, 2, (rows, cols), generator=g).to(dtype)
            full[torch.rand(rows, cols, generator=g) >= density] = 0  # sparse: keeps magnitudes small
            return full.to(device)

        hs, fs = hidden // world, ffn // world
        self.qkv, self.out, self.up, self.down = [], [], [], []
        for _ in range(layers):
            qkv = weight(hidden, 3 * hidden)  # column-parallel: shard the output columns
            self.qkv.append(torch.cat([qkv[:, i * hidden + rank * hs: i * hidden + (rank + 1) * hs] for i in range(3)], 1))
            self.out.append(weight(hidden, hidden)[rank * hs:(rank + 1) * hs])  # row-parallel: shard the input rows
            self.up.append(weight(hidden, ffn)[:, rank * fs:(rank + 1) * fs])
            self.down.append(weight(ffn, hidden)[rank * fs:(rank + 1) * fs])

    def forward(self, x: torch.Tensor, all_reduce: Callable[[torch.Tensor], None]) -> torch.Tensor:
        hs = self.hidden // self.world
        for qkv, out, up, down in zip(self.qkv, self.out, self.up, self.down):
            a = x @ qkv
            q, k, v = a[:, :hs], a[:, hs:2 * hs], a[:, 2 * hs:]
            mixed = torch.relu(q) - k + v                      # token-local "attention": exact integers
            y = mixed @ out
            all_reduce(y)                                      # row-parallel: sum of partial products
            x = torch.remainder(x + y, self.modulus)
            h = torch.relu(x @ up)
            y = h @ down
            all_reduce(y)
            x = torch.remainder(x + y, self.modulus)
        return x


def decode_inputs(step: int, batch: int, hidden: int, dtype: torch.dtype, device: str, high: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, high, (batch, hidden), generator=g).to(dtype).to(device)


def run(args: argparse.Namespace) -> Dict[str, object]:
    import nvrar.torch as nt

    torch.set_num_threads(args.threads)  # ranks share the cores: no intra-op thread pools fighting
    if not dist.is_initialized():
        import datetime

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    block = TPBlock(args.hidden, args.ffn or 4 * args.hidden, args.layers, world, rank, dtype=dtype)
    backends: Dict[str, Callable[[torch.Tensor], None]] = {
        "native": lambda t: dist.all_reduce(t),
        "nvrar": lambda t: nt.all_reduce(t),
    }
    times: Dict[str, List[float]] = {k: [] for k in backends}
    mismatches = 0
    for step in range(args.warmup + args.steps):
        x = decode_inputs(step, args.batch, args.hidden, dtype, "cpu")
        outs = {}
        order = list(backends) if step % 2 == 0 else list(reversed(list(backends)))  # A B, then B A
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            outs[name] = block(x, backends[name])
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's step time
            if step >= args.warmup:
                times[name].append(float(t))
        if not torch.equal(outs["native"], outs["nvrar"]):
            mismatches += 1
    stats = nt.stats()
    nt.reset()
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    ar_bytes = args.batch * args.hidden * torch.tensor([], dtype=dtype).element_size()
    result = {
        "world_size": world, "hidden": args.hidden, "ffn": args.ffn or 4 * args.hidden, "layers": args.layers,
        "batch": args.batch, "dtype": args.dtype, "steps": args.steps, "allreduce_bytes": ar_bytes,
        "allreduces_per_step": 2 * args.layers, "median_step_ms": med,
        "speedup": med["native"] / med["nvrar"], "mismatched_steps": mismatches, "nvrar_calls": stats,
    }
    if rank == 0:
        print(f"TP decode, {world} ranks, {args.layers} layers x 2 all-reduces of {ar_bytes} B "
              f"(batch {args.batch}, hidden {args.hidden}, {args.dtype}), {args.steps} steps:")
        print(f"  native (gloo) {med['native']:.3f} ms/step, nvrar {med['nvrar']:.3f} ms/step, "
              f"speedup {result['speedup']:.2f}x; outputs identical in {args.steps + args.warmup - mismatches}"
              f"/{args.steps + args.warmup} steps; calls {stats}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()
    return result


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="local ranks when started bare (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=0, help="MLP width (default 4 x hidden)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=1, help="tokens per decode step (continuous batching)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if "OMPI_COMM_WORLD_RANK" in os.environ and "RANK" not in os.environ:  # mpirun: map to torch's env
        os.environ.update(RANK=os.environ["OMPI_COMM_WORLD_RANK"], WORLD_SIZE=os.environ["OMPI_COMM_WORLD_SIZE"],
                          MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    if "RANK" not in os.environ:
        # Started bare: launch --ranks local ranks of this script (a failing rank stops the others).
        from nvrar.bench.launch import spawn_local

        return spawn_local(args.ranks, [sys.executable, os.path.abspath(__file__), *argv])
    res = run(args)
    return 1 if res["mismatched_steps"] else 0


if __name__ == "__main__":
    sys.exit(main())
