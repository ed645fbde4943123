"""A tensor-parallel transformer block, timed per decode step with the process group's native
all-reduce and with nvrar, in the same run, on the same ranks.

Each layer: column-parallel QKV projection (h -> 3h/t), a token-local mixing of q, k, v,
row-parallel output projection (h/t -> h) + all-reduce + residual, then column-parallel
up-projection (h -> f/t), ReLU, row-parallel down-projection (f/t -> h) + all-reduce + residual:
two all-reduces per layer, as in Megatron-style TP. Weights and inputs are small integers and
activations are reduced modulo a prime after each layer, so every value is an exact integer in
float32 and the outputs of the two backends must be bitwise identical (checked every step).

The fused variant (--variant fused) is a pre-norm block whose row-parallel projections end in
all-reduce + residual add + RMSNorm (real-valued weights, not exact integers), timed three ways in
the same run: nvrar's fused call (nt.all_reduce_add_rms_norm), nvrar's all-reduce followed by the
separate add and norm in torch, and gloo's all-reduce followed by the same add and norm. Its check
is teacher-forced: on check steps each layer's (all-reduce, add, norm) runs all three ways on the
same input, and the outputs must agree within 1 ulp of the dtype (the norm's mean of squares is
summed in another order in torch); the next layer continues from the fused outputs.

The DTensor variant builds the same block from nn.Linear layers and shards it with
parallelize_module (ColwiseParallel / RowwiseParallel), once on a DeviceMesh over a gloo group and
once over a group of the "nvrar" backend, timed in the same run.

    python benchmarks/tp_decode.py                     # 2 local CPU ranks, gloo vs nvrar, both variants
    python benchmarks/tp_decode.py --variant fused --dtype bfloat16 --hidden 4096 --batch 8
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


def full_weights(hidden: int, ffn: int, layers: int, seed: int = 0, dtype: torch.dtype = torch.float32,
                 density: float = 0.1) -> List[List[torch.Tensor]]:
    """Per layer, the unsharded (in x out) matrices qkv (h x 3h), out (h x h), up (h x f),
    down (f x h), from a seed shared by every rank: small integers, sparse (small magnitudes)."""
    g = torch.Generator().manual_seed(seed)

    def weight(rows: int, cols: int) -> torch.Tensor:
        full = torch.randint(-1, 2, (rows, cols), generator=g).to(dtype)
        full[torch.rand(rows, cols, generator=g) >= density] = 0
        return full

    return [[weight(hidden, 3 * hidden), weight(hidden, hidden), weight(hidden, ffn), weight(ffn, hidden)]
            for _ in range(layers)]


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
        # Full matrices from a seed shared by every rank, then this rank's shard: the sum over
        # ranks of the row-parallel partial products equals the unsharded product exactly.
        hs, fs = hidden // world, ffn // world
        self.qkv, self.out, self.up, self.down = [], [], [], []
        for qkv, out, up, down in full_weights(hidden, ffn, layers, seed, dtype, density):
            qkv, out, up, down = (w.to(device) for w in (qkv, out, up, down))
            # column-parallel: shard the output columns (q, k and v alike)
            self.qkv.append(torch.cat([qkv[:, i * hidden + rank * hs: i * hidden + (rank + 1) * hs] for i in range(3)], 1))
            self.out.append(out[rank * hs:(rank + 1) * hs])  # row-parallel: shard the input rows
            self.up.append(up[:, rank * fs:(rank + 1) * fs])
            self.down.append(down[rank * fs:(rank + 1) * fs])

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


class TPNormBlock(torch.nn.Module):
    """Rank `rank`'s shard of an L-layer pre-norm TP block whose row-parallel projections (out,
    down) end in all-reduce + residual add + RMSNorm: real-valued weights (scaled normal, shared
    by every rank through the seed), the residual stream in the dtype."""

    def __init__(self, hidden: int, ffn: int, layers: int, world: int, rank: int, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, eps: float = 1e-6) -> None:
        super().__init__()
        if hidden % world or ffn % world:
            raise ValueError(f"hidden ({hidden}) and ffn ({ffn}) must be divisible by the TP degree {world}")
        self.hidden, self.world, self.eps = hidden, world, eps
        hs, fs = hidden // world, ffn // world
        g = torch.Generator().manual_seed(seed)

        def weight(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=g) / rows ** 0.5).to(dtype)

        def norm_weight() -> torch.Tensor:
            return (torch.rand(hidden, generator=g) + 0.5).to(dtype)

        self.qkv, self.out, self.up, self.down, self.norms = [], [], [], [], []
        for _ in range(layers):
            qkv, out, up, down = weight(hidden, 3 * hidden), weight(hidden, hidden), weight(hidden, ffn), weight(ffn, hidden)
            self.qkv.append(torch.cat([qkv[:, i * hidden + rank * hs: i * hidden + (rank + 1) * hs] for i in range(3)], 1))
            self.out.append(out[rank * hs:(rank + 1) * hs].contiguous())
            self.up.append(up[:, rank * fs:(rank + 1) * fs].contiguous())
            self.down.append(down[rank * fs:(rank + 1) * fs].contiguous())
            self.norms.append((norm_weight(), norm_weight()))

    def layer_parts(self, i: int):
        """The two halves of layer i: x -> the row-parallel partial product y (before the
        all-reduce), and its norm weight."""
        hs = self.hidden // self.world

        def attn(x: torch.Tensor) -> torch.Tensor:
            a = x @ self.qkv[i]
            return (torch.relu(a[:, :hs]) - a[:, hs:2 * hs] + a[:, 2 * hs:]) @ self.out[i]

        def mlp(x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x @ self.up[i]) @ self.down[i]

        return [(attn, self.norms[i][0]), (mlp, self.norms[i][1])]

    def forward(self, x: torch.Tensor, ar_norm: Callable[..., "tuple[torch.Tensor, torch.Tensor]"]) -> torch.Tensor:
        residual = x.clone()
        for i in range(len(self.qkv)):
            for part, w in self.layer_parts(i):
                x, residual = ar_norm(part(x), residual, w, self.eps)
        return x


def add_rms_norm(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> "tuple[torch.Tensor, torch.Tensor]":
    """The separate residual add and RMSNorm after an all-reduce of y, in torch: the add in the
    dtype (rounded once), the norm in fp32 rounded once (what nvrar's fused call computes)."""
    residual.add_(y)
    y.copy_(torch.nn.functional.rms_norm(residual.float(), (residual.shape[-1],), weight.float(), eps))
    return y, residual


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two float tensors of one dtype."""
    itype = {2: torch.int16, 4: torch.int32}[a.element_size()]
    bits = a.element_size() * 8 - 1

    def ordered(t: torch.Tensor) -> torch.Tensor:
        v = t.contiguous().view(itype).to(torch.int64)
        return torch.where(v < 0, -(v & ((1 << bits) - 1)), v)

    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def _time_fused(block: TPNormBlock, args: argparse.Namespace, dtype: torch.dtype) -> "tuple[Dict[str, float], int, int]":
    """Median step time (ms, slowest rank) of fused / nvrar + add + norm / gloo + add + norm,
    interleaved (rotating order), and the largest ulp distance (x and residual, any layer, any
    rank) between the fused outputs and each unfused way on teacher-forced check steps, and the
    number of check steps."""
    import nvrar.torch as nt

    def nvrar_unfused(y, r, w, eps):
        nt.all_reduce(y)
        return add_rms_norm(y, r, w, eps)

    def gloo_unfused(y, r, w, eps):
        dist.all_reduce(y)
        return add_rms_norm(y, r, w, eps)

    ways = {"fused": nt.all_reduce_add_rms_norm, "nvrar": nvrar_unfused, "native": gloo_unfused}
    times: Dict[str, List[float]] = {k: [] for k in ways}
    worst = 0
    checks = 0
    names = list(ways)
    for step in range(args.warmup + args.steps):
        x0 = torch.randn(args.batch, args.hidden, generator=torch.Generator().manual_seed(1000 + step)).to(dtype)
        if step % 5 == 0:  # teacher-forced check (not timed)
            checks += 1
            x, residual = x0.clone(), x0.clone()
            for i in range(len(block.qkv)):
                for part, w in block.layer_parts(i):
                    y = part(x)
                    outs = {k: fn(y.clone(), residual.clone(), w, block.eps) for k, fn in ways.items()}
                    for k in ("nvrar", "native"):
                        for a, b in zip(outs["fused"], outs[k]):
                            worst = max(worst, ulp_distance(a, b))
                    x, residual = outs["fused"]
        order = names[step % 3:] + names[:step % 3]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            block(x0.clone(), ways[name])
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's step time
            if step >= args.warmup:
                times[name].append(float(t))
    w = torch.tensor([worst], dtype=torch.int64)
    dist.all_reduce(w, op=dist.ReduceOp.MAX)
    return {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}, int(w), checks


class DecodeBlock(torch.nn.Module):
    """The same block, unsharded, as plain nn.Linear layers: parallelize_module() shards it
    (q, k, v, up: ColwiseParallel; out, down: RowwiseParallel, whose Partial -> Replicate is the
    all-reduce, issued by DTensor as a functional collective)."""

    def __init__(self, hidden: int, ffn: int, layers: int, seed: int = 0, dtype: torch.dtype = torch.float32,
                 density: float = 0.1, modulus: float = MODULUS) -> None:
        super().__init__()
        self.modulus = modulus
        self.layers = torch.nn.ModuleList()

        def linear(w: torch.Tensor) -> torch.nn.Linear:
            lin = torch.nn.Linear(w.shape[0], w.shape[1], bias=False, dtype=dtype)
            lin.weight = torch.nn.Parameter(w.t().contiguous(), requires_grad=False)
            return lin

        for qkv, out, up, down in full_weights(hidden, ffn, layers, seed, dtype, density):
            self.layers.append(torch.nn.ModuleDict({
                "q": linear(qkv[:, :hidden]), "k": linear(qkv[:, hidden:2 * hidden]), "v": linear(qkv[:, 2 * hidden:]),
                "out": linear(out), "up": linear(up), "down": linear(down)}))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            mixed = torch.relu(layer["q"](x)) - layer["k"](x) + layer["v"](x)
            x = torch.remainder(x + layer["out"](mixed), self.modulus)
            x = torch.remainder(x + layer["down"](torch.relu(layer["up"](x))), self.modulus)
        return x


def parallelize_decode_block(block: DecodeBlock, mesh) -> torch.nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i in range(len(block.layers)):
        plan.update({f"layers.{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "up")})
        plan.update({f"layers.{i}.{n}": RowwiseParallel() for n in ("out", "down")})
    return parallelize_module(block, mesh, plan)


def decode_inputs(step: int, batch: int, hidden: int, dtype: torch.dtype, device: str, high: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, high, (batch, hidden), generator=g).to(dtype).to(device)


def _time(steps: Dict[str, Callable[[torch.Tensor], torch.Tensor]], args: argparse.Namespace,
          dtype: torch.dtype) -> "tuple[Dict[str, float], int]":
    """Median step time (ms, slowest rank) of each way, alternating A B / B A, and the number of
    steps whose outputs differ."""
    times: Dict[str, List[float]] = {k: [] for k in steps}
    mismatches = 0
    for step in range(args.warmup + args.steps):
        x = decode_inputs(step, args.batch, args.hidden, dtype, "cpu")
        outs = {}
        order = list(steps) if step % 2 == 0 else list(reversed(list(steps)))  # A B, then B A
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            outs[name] = steps[name](x)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's step time
            if step >= args.warmup:
                times[name].append(float(t))
        if not torch.equal(outs["native"], outs["nvrar"]):
            mismatches += 1
    return {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}, mismatches


def _report(rank: int, what: str, med: Dict[str, float], mismatches: int, args: argparse.Namespace,
            stats: Dict[str, int]) -> None:
    if rank == 0:
        total = args.steps + args.warmup
        print(f"  {what}: native (gloo) {med['native']:.3f} ms/step, nvrar {med['nvrar']:.3f} ms/step, "
              f"speedup {med['native'] / med['nvrar']:.2f}x; outputs identical in {total - mismatches}/{total} "
              f"steps; calls {stats}")


def run(args: argparse.Namespace) -> Dict[str, object]:
    import nvrar.torch as nt

    torch.set_num_threads(args.threads)  # ranks share the cores: no intra-op thread pools fighting
    if not dist.is_initialized():
        import datetime

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    ffn = args.ffn or 4 * args.hidden
    ar_bytes = args.batch * args.hidden * torch.tensor([], dtype=dtype).element_size()
    result: Dict[str, object] = {
        "world_size": world, "hidden": args.hidden, "ffn": ffn, "layers": args.layers,
        "batch": args.batch, "dtype": args.dtype, "steps": args.steps, "allreduce_bytes": ar_bytes,
        "allreduces_per_step": 2 * args.layers,
    }
    if rank == 0:
        print(f"TP decode, {world} ranks, {args.layers} layers x 2 all-reduces of {ar_bytes} B "
              f"(batch {args.batch}, hidden {args.hidden}, {args.dtype}), {args.steps} steps:")
    if args.variant == "fused":
        block = TPNormBlock(args.hidden, ffn, args.layers, world, rank, dtype=dtype)
        with torch.no_grad():
            med, ulps, checks = _time_fused(block, args, dtype)
        stats = nt.stats()
        result.update({"fused": {"median_step_ms": med, "fused_over_nvrar": med["fused"] / med["nvrar"],
                                 "fused_over_native": med["fused"] / med["native"], "max_ulp": ulps,
                                 "check_steps": checks, "nvrar_calls": stats},
                       "mismatched_steps": 0 if ulps <= 1 else checks})
        if rank == 0:
            print(f"  fused all-reduce + add + RMSNorm per layer: fused {med['fused']:.3f} ms/step, nvrar + add + norm "
                  f"{med['nvrar']:.3f} ms/step, gloo + add + norm {med['native']:.3f} ms/step; fused/nvrar "
                  f"{med['fused'] / med['nvrar']:.2f}, fused/gloo {med['fused'] / med['native']:.2f}; outputs within "
                  f"{ulps} ulp on {checks} teacher-forced check steps; calls {stats}")
    if args.variant in ("manual", "both"):
        block = TPBlock(args.hidden, ffn, args.layers, world, rank, dtype=dtype)
        steps = {"native": lambda x: block(x, lambda t: dist.all_reduce(t)),
                 "nvrar": lambda x: block(x, lambda t: nt.all_reduce(t))}
        med, mismatches = _time(steps, args, dtype)
        stats = nt.stats()
        result.update({"median_step_ms": med, "speedup": med["native"] / med["nvrar"], "mismatched_steps": mismatches,
                       "nvrar_calls": stats})
        _report(rank, "manual TP, nt.all_reduce", med, mismatches, args, stats)
    if args.variant in ("dtensor", "both"):
        # The same block through parallelize_module, on a DeviceMesh over gloo and one over the
        # "nvrar" backend: the all-reduces are DTensor's functional collectives. Distinct dim names:
        # DTensor treats meshes over the same ranks as equal (and caches by them) otherwise.
        from torch.distributed.device_mesh import DeviceMesh

        nvrar_group = dist.new_group(backend=nt.BACKEND)
        gloo_group = dist.new_group(backend="gloo")
        models = {name: parallelize_decode_block(DecodeBlock(args.hidden, ffn, args.layers, dtype=dtype),
                                                 DeviceMesh.from_group(g, "cpu", mesh_dim_names=(f"tp_{name}",)))
                  for name, g in (("native", gloo_group), ("nvrar", nvrar_group))}
        with torch.no_grad():
            med, mismatches = _time({k: m for k, m in models.items()}, args, dtype)
        stats = nt.stats(nvrar_group)
        result["dtensor"] = {"median_step_ms": med, "speedup": med["native"] / med["nvrar"],
                             "mismatched_steps": mismatches, "nvrar_calls": stats}
        result["mismatched_steps"] = int(result.get("mismatched_steps", 0)) + mismatches  # type: ignore[call-overload]
        _report(rank, "DTensor TP (parallelize_module), gloo group vs \"nvrar\" group", med, mismatches, args, stats)
    nt.reset()
    if rank == 0 and args.json:
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
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--variant", default="both", choices=["manual", "dtensor", "both", "fused"],
                   help="manual TP (nt.all_reduce), DTensor TP (parallelize_module over a gloo group and an "
                        "\"nvrar\" group), or both (default); fused: a pre-norm block with nvrar's fused "
                        "all-reduce + add + RMSNorm against nvrar / gloo all-reduce + separate add and norm")
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
