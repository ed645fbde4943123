"""`nvrar tune`: measure, per message size, nvrar's variants against the process group's native
all-reduce on the current topology (with the benchmark's machinery), and write the winner of every
size as a tuning table (nvrar.tuning: the file format, load and save).

Dependencies point one way: this module imports nvrar.tuning; nvrar.tuning (and nvrar.torch,
which loads the tables) never import the benchmark package.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from typing import Optional, Sequence

from ..selector import Table
from ..tuning import buckets_from_measurements, save_table, tuning_path

__all__ = ["register", "main", "tune_rank"]


def tune_rank(args: argparse.Namespace, launcher: str) -> int:
    """One rank of `nvrar tune`: measure with the benchmark's runner, rank 0 writes the table."""
    from . import runner

    args.backends = "nvrar,gloo" if args.device == "cpu" else "nvrar,nccl"
    args.algorithms = "one-shot,two-shot"
    args.buffers = "ordinary"
    args.timing = "warm"  # one row per (algorithm, size): the table's buckets compare like with like
    args.launched_by = launcher
    rows = runner.run_rank(args, launcher, collect=True)
    if rows is None:  # not rank 0
        return 0
    device, world, G = args.device, rows[0]["_world"], rows[0]["_ranks_per_node"]
    natives = {r["backend"] for r in rows if r["backend"] != "nvrar"}
    if not natives:
        print("nvrar tune: the native backend could not run (see the skipped line); no table written", file=sys.stderr)
        return 1
    table = Table(device, world, G, buckets_from_measurements(rows), source=args.output or tuning_path())
    measured = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "dtype": args.dtype, "op": args.op,
                "rows": [{k: r[k] for k in ("backend", "algorithm", "bytes", "median_us")} for r in rows]}
    path = save_table(table, measured, args.output)
    print(f"nvrar tune: wrote the table for device {device}, {world} ranks, {G} per node to {path}:")
    for limit, choice in table.buckets:
        print(f"  <= {limit if limit is not None else 'any'} bytes: {choice}")
    return 0


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from . import add_arguments

    p = sub.add_parser("tune", help="measure nvrar vs the native all-reduce per size and write a tuning table",
                       description="Measure nvrar's variants and the native backend (gloo on CPU, NCCL on GPU) "
                                   "at every size, and write the per-size winner as a tuning table that nvrar.torch "
                                   "loads. Launches its ranks like nvrar-bench.")
    add_arguments(p)
    p.add_argument("-o", "--output", default=None, help=f"table file (default NVRAR_TUNING_FILE or {tuning_path()})")
    p.set_defaults(func=_run, iters=60, max_bytes=16 << 20, _parser=p)


def _run(args: argparse.Namespace) -> int:
    from . import _validate, run

    _validate(args._parser, args)
    argv = sys.argv[2:] if len(sys.argv) > 1 and sys.argv[1] == "tune" else []
    return run(args, argv, module="nvrar.bench.tune", rank_fn=tune_rank)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry of the ranks that a bare `nvrar tune` launches."""
    p = argparse.ArgumentParser(prog="nvrar tune")
    sub = p.add_subparsers(dest="command")
    register(sub)
    args = p.parse_args(["tune", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))
