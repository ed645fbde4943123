"""``nvrar plan``, ``nvrar model`` and ``nvrar fit``: the planner's command-line interface.

Registered by the top-level dispatcher (nvrar/cli.py) through :func:`register`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from typing import Any, Callable, Dict, Optional, Sequence

from .anchors import residuals
from .cards import CARDS, get_card
from .fit import BACKENDS, fit, load_bench
from .latency import predict
from .plan import make_plan
from .profiles import PARAMS, PROFILES, Profile, get_profile
from . import wire as wire_model

__all__ = ["register", "parse_size", "format_size"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes from "1048576", "128K", "128KB", "128KiB", "2M", "1.5M", "1G" (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:I?B)?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 128K, 2M or 1048576)")
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if value != int(value):
        raise argparse.ArgumentTypeError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def format_size(n: float) -> str:
    """128K / 2M style for powers of two, plain bytes otherwise."""
    for unit in ("G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{int(n) // _UNITS[unit]}{unit}"
    return f"{int(n)}B"


def _profile(args: argparse.Namespace) -> Profile:
    profile = get_profile(args.profile)
    values: Dict[str, float] = {}
    for item in args.set or []:
        name, _, value = item.partition("=")
        if name not in PARAMS or not value:
            raise SystemExit(f"--set {item!r}: expected NAME=VALUE, NAME one of {', '.join(PARAMS)}")
        values[name] = float(value)
    return profile.updated(**values) if values else profile


def _common(parser: argparse.ArgumentParser, profile_required: bool) -> None:
    parser.add_argument("--profile", required=profile_required, default=None,
                        help=f"machine profile: {', '.join(PROFILES)}, or a JSON file from nvrar fit")
    parser.add_argument("--nodes", type=int, default=None, help="nodes N")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs (ranks) per node G (default: the profile's)")
    parser.add_argument("--set", action="append", metavar="NAME=VALUE",
                        help="override one profile parameter (repeatable)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _pipe_safe(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Let ``nvrar model ... | head`` end quietly (the pattern from Python's signal docs)."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0

    return run


def _print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


# --- plan ---------------------------------------------------------------------------------------

def _run_plan(args: argparse.Namespace) -> int:
    card = get_card(args.model)
    profile = _profile(args) if args.profile else None
    try:
        plan = make_plan(card, args.tp, args.pp, args.prompt, args.decode, args.batch,
                         args.bytes_per_elem, profile, args.nodes, args.gpus_per_node)
    except ValueError as exc:
        print(f"nvrar plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        _print_json(plan)
        return 0
    vol = plan["volume_breakdown_bytes"]
    calls = plan["allreduce_calls"]
    print(f"{card.name}: L={card.layers} h={card.hidden} v={card.vocab}  tp={args.tp} pp={args.pp}"
          f"  Sp={args.prompt} Sd={args.decode} batch={args.batch} b={args.bytes_per_elem}")
    print(f"volume per request: {vol['total'] / 1e6:.3f} MB  (all-reduce {vol['allreduce'] / 1e6:.3f},"
          f" p2p {vol['p2p'] / 1e6:.3f}, all-gather {vol['allgather'] / 1e6:.3f},"
          f" logits {vol['logits'] / 1e6:.3f})")
    print(f"all-reduce calls per request: prefill {calls['prefill']}, decode {calls['decode']}"
          f"  (per stage per pass: {plan['allreduce_calls_per_stage']})")
    msg = plan["message_bytes"]
    print(f"message per call: prefill {msg['prefill']} B, decode {msg['decode']} B")
    for w in plan["warnings"]:
        print(f"warning: {w}")
    if profile is not None:
        lay, step = plan["layout"], plan["decode_step"]
        print(f"profile {profile.name}: {lay['nodes']} nodes x {lay['gpus_per_node']} GPUs,"
              f" TP group {lay['tp_nodes']} x {lay['tp_gpus_per_node']}")
        for k in ("nccl", "nvrar"):
            print(f"  decode step, {k:5s}: {plan['comm_us_per_token'][k]:9.1f} us"
                  f"  (all-reduce {step['allreduce_us'][k]:.1f} us"
                  f" = {calls['prefill']} x {step['allreduce_us_per_call'][k]:.1f},"
                  f" other {step['other_us']:.1f} us)")
        n, v = plan["comm_us_per_token"]["nccl"], plan["comm_us_per_token"]["nvrar"]
        if v > 0:
            print(f"  nccl / nvrar per decode step: {n / v:.2f}x")
    return 0


# --- model --------------------------------------------------------------------------------------

_ORDER = ("nvrar", "nccl", "nccl_ring", "nccl_tree", "flat_rd")


def _run_model(args: argparse.Namespace) -> int:
    if args.ledger or args.wire_table or args.wire:
        return _run_wire(args)
    profile = _profile(args)
    gpus = args.gpus_per_node or profile.gpus_per_node
    if args.anchors:
        rows = residuals(profile, args.anchor_profile)
        if args.json:
            _print_json({"profile": profile.name, "anchors": rows})
        for r in [] if args.json else rows:
            lo, hi = r["measured_us"]
            measured = f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"
            tag = "" if r["calibrated"] else "  (not calibrated)"
            print(f"{r['nodes']}x{r['gpus_per_node']} {format_size(r['bytes']):>4} {r['key']:18s}"
                  f" measured {measured:>8} us  model {r['predicted_us']:7.1f} us"
                  f"  {100 * r['rel_error']:+6.1f}%{tag}")
        return 0
    if args.table:
        table = _ratio_table(profile, gpus)
        if args.json:
            _print_json({"profile": profile.name, "gpus_per_node": gpus, "table": table})
            return 0
        print(f"NCCL (best of ring/tree) / nvrar, predicted, {profile.name}, {gpus} GPUs per node;"
              " cells: ratio (nccl us / nvrar us)")
        print("| size | " + " | ".join(f"{n} nodes" for n in _TABLE_NODES) + " |")
        print("|---" * (len(_TABLE_NODES) + 1) + "|")
        for size in _TABLE_SIZES:
            cells = [table[format_size(size)][str(n)] for n in _TABLE_NODES]
            print(f"| {format_size(size)} | " + " | ".join(
                f"{c['ratio']:.2f}x ({c['nccl_us']:.0f}/{c['nvrar_us']:.0f})" for c in cells) + " |")
        return 0
    if args.nodes is None or args.bytes is None:
        print("nvrar model: --nodes and --bytes are required (or --anchors / --table)",
              file=sys.stderr)
        return 2
    result = predict(args.bytes, args.nodes, gpus, profile, zero_copy=args.zero_copy)
    if args.plot:
        _plot(args.plot, profile, args.nodes, gpus, args.bytes)
        result["plot"] = args.plot
    if args.json:
        _print_json(result)
        return 0
    pred = result["predicted_us"]
    print(f"{profile.name}: {args.nodes} nodes x {gpus} GPUs, {format_size(args.bytes)}"
          f" ({args.bytes} bytes)")
    for key in list(_ORDER) + sorted(k for k in pred if k not in _ORDER):
        note = {"nvrar": f"  ({result['nvrar_choice']})", "nccl": f"  ({result['nccl_choice']})"}
        print(f"  {key:22s} {pred[key]:9.1f} us{note.get(key, '')}")
    print(f"  nccl / nvrar: {result['speedup_vs_nccl']:.2f}x")
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0


_TABLE_SIZES = tuple(k << 10 for k in (128, 256, 512, 1024, 2048))
_TABLE_NODES = (2, 4, 8, 16)


def _ratio_table(profile: Profile, gpus: int) -> Dict[str, Dict[str, Dict[str, Any]]]:
    """{size: {nodes: {"ratio", "nccl_us", "nvrar_us", "nvrar_choice", "nccl_choice"}}}."""
    table: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for size in _TABLE_SIZES:
        row = table.setdefault(format_size(size), {})
        for nodes in _TABLE_NODES:
            r = predict(size, nodes, gpus, profile)
            row[str(nodes)] = {"ratio": r["speedup_vs_nccl"], "nccl_us": r["predicted_us"]["nccl"],
                               "nvrar_us": r["predicted_us"]["nvrar"],
                               "nvrar_choice": r["nvrar_choice"], "nccl_choice": r["nccl_choice"]}
    return table


def _plot(path: str, profile: Profile, nodes: int, gpus: int, size: int) -> None:
    import matplotlib  # lazily: only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("nvrar", "nccl_ring", "nccl_tree", "flat_rd")
    sizes = [1 << k for k in range(13, 25)]
    counts = sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, nodes})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    by_size = [predict(s, nodes, gpus, profile)["predicted_us"] for s in sizes]
    by_nodes = [predict(size, n, gpus, profile)["predicted_us"] for n in counts]
    for key in keys:
        left.plot(sizes, [p[key] for p in by_size], marker="o", ms=3, label=key)
        right.plot(counts, [p[key] for p in by_nodes], marker="o", ms=3, label=key)
    left.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="predicted latency (us)",
             title=f"{profile.name}, {nodes} x {gpus} GPUs")
    right.set(xscale="log", yscale="log", xlabel="nodes", ylabel="predicted latency (us)",
              title=f"{profile.name}, {format_size(size)}, {gpus} GPUs per node")
    left.set_xticks(sizes[::2], [format_size(s) for s in sizes[::2]])
    right.set_xticks(counts, [str(n) for n in counts])
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- model over the wire ledger (--ledger / --wire / --wire-table) ------------------------------

_DEFAULT_OLD_LEDGERS = os.path.join("docs", "gpu", "ledgers")


def _ledger_dir(path: Optional[str], default: bool) -> Optional[str]:
    """The directory given, else (for the old kernel) docs/gpu/ledgers from the working directory
    or, failing that, from the source tree this package was loaded from."""
    if path:
        if not os.path.isdir(path):
            raise SystemExit(f"nvrar model: {path}: not a directory of wire ledgers")
        return path
    if not default:
        return None
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir)
    for base in (os.getcwd(), os.path.normpath(here)):
        candidate = os.path.join(base, _DEFAULT_OLD_LEDGERS)
        if os.path.isdir(candidate):
            return candidate
    return None


def _print_cost_table(w: "wire_model.WireProfile") -> None:
    print(f"wire profile {w.name}: {w.description}")
    print(f"extends machine profile {w.machine}; transport {w.transport}"
          f" ({'CPU proxy' if w.proxy else 'GPU-initiated'})")
    for row in wire_model.cost_table(w):
        tag = "  [estimate]" if row["estimate"] else ""
        print(f"  {row['name']:17s} {row['value']:8.3g} {row['unit']:5s} {row['source']}{tag}")


def _cell_text(cell: Optional[Dict[str, Any]]) -> str:
    if cell is None:
        return "-"
    tag = "L" if cell["how"] == "ledger" else "E"
    return f"{cell['us']:.1f} {tag}"


def _run_wire(args: argparse.Namespace) -> int:
    if not args.wire:
        print("nvrar model: --ledger and --wire-table need --wire NAME"
              f" ({', '.join(wire_model.WIRES)})", file=sys.stderr)
        return 2
    try:
        w = wire_model.get_wire(args.wire)
    except KeyError as exc:
        print(f"nvrar model: {exc.args[0]}", file=sys.stderr)
        return 2
    if args.ledger:
        try:
            ledger = wire_model.load_ledger(args.ledger)
            if args.nodes is not None and args.nodes != ledger["nodes"]:
                ledger = wire_model.extrapolate(ledger, args.nodes)
            priced = wire_model.price(ledger, w)
        except (OSError, ValueError) as exc:
            print(f"nvrar model: {exc}", file=sys.stderr)
            return 2
        if args.json:
            _print_json(priced)
            return 0
        print(f"# {wire_model.DECISION_NOTE}")
        src = priced["extrapolated_from"]
        print(f"{w.name} (machine {w.machine}, {w.transport}): {priced['layout']} {format_size(priced['size'])},"
              f" kernel {priced['kernel']}"
              + (f" (device code {priced['device_code']})" if priced.get("device_code") else "")
              + f", {priced['algorithm']}, {priced['chunks']} chunk(s),"
              f" {priced['blocks']} block(s),"
              f" channels {priced['channels'] if priced['channels'] is not None else '- (one message per block)'},"
              f" protocols {'/'.join(priced['protocols']) or '-'}"
              + (f"; extrapolated from {src['layout']}" if src else ""))
        print(f"  {'chunk':>5} {'phase':14s} {'step':>4} {'protocol':10s} {'us':>8}  terms (us)")
        for s in priced["steps"]:
            terms = ", ".join(f"{k} {v:.2f}" for k, v in s["terms"].items() if v)
            print(f"  {s['chunk']!s:>5} {s['phase']:14s} {s['step']!s:>4} {s['protocol'] or '-':10s}"
                  f" {s['us']:8.2f}  {terms}")
            for note in s.get("notes", []):
                print(f"        note: {note}")
        print(f"  launch {priced['launch_us']:.2f} us; by phase: "
              + ", ".join(f"{k} {v:.1f}" for k, v in priced["by_phase_us"].items()))
        print(f"  modelled call: {priced['total_us']:.1f} us (a tool for decisions, never a result)")
        return 0
    if args.wire_table:
        old_dir = _ledger_dir(args.old_ledgers, default=True)
        new_dir = _ledger_dir(args.new_ledgers, default=False)
        old = wire_model.load_ledgers(old_dir) if old_dir else []
        new = wire_model.load_ledgers(new_dir) if new_dir else []
        try:
            table = wire_model.comparison_table(w, old, new, gpus=args.gpus_per_node, dtype=args.dtype)
        except ValueError as exc:
            print(f"nvrar model: {exc}", file=sys.stderr)
            return 2
        table["old_ledgers"], table["new_ledgers"] = old_dir, new_dir
        if args.json:
            _print_json(table)
            return 0
        g = table["gpus_per_node"]
        print(f"# {wire_model.DECISION_NOTE}")
        print(f"# {w.name} (machine {w.machine}, {w.transport}), {g} GPUs per node; modelled us per call."
              f" old: {old_dir or 'no ledgers'}; new: {new_dir or 'no ledgers'}")
        print("# L: priced ledger of that layout; E: extrapolated from the ledger of the most nodes"
              " (log2 N' exchange steps + 2 folds if N > N'); NCCL: M measured (published, anchors.py),"
              " m modelled (nvrar.model.latency); 3x+: the new kernel beats NCCL by 3x or more")
        print("| size | nodes | old kernel (us) | new kernel (us) | NCCL (us) | NCCL / old | NCCL / new |")
        print("|---|---|---|---|---|---|---|")
        for size, row in table["table"].items():
            for n, cell in row.items():
                nccl = cell["nccl"]
                ratio_old = f"{cell['nccl_over_old']:.2f}x" if "nccl_over_old" in cell else "-"
                ratio_new = "-"
                if "nccl_over_new" in cell:
                    r = cell["nccl_over_new"]
                    ratio_new = f"{r:.2f}x" + (" 3x+" if r >= 3.0 else "")
                print(f"| {format_size(int(size))} | {n}x{g} | {_cell_text(cell['old'])} | {_cell_text(cell['new'])}"
                      f" | {nccl['us']:.1f} {'M' if nccl['how'] == 'measured' else 'm'} | {ratio_old}"
                      f" | {ratio_new} |")
        return 0
    if args.json:
        _print_json({"wire": w.name, "machine": w.machine, "transport": w.transport,
                     "costs": wire_model.cost_table(w), "note": wire_model.DECISION_NOTE})
        return 0
    print(f"# {wire_model.DECISION_NOTE}")
    _print_cost_table(w)
    return 0


# --- fit ----------------------------------------------------------------------------------------

def _run_fit(args: argparse.Namespace) -> int:
    start = _profile(args)
    backends = tuple(args.backends.split(","))
    try:
        obs = load_bench(args.files, backends, args.stat)
        result = fit(obs, start, fix=[f for f in (args.fix or "").split(",") if f],
                     label=", ".join(args.files))
    except (OSError, ValueError, KeyError) as exc:
        print(f"nvrar fit: {exc}", file=sys.stderr)
        return 2
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            json.dump(result.to_dict(), fh, indent=2)
    if args.json:
        _print_json(result.to_dict())
        return 0
    print(f"fitted {len(result.rows)} rows from {', '.join(args.files)} starting at {start.name};"
          f" rms relative error {100 * result.rms_rel_error:.1f}%")
    for name in result.fitted:
        unit = PARAMS[name][0]
        print(f"  {name:24s} {getattr(start, name):10.4g} -> {getattr(result.profile, name):10.4g} {unit}")
    if args.output:
        print(f"profile written to {args.output} (use it as --profile {args.output})")
    return 0


def register(subparsers: Any) -> None:
    """Add the "plan", "model" and "fit" subcommands to an argparse subparsers object."""
    plan = subparsers.add_parser(
        "plan", help="communication volume and time of TP/PP inference",
        description="Communication volume, all-reduce counts and message sizes of one request "
                    "under TP x PP; with --profile, predicted communication time per decode step.")
    plan.add_argument("--model", required=True, choices=sorted(CARDS), help="model card")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel degree t")
    plan.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree p")
    plan.add_argument("--prompt", type=int, required=True, help="prefill length Sp (tokens)")
    plan.add_argument("--decode", type=int, required=True, help="decode length Sd (tokens)")
    plan.add_argument("--batch", type=int, default=1, help="requests per batch (continuous batching)")
    plan.add_argument("--bytes-per-elem", type=int, default=2, help="bytes per element b (bf16: 2)")
    _common(plan, profile_required=False)
    plan.set_defaults(func=_pipe_safe(_run_plan))

    model = subparsers.add_parser(
        "model", help="predicted all-reduce latency of NVRAR vs NCCL",
        description="Alpha-beta latency model of NVRAR (per variant and transport), NCCL ring and "
                    "tree, and flat recursive doubling.")
    _common(model, profile_required=False)
    model.set_defaults(profile="perlmutter")
    model.add_argument("--bytes", type=parse_size, default=None, help="message size: 128K, 2M, 1048576")
    model.add_argument("--zero-copy", action="store_true", help="input already in the symmetric buffer")
    model.add_argument("--plot", metavar="PATH", help="write latency vs size and vs nodes plots")
    model.add_argument("--anchors", action="store_true",
                       help="compare the profile with the published measurements it is calibrated on")
    model.add_argument("--table", action="store_true",
                       help="NCCL/nvrar ratio table: 128K-2M x 2, 4, 8, 16 nodes")
    model.add_argument("--anchor-profile", default=None,
                       help="with --anchors: whose anchors (default: the profile's name)")
    model.add_argument("--wire", default=None, metavar="NAME",
                       help="wire profile of the ledger cost model: " + ", ".join(wire_model.WIRES)
                       + " (alone: print its per-operation costs with sources)")
    model.add_argument("--ledger", default=None, metavar="FILE",
                       help="price the wire ledger FILE (scripts/emulate.sh --ledger) under --wire, per step;"
                            " with --nodes N, extrapolated to N nodes")
    model.add_argument("--wire-table", action="store_true",
                       help="with --wire: old kernel, new kernel and NCCL side by side, 128K-2M x 2, 4, 8, 16 nodes")
    model.add_argument("--old-ledgers", default=None, metavar="DIR",
                       help="with --wire-table: the old kernel's ledgers (default: docs/gpu/ledgers)")
    model.add_argument("--new-ledgers", default=None, metavar="DIR",
                       help="with --wire-table: the new kernel's ledgers (default: none)")
    model.add_argument("--dtype", default=None, help="with --wire-table: only ledgers of this dtype")
    model.set_defaults(func=_pipe_safe(_run_model))

    fitp = subparsers.add_parser(
        "fit", help="calibrate a profile from nvrar-bench --json output",
        description="Least-squares fit of a profile's alphas and betas to benchmark JSON files.")
    fitp.add_argument("files", nargs="+", help="nvrar-bench --json output files (one layout each)")
    fitp.add_argument("--profile", default="perlmutter", help="starting profile")
    fitp.add_argument("--set", action="append", metavar="NAME=VALUE", help="override a start value")
    fitp.add_argument("--fix", default="", help="comma-separated parameters to keep fixed")
    fitp.add_argument("--backends", default=",".join(BACKENDS), help="backends to use")
    fitp.add_argument("--stat", default="median_us", choices=("median_us", "min_us", "p99_us"))
    fitp.add_argument("-o", "--output", help="write the fitted profile (JSON) here")
    fitp.add_argument("--json", action="store_true", help="print JSON instead of text")
    fitp.set_defaults(func=_pipe_safe(_run_fit))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the planner's subcommands without the top-level dispatcher (for tests and debugging)."""
    parser = argparse.ArgumentParser(prog="nvrar")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
