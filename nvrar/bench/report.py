"""Output of the benchmark: the nccl-tests-style table, the JSON file and the plot."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, TextIO

__all__ = ["header_lines", "table_header", "format_rows", "write_json", "write_plot", "speedups", "first_line"]


def fmt_size(n: int) -> str:
    for unit, div in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def header_lines(meta: Dict[str, Any]) -> List[str]:
    lines = [
        f"# nvrar-bench {meta['nvrar_version']}: all-reduce latency of nvrar and its peers, measured in the same run",
        "# time = median over iterations of the slowest rank's time for that iteration; p99 and min likewise",
        f"# world {meta['world_size']} ranks, {meta['ranks_per_node']} per node ({meta['num_nodes']} node"
        f"{'s' if meta['num_nodes'] != 1 else ''}), device {meta['device']}: {meta['hardware']}",
        "# versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        f"# launcher {meta['launcher']}, bootstrap {meta['bootstrap']}; iters {meta['iters']} in {meta['rounds']} "
        f"interleaved rounds, warmup {meta['warmup']}, dtype {meta['dtype']}, op {meta['op']}; nvrar buffers: {meta['buffers']} "
        f"(/sym rows: Communicator.empty(), zero-copy)",
        f"# memcpy bandwidth of this machine (1 core, 16 MiB copy): {meta['memcpy_gbps']:.2f} GB/s; "
        f"nvrar per-call overhead (1 rank, 8 B): {meta['call_overhead_us']:.2f} us",
    ]
    for job in meta.get("jobs", []):  # a bare start that ran one job per MPI library (nvrar.bench.launch)
        lines.append(f"# job {job['name']} ({','.join(job['backends'])}): {job['launcher']}"
                     + (f", mpi4py bound to {job['libmpi']}" if job.get("libmpi") else "")
                     + (f"; {first_line(job['library_version'])}" if job.get("library_version") else "")
                     + ("" if job.get("exit", 0) == 0 else f"; failed, exit {job['exit']}"))
    if meta.get("jobs"):
        lines.append("# the jobs ran one after the other, each with the cores to itself (not interleaved with "
                     "each other)")
    if meta.get("skipped"):
        lines.append("# skipped: " + "; ".join(f"{k} ({v})" for k, v in meta["skipped"].items()))
    lines.append("# busbw = algbw * 2(n-1)/n; speedup = best peer's time / nvrar's time at that size")
    lines.append("#")
    return lines


def table_header() -> List[str]:
    return [
        f"# {'size':>10} {'count':>10} {'type':>8} {'redop':>5}  {'backend/algorithm':<26} {'time':>9} {'p99':>9} "
        f"{'min':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6} {'speedup':>7}  library",
        f"# {'(B)':>10} {'(elements)':>10} {'':>8} {'':>5}  {'':<26} {'(us)':>9} {'(us)':>9} {'(us)':>9} "
        f"{'(GB/s)':>7} {'(GB/s)':>7} {'':>6} {'':>7}  (MPI rows: MPI_Get_library_version(), first line)",
    ]


def first_line(text: str) -> str:
    """The first line of an MPI library's version string, its runs of blanks made one."""
    return " ".join(text.strip().splitlines()[0].split()) if text and text.strip() else ""


def speedups(rows: List[Dict[str, Any]]) -> Dict[int, Optional[float]]:
    """Per row index: best peer median / this nvrar row's median (None for peers or no peer)."""
    peers = [r["median_us"] for r in rows if r["backend"] != "nvrar" and r["wrong"] == 0]
    best = min(peers) if peers else None
    out: Dict[int, Optional[float]] = {}
    for i, r in enumerate(rows):
        ok = best is not None and r["backend"] == "nvrar" and r["median_us"] > 0 and r["wrong"] == 0
        out[i] = best / r["median_us"] if ok else None
    return out


def format_rows(rows: List[Dict[str, Any]]) -> List[str]:
    sp = speedups(rows)
    lines = []
    for i, r in enumerate(rows):
        s = f"{sp[i]:.2f}x" if sp[i] is not None else "-"
        label = r.get("label") or f"{r['backend']}/{r['algorithm']}"
        lib = first_line(r.get("library_version", ""))
        lines.append(
            f"  {r['bytes']:>10} {r['count']:>10} {r['dtype']:>8} {r['op']:>5}  {label:<26} {r['median_us']:>9.2f} "
            f"{r['p99_us']:>9.2f} {r['min_us']:>9.2f} {r['algbw_gbps']:>7.2f} {r['busbw_gbps']:>7.2f} {r['wrong']:>6} {s:>7}"
            + (f"  {lib}" if lib else "")
        )
    return lines


def write_json(path: str, meta: Dict[str, Any], results: List[Dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
        f.write("\n")


def write_plot(path: str, meta: Dict[str, Any], results: List[Dict[str, Any]]) -> None:
    """Latency vs size (log-log, one line per backend/algorithm) and nvrar's speed-up vs size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: Dict[str, List[Dict[str, Any]]] = {}
    for r in results:
        series.setdefault(r.get("label") or f"{r['backend']}/{r['algorithm']}", []).append(r)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, rows in sorted(series.items()):
        rows = sorted(rows, key=lambda r: r["bytes"])
        style = "-o" if label.startswith("nvrar") else "--s"
        ax1.plot([r["bytes"] for r in rows], [r["median_us"] for r in rows], style, ms=3, label=label)
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("message size (bytes)")
    ax1.set_ylabel("latency (us, median of per-iteration max)")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    sizes = sorted({r["bytes"] for r in results})
    for label, rows in sorted(series.items()):
        if not label.startswith("nvrar"):
            continue
        xs, ys = [], []
        for size in sizes:
            at = [r for r in results if r["bytes"] == size]
            peers = [r["median_us"] for r in at if r["backend"] != "nvrar" and r["wrong"] == 0]
            mine = [r["median_us"] for r in rows if r["bytes"] == size]
            if peers and mine:
                xs.append(size)
                ys.append(min(peers) / mine[0])
        if xs:
            ax2.plot(xs, ys, "-o", ms=3, label=f"{label} vs best peer")
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("message size (bytes)")
    ax2.set_ylabel("speed-up (best peer time / nvrar time)")
    ax2.grid(True, which="both", alpha=0.3)
    if ax2.lines:
        ax2.legend(fontsize=8)
    fig.suptitle(f"all-reduce {meta['dtype']} {meta['op']}, {meta['world_size']} ranks "
                 f"({meta['ranks_per_node']} per node), {meta['device']}: {meta['hardware']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_lines(lines: List[str], stream: TextIO) -> None:
    for line in lines:
        print(line, file=stream)
    stream.flush()
