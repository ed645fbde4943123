"""The GPU kernel's wire budget, asserted on the emulated device (docs/gpu/emulation.md, "Wire budget").

``scripts/emulate.sh --only wire_budget`` runs one call with nvrar.settings' GPU defaults in each of
nine cells (2x4, 2x8, 4x2 at 128 KB, 512 KB and 2 MB, bfloat16) and fails a cell that breaks a
rule; this test runs it (plain, not under ThreadSanitizer, within five minutes), reads the ledgers
it wrote, checks every rule again from the JSON, and asks the wire model (h100-ndr-ibgda, the
transport the defaults serve) whether the defaults chose the fastest algorithm and inter-node
protocol among the candidate plans of docs/gpu/ledgers/candidates/ (scripts/wire_candidates.sh).
It prints both. The model is a tool for decisions, never a result.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Tuple

import pytest

from nvrar import env, settings
from nvrar.model import wire

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "emulate.sh"
CANDIDATES = ROOT / "docs" / "gpu" / "ledgers" / "candidates"
CXX = os.environ.get("CXX", "g++")
LAYOUTS = ((2, 4), (2, 8), (4, 2))
SIZES = (128 << 10, 512 << 10, 2 << 20)
SIZE_NAMES = {128 << 10: "128K", 512 << 10: "512K", 2 << 20: "2M"}
LAST = re.compile(r"^emulated device: (\d+) cases passed, (\d+) failed \(tsan: off\)$")
WIRE = "h100-ndr-ibgda"

missing = "" if shutil.which(CXX) and shutil.which("bash") else f"no C++ compiler ({CXX}) or bash here"


@pytest.fixture(scope="module")
def budget_run(tmp_path_factory) -> Tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("wire_budget")
    env = dict(os.environ, NVRAR_WIRE_BUDGET_OUT=str(out))
    r = subprocess.run(["bash", str(SCRIPT), "--only", "wire_budget", "--seed", "17"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr[-20000:])
    return r, out


def _protocols(led: Mapping[str, Any]) -> Tuple[str, ...]:
    return tuple(s["protocol"] for s in led["plan"]["inter_steps"])


def _plan_key(led: Mapping[str, Any]) -> Tuple[str, Tuple[str, ...]]:
    return led["plan"]["algorithm"], _protocols(led)


@pytest.mark.skipif(bool(missing), reason=missing or "ok")
def test_wire_budget_nine_cells_pass_in_the_emulation(budget_run):
    r, out = budget_run
    lines = r.stdout.strip().splitlines()
    assert lines, f"emulate.sh printed nothing (exit {r.returncode}): {r.stderr[-2000:]}"
    m = LAST.match(lines[-1])
    assert m, f"unexpected last line {lines[-1]!r}"
    fails = [line for line in lines if line.startswith("FAIL") or ": FAIL" in line]
    assert r.returncode == 0 and int(m.group(2)) == 0 and int(m.group(1)) == 9, fails
    assert sorted(os.listdir(out)) == sorted(f"{n}x{g}-{s >> 10}K.json" for n, g in LAYOUTS for s in SIZES)


def _check_rules(led: Mapping[str, Any]) -> List[str]:
    """The budget's rules, from the ledger's JSON alone (the driver checks them too)."""
    broken: List[str] = []
    plan = led["plan"]
    channels = plan["channels"]
    if channels is None or not 1 <= channels <= settings.GPU_MAX_CHANNELS:
        broken.append(f"channels {channels!r} not configured from GPU_LAUNCH")
    G, size = led["gpus_per_node"], led["size"]
    one_shot = plan["algorithm"] == "one-shot"
    per_step = size if one_shot else size / G
    allowed = 0.0
    for s in led["steps"]:
        m = s["max"]
        where = f"chunk {s['chunk']} {s['phase']} step {s['step']}"
        if m["release_chain_max"] > 1:
            broken.append(f"{where}: {m['release_chain_max']} release stores in a row from one thread")
        if s["phase"] != "inter_node":
            continue
        for k in ("fences", "quiets", "proxy_fences_ibgda", "proxy_fences_ibrc", "signal_ops", "remote_atomics",
                  "fences_before_data", "signal_ops_before_data"):
            if m[k]:
                broken.append(f"{where}: {k} {m[k]}")
        if m["messages_max_per_peer"] > (channels or 0):
            broken.append(f"{where}: {m['messages_max_per_peer']} messages to one peer, channels {channels}")
        allowed += per_step * (2.1 if s["protocol"] == "ll" else 1.05)
    most = max(pe["inter_node_bytes"] for pe in led["call"]["per_pe"])
    if most > allowed:
        broken.append(f"inter-node bytes {most} per PE over the allowed {allowed:.0f}")
    return broken


def _candidates(cell: str) -> Dict[Tuple[str, Tuple[str, ...]], Dict[str, Any]]:
    found: Dict[Tuple[str, Tuple[str, ...]], Dict[str, Any]] = {}
    for f in sorted(glob.glob(str(CANDIDATES / f"{cell}-*-*.json"))):
        if "-channels-" in f:
            continue
        led = wire.load_ledger(f)
        found[_plan_key(led)] = led
    return found


@pytest.mark.skipif(bool(missing), reason=missing or "ok")
@pytest.mark.parametrize("nodes,gpus", LAYOUTS)
@pytest.mark.parametrize("size", SIZES)
def test_wire_budget_rules_and_the_models_fastest_plan(budget_run, nodes, gpus, size, monkeypatch):
    r, out = budget_run
    path = out / f"{nodes}x{gpus}-{size >> 10}K.json"
    assert path.exists(), f"the wire_budget run wrote no ledger {path.name} (exit {r.returncode})"
    led = wire.load_ledger(str(path))
    assert (led["nodes"], led["gpus_per_node"], led["size"], led["dtype"]) == (nodes, gpus, size, "bfloat16")
    # The plan is the defaults' (read by emulate.sh from nvrar.settings, never copied).
    for name in list(os.environ):
        if name.startswith("NVRAR_"):
            monkeypatch.delenv(name)
    st = env.resolve("cuda")
    expect_alg = "one-shot" if size <= st.oneshot_max(gpus, nodes) else "two-shot"
    assert led["plan"]["algorithm"] == expect_alg
    assert led["plan"]["channels"] == settings.GPU_LAUNCH["channels"]
    assert led["plan"]["ll_max_bytes"] == settings.LL_MAX_BYTES["cuda"]
    broken = _check_rules(led)
    assert not broken, broken
    # The model's fastest plan among the candidates (the fresh ledger stands for its own plan).
    cell = f"{nodes}x{gpus}-{SIZE_NAMES[size]}"
    cands = _candidates(cell)
    assert len(cands) >= 3, f"too few candidate ledgers for {cell} under {CANDIDATES} (scripts/wire_candidates.sh)"
    chosen = _plan_key(led)
    assert chosen in cands, f"no candidate ledger of the defaults' plan {chosen} for {cell}"
    # The committed candidate of the chosen plan must still be what the device code sends (stale
    # candidates are regenerated with scripts/wire_candidates.sh).
    fresh_us = wire.price(led, WIRE)["total_us"]
    committed_us = wire.price(cands[chosen], WIRE)["total_us"]
    assert committed_us == pytest.approx(fresh_us, rel=0.02), (
        f"{cell}: the committed candidate of {chosen} prices {committed_us:.2f} us, the fresh ledger "
        f"{fresh_us:.2f} us: regenerate docs/gpu/ledgers/candidates (scripts/wire_candidates.sh)")
    cands[chosen] = led
    priced = sorted((wire.price(c, WIRE)["total_us"], k) for k, c in cands.items())
    print(f"{cell}: defaults {chosen[0]} {'/'.join(chosen[1])} {fresh_us:.2f} us; model ({WIRE}) fastest "
          f"{priced[0][1][0]} {'/'.join(priced[0][1][1])} {priced[0][0]:.2f} us; all: "
          + ", ".join(f"{k[0]} {'/'.join(k[1])} {us:.2f}" for us, k in priced) + f" ({wire.DECISION_NOTE})")
    assert fresh_us <= priced[0][0] + 1e-9, (
        f"{cell}: the defaults chose {chosen}, the model under {WIRE} prices {priced[0][1]} faster "
        f"({priced[0][0]:.2f} vs {fresh_us:.2f} us)")


def test_wire_budget_candidates_cover_every_cell_and_plan():
    # Every cell has the four candidate plans (one-shot / two-shot x put-with-signal / LL), each a
    # ledger of that cell with the plan its name says.
    for nodes, gpus in LAYOUTS:
        for size in SIZES:
            cell = f"{nodes}x{gpus}-{SIZE_NAMES[size]}"
            for alg in ("one-shot", "two-shot"):
                for proto in ("put_signal", "ll"):
                    f = CANDIDATES / f"{cell}-{alg}-{proto}.json"
                    assert f.exists(), f"missing candidate {f.name} (scripts/wire_candidates.sh)"
                    led = json.loads(f.read_text())
                    assert (led["nodes"], led["gpus_per_node"], led["size"]) == (nodes, gpus, size), f.name
                    assert led["plan"]["algorithm"] == alg, f.name
                    assert set(_protocols(led)) == {proto}, f.name


def test_wire_budget_defaults_are_the_models_choice_in_every_candidate_cell():
    # scripts/wire_choices.py: in every cell of docs/gpu/ledgers/candidates (16 KB-2 MB on 2x4, 2x8,
    # 4x2, 4x4) the plan nvrar.settings' defaults choose is the one h100-ndr-ibgda prices fastest.
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "wire_choices.py"), "--wire", WIRE], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    sys.stdout.write(r.stdout)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and not line.startswith("| size")]
    assert len(rows) >= 21, r.stdout
    assert not [row for row in rows if row.rstrip().endswith("| NO |")], r.stdout
    m = re.search(r"^# (\d+) cells, the defaults' plan the model's fastest in (\d+)$", r.stdout, re.M)
    assert m and m.group(1) == m.group(2) == str(len(rows)), r.stdout
