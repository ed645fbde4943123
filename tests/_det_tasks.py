"""Worker task of tests/test_determinism.py: every row of a batch, reduced in batches of 1, 8 and
64 rows by one-shot and two-shot (and, across nodes, by LL packets or put-with-signal, by the
shard's size), must come out bitwise the same, on every rank."""

from __future__ import annotations

import hashlib
from typing import Any, Dict

import torch

import nvrar

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BATCHES = (1, 8, 64)
ALGORITHMS = ("one-shot", "two-shot", "auto")


def row_inputs(rank: int, rows: int, h: int, dtype: torch.dtype) -> torch.Tensor:
    """Row i of rank r is the same whatever the batch: its own generator, seeded by (r, i, h)."""
    out = torch.empty(rows, h, dtype=dtype)
    for i in range(rows):
        g = torch.Generator().manual_seed(100003 * rank + 7919 * i + h)
        # magnitudes 1e-3 .. 1e3 in one row: a sum in another order rounds differently
        v = torch.randn(h, generator=g) * torch.pow(10.0, torch.randint(-3, 4, (h,), generator=g).float())
        out[i] = v.to(dtype)
    return out


def task_det_rows(args: Dict[str, Any]) -> Dict[str, Any]:
    comm = nvrar.Communicator(ranks_per_node=args["G"])
    rank, world = comm.rank, comm.world_size
    served: Dict[str, list] = {}
    digests: Dict[str, str] = {}
    worst_rel = 0.0
    for name, dtype in DTYPES.items():
        for h in args["hs"]:
            ins = [row_inputs(r, max(BATCHES), h, dtype).double() for r in range(world)]
            ref64 = sum(ins)
            scale = sum(v.abs() for v in ins) + 1.0  # what the roundings are relative to
            first = None
            for batch in BATCHES:
                for algorithm in ALGORITHMS:
                    x = row_inputs(rank, batch, h, dtype)
                    comm.all_reduce(x, algorithm=algorithm)
                    bits = x.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
                    if first is None:
                        first = bits.clone()
                    n = min(batch, first.shape[0])
                    if not torch.equal(bits[:n], first[:n]):
                        bad = int((bits[:n] != first[:n]).any(dim=1).nonzero()[0, 0])
                        raise AssertionError(f"{name} h={h}: row {bad} differs between batch {first.shape[0]} "
                                             f"and batch {batch} with {algorithm}")
                    if batch > first.shape[0]:
                        first = bits.clone()  # the longer batch carries the rows compared next
                    served.setdefault(f"{name}/{h}", []).append(
                        [batch, algorithm, comm.algorithm_for(x.numel() * x.element_size(), algorithm)])
                    err = (x.double() - ref64[:batch]).abs() / scale[:batch]
                    worst_rel = max(worst_rel, float(err.max()))
            digests[f"{name}/{h}"] = hashlib.sha256(first.numpy().tobytes()).hexdigest()
    comm.close()
    return {"digests": digests, "served": served, "worst_rel": worst_rel, "world": world, "G": args["G"]}


TASKS = {"det_rows": task_det_rows}
