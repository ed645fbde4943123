"""Tests of nvrar.model.wire: the wire ledger's cost model, its extrapolation rule and its CLI.

Expected numbers are written out by hand from the formula in docs/gpu/wire-model.md (literals and
arithmetic here), not read back from the code under test.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from nvrar.model import PROFILES
from nvrar.model import cli as model_cli
from nvrar.model import wire
from nvrar.model.wire import COUNTERS, WIRES

ROOT = Path(__file__).resolve().parents[1]
KB = 1024
LEDGER_DIR = ROOT / "docs" / "gpu" / "ledgers"


def _counters(**values: int) -> Dict[str, int]:
    unknown = set(values) - set(COUNTERS)
    assert not unknown, unknown
    return {k: values.get(k, 0) for k in COUNTERS}


def _ledger(nodes: int, gpus: int, size: int, inter: Dict[str, int], *, algorithm: str = "two-shot",
            protocol: str = "put_signal", chain: int = 0, chunks: int = 1,
            channels: Optional[int] = None) -> Dict[str, Any]:
    """A hand-made ledger as the emulation writes one: per chunk stage_in (two-shot; one_shot for
    one-shot) holding the ready flags' release stores, the inter-node steps of recursive doubling
    (each with counters ``inter``), all_gather (two-shot) holding the final flags' stores."""
    kinds = wire.inter_node_steps(nodes)
    chunk_bytes = size // chunks
    payload = chunk_bytes // gpus if algorithm == "two-shot" else chunk_bytes
    steps: List[Dict[str, Any]] = []
    for c in range(chunks):
        first = "stage_in" if algorithm == "two-shot" else "one_shot"
        steps.append({"chunk": c, "phase": first, "step": 0, "protocol": None,
                      "max": _counters(release_chain_max=chain), "per_pe": []})
        for i, _ in enumerate(kinds):
            steps.append({"chunk": c, "phase": "inter_node", "step": i, "protocol": protocol,
                          "max": _counters(**inter), "per_pe": []})
        if algorithm == "two-shot":
            steps.append({"chunk": c, "phase": "all_gather", "step": 0, "protocol": None,
                          "max": _counters(release_chain_max=chain), "per_pe": []})
    return {
        "schema": "nvrar.wire-ledger/1", "kernel": "hand-made", "layout": f"{nodes}x{gpus}",
        "nodes": nodes, "gpus_per_node": gpus, "pes": nodes * gpus, "size": size, "dtype": "float32",
        "threads": 32,
        "plan": {"algorithm": algorithm, "chunks": chunks, "blocks": 4, "chunk_bytes": chunk_bytes,
                 "max_bytes": size, "pool_bytes": size, "channels": channels, "ll_max_bytes": 32 * KB,
                 "oneshot_max": 256 * KB,
                 "inter_steps": [{"step": i, "kind": k, "protocol": protocol, "payload_bytes": payload}
                                 for i, k in enumerate(kinds)]},
        "steps": steps, "call": {"max": _counters(), "per_pe": []}, "abort": None,
    }


# Today's kind of inter-node step on 2x4 at 128 KB, four blocks: per block four signal ops and a
# fence before one put-with-signal (libfabric inserts a proxy fence in each), 32 KB shard + descriptions;
# the ledger counts per PE, summed over its blocks.
OLD_STEP = dict(messages_max_per_peer=4, put_signals=4, signal_ops=16, fences=4, fences_before_data=4,
                signal_ops_before_data=16, proxy_fences_libfabric=4, consistency_waits=4,
                inter_node_bytes=32768 + 128)


def test_price_ibgda_by_hand():
    led = _ledger(2, 4, 128 * KB, OLD_STEP, chain=3)
    got = wire.price(led, "h100-ndr-ibgda")
    # in-node phase (h100-ndr400: nvl_alpha 1.0 us, NVLink 370 GB/s): alpha + (chain - 1) x 1.0
    # + (G-1)/G x 128 KB over NVLink
    in_node = 1.0 + 2 * 1.0 + (3 / 4 * 131072) / 370e3
    # stage-in: 3/4 of the chunk copied (read + write) at 3350 GB/s
    stage = 2 * (3 / 4 * 131072) / 3350e3
    # inter-node: each of the 4 sending blocks: 1 fence x 5.0 + 4 atomics x 5.0, in parallel; 4 posts to
    # the peer x 0.3 + bytes / 47 GB/s (4 GPUs, 8 NICs: no sharing) + one way 2.5 + the puts' signal,
    # an atomic the target NIC runs after the data (1.0, once: the messages go in parallel); no
    # consistency step
    inter = 1 * 5.0 + 4 * 5.0 + 4 * 0.3 + 32896 / 47e3 + 2.5 + 1.0
    assert got["total_us"] == pytest.approx(2.6 + stage + 2 * in_node + inter, rel=1e-12)
    steps = {s["phase"]: s for s in got["steps"]}
    assert steps["inter_node"]["terms"]["signal_ops_before_data"] == pytest.approx(20.0)
    assert steps["inter_node"]["terms"]["signal_atomic"] == pytest.approx(1.0)
    assert steps["inter_node"]["us"] == pytest.approx(inter, rel=1e-12)
    assert got["by_phase_us"]["reduce_scatter"] == pytest.approx(in_node, rel=1e-12)
    assert "never a result" in got["note"]


def test_price_proxy_transports_by_hand():
    led = _ledger(2, 4, 128 * KB, OLD_STEP, chain=1)
    in_slingshot = 1.0 + 0 + (3 / 4 * 131072) / 300e3  # perlmutter NVLink3 300 GB/s
    # libfabric: commands 4 put_signals + 16 signal ops + 4 fences + 4 proxy fences = 28 x 1.0;
    # each fence is a quiet (8.0) and each inserted proxy fence too; 4 GPUs on 4 NICs at 12.9 GB/s
    inter = 28 * 1.0 + 4 * 8.0 + 4 * 8.0 + 32896 / 12.9e3 + 3.0
    stage = 2 * (3 / 4 * 131072) / 1555e3
    got = wire.price(led, "a100-slingshot")
    assert got["total_us"] == pytest.approx(2.6 + stage + 2 * in_slingshot + inter, rel=1e-12)
    # IBRC without gdrcopy: 24 commands (no inserted fence on an ordered RC QP, the fence waits
    # for nothing), 4 consistency steps x 3.0, NDR bytes
    in_h100 = 1.0 + (3 / 4 * 131072) / 370e3
    inter_rc = 24 * 1.0 + 32896 / 47e3 + 2.5 + 4 * 3.0
    stage = 2 * (3 / 4 * 131072) / 3350e3
    assert wire.price(led, "h100-ndr-ibrc")["total_us"] == pytest.approx(2.6 + stage + 2 * in_h100 + inter_rc,
                                                                         rel=1e-12)


def test_price_one_shot_stage_in_and_nic_sharing():
    # 2x8 on a 4-NIC machine (perlmutter): 8 senders share 4 NICs, bytes count twice
    led = _ledger(2, 8, 256 * KB, dict(messages_max_per_peer=1, ll_puts=1, inter_node_bytes=524288),
                  algorithm="one-shot", protocol="ll")
    stage = 2 * 262144 / 1555e3  # copy in: read + write at A100 HBM 1555 GB/s
    one_shot = 1.0 + 7 * 262144 / 300e3  # loads the whole message from 7 peers
    inter = 1 * 1.0 + 524288 * 2 / 12.9e3 + 3.0
    assert wire.price(led, "a100-slingshot")["total_us"] == pytest.approx(2.6 + stage + one_shot + inter,
                                                                          rel=1e-12)


def test_wire_profiles_extend_machine_profiles():
    assert set(WIRES) == {"h100-ndr-ibgda", "h100-ndr-ibrc", "a100-slingshot"}
    assert WIRES["a100-slingshot"].machine == "perlmutter"
    for w in WIRES.values():
        assert w.machine in ("h100-ndr400", "h200") or w.name == "a100-slingshot"
        machine = PROFILES[w.machine]
        assert w.nic_bw_GBps == machine.net_bw_GBps and w.nvl_bw_GBps == machine.nvl_bw_GBps
        assert w.nvl_alpha_us == machine.nvl_alpha_us and w.hbm_bw_GBps == machine.hbm_bw_GBps
        rows = wire.cost_table(w)
        assert len(rows) == 16  # 11 wire costs (signal_atomic_us included), 5 from the machine
        for row in rows:
            assert row["source"], f"{w.name}.{row['name']} has no source"
        # a cost marked as an estimate says so in its source
        assert all(row["estimate"] == row["source"].startswith("estimate") for row in rows[:10])
    assert WIRES["h100-ndr-ibgda"].proxy is False and WIRES["a100-slingshot"].fence_is_quiet
    assert not WIRES["h100-ndr-ibrc"].fence_is_quiet
    with pytest.raises(KeyError, match="unknown wire profile"):
        wire.get_wire("h100-roce")


def test_extrapolation_rule_by_hand():
    assert wire.inter_node_steps(1) == []
    assert wire.inter_node_steps(2) == ["exchange"]
    assert wire.inter_node_steps(3) == ["fold_in", "exchange", "fold_out"]
    assert wire.inter_node_steps(8) == ["exchange"] * 3
    assert wire.inter_node_steps(12) == ["fold_in"] + ["exchange"] * 3 + ["fold_out"]
    assert wire.inter_node_steps(16) == ["exchange"] * 4
    base = _ledger(2, 4, 512 * KB, OLD_STEP, chain=3, chunks=2)
    inter = next(s["us"] for s in wire.price(base, "h100-ndr-ibgda")["steps"] if s["phase"] == "inter_node")
    for nodes, extra in ((4, 1), (8, 2), (16, 3), (6, 3)):
        ext = wire.extrapolate(base, nodes)
        assert ext["layout"] == f"{nodes}x4" and ext["pes"] == 4 * nodes
        assert [k["kind"] for k in ext["plan"]["inter_steps"]] == wire.inter_node_steps(nodes)
        assert sum(s["phase"] == "inter_node" for s in ext["steps"]) == 2 * len(wire.inter_node_steps(nodes))
        # each chunk gains `extra` copies of its exchange step
        want = wire.price(base, "h100-ndr-ibgda")["total_us"] + 2 * extra * inter
        assert wire.price(ext, "h100-ndr-ibgda")["total_us"] == pytest.approx(want, rel=1e-12)
        assert ext["call"]["max"]["signal_ops"] == 2 * len(wire.inter_node_steps(nodes)) * 16
        assert ext["extrapolated_from"]["layout"] == "2x4"
    # the order of phases inside a chunk is kept
    phases = [s["phase"] for s in wire.extrapolate(base, 4)["steps"] if s["chunk"] == 1]
    assert phases == ["stage_in", "inter_node", "inter_node", "all_gather"]
    # a measured fold step is reused for the folds
    three = _ledger(3, 4, 128 * KB, OLD_STEP)
    three["steps"][1]["max"]["inter_node_bytes"] = 7  # the fold-in differs from the exchange
    ext = wire.extrapolate(three, 6)
    assert [s["max"]["inter_node_bytes"] for s in ext["steps"] if s["phase"] == "inter_node"] == \
        [7, 32896, 32896, 32896]


def _emulated(nodes: int, gpus: int) -> List[Dict[str, Any]]:
    return [led for led in wire.load_ledgers(str(LEDGER_DIR / "extrapolation"))
            if led["nodes"] == nodes and led["gpus_per_node"] == gpus]


def test_extrapolation_rule_against_the_8x2_ledger():
    """The rule, applied to the emulated 4x2 (or 2x2) ledger, gives the emulated 8x2 ledger's steps:
    every counter the price uses equal, step by step (sys_fences and device_fences, not priced, are
    attributed to a block's last step and differ)."""
    eight = _emulated(8, 2)
    if not eight:
        pytest.skip(f"no 8x2 wire ledger under {LEDGER_DIR / 'extrapolation'}")
    checked = 0
    for target in eight:
        bases = [b for n in (4, 2) for b in _emulated(n, 2)
                 if b["size"] == target["size"] and b.get("dtype") == target.get("dtype")
                 and b["plan"]["algorithm"] == target["plan"]["algorithm"]]
        if not bases:
            continue
        ext = wire.extrapolate(bases[0], 8)
        def priced(steps: List[Dict[str, Any]]) -> List[Any]:
            return [(s["chunk"], s["phase"], s["step"], s["protocol"],
                     {k: s["max"][k] for k in wire.PRICED_COUNTERS}) for s in steps]

        want, got = priced(target["steps"]), priced(ext["steps"])
        assert got == want, f"{bases[0]['layout']} -> 8x2 at {target['size']} bytes"
        for name in WIRES:
            assert wire.price(ext, name)["total_us"] == pytest.approx(wire.price(target, name)["total_us"])
        checked += 1
    assert checked, "an 8x2 ledger without a 4x2 or 2x2 ledger of the same call to extrapolate from"


# Two plans of one call whose order flips with the transport: A sends one LL message with 4x the
# bytes, B four put-with-signal messages (libfabric fences each).
PLAN_A = dict(messages_max_per_peer=1, ll_puts=1, inter_node_bytes=262144)
PLAN_B = dict(messages_max_per_peer=4, put_signals=4, proxy_fences_libfabric=4, inter_node_bytes=65536)


def test_fastest_picks_the_modelled_fastest_plan():
    a = _ledger(2, 4, 256 * KB, PLAN_A, algorithm="one-shot", protocol="ll")
    b = _ledger(2, 4, 256 * KB, PLAN_B)
    # IBGDA: A = 2.6 + 0.16 + (1 + 3 x 256K / 370e3) + (0.3 + 262144 / 47e3 + 2.5) = 14.3,
    #        B = 2.6 + 0.12 + 2 x (1 + 3/4 x 256K / 370e3) + (1.2 + 65536 / 47e3 + 2.5) = 10.9;
    # Slingshot: A = 2.6 + 0.34 + (1 + 3 x 256K / 300e3) + (1 + 262144 / 12.9e3 + 3) = 30.9,
    #            B = 2.6 + 0.25 + 2 x (1 + 3/4 x 256K / 300e3) + (8 + 32 + 65536 / 12.9e3 + 3) = 54.3
    assert wire.fastest([a, b], wire="h100-ndr-ibgda") is b
    assert wire.fastest([b, a], wire="a100-slingshot") is a
    ranked = wire.rank([a, b], "h100-ndr-ibgda")
    assert [led is b for _, led in ranked] == [True, False] and ranked[0][0] < ranked[1][0]
    assert wire.fastest([a, copy.deepcopy(a)], "h100-ndr-ibgda") is a  # a tie keeps the first
    with pytest.raises(ValueError, match="different calls"):
        wire.fastest([a, _ledger(4, 4, 256 * KB, PLAN_A)], "h100-ndr-ibgda")
    with pytest.raises(ValueError, match="no ledgers"):
        wire.fastest([], "h100-ndr-ibgda")


def test_channels_choice():
    def with_channels(ch: int) -> Dict[str, Any]:
        # each channel is one message per peer; a proxy transport pays a command per message, IBGDA a post
        return _ledger(2, 8, 2048 * KB, dict(messages_max_per_peer=ch, put_signals=ch,
                                             proxy_fences_libfabric=ch, inter_node_bytes=262144),
                       channels=ch)

    ledgers = [with_channels(c) for c in (4, 2, 1)]
    priced = wire.price_channels(ledgers, "a100-slingshot")
    assert sorted(priced) == [1, 2, 4]
    # one more channel on Slingshot: a command for its message and one for its inserted fence
    # (2 x 1.0) plus that fence's wait (8.0)
    assert priced[2] - priced[1] == pytest.approx(10.0) and priced[4] - priced[2] == pytest.approx(20.0)
    assert wire.best_channels(ledgers, "a100-slingshot") == 1
    with pytest.raises(ValueError, match="no plan.channels"):
        wire.price_channels([_ledger(2, 8, 2048 * KB, PLAN_B)], "a100-slingshot")


def test_ledger_for_refuses_duplicates(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.json").write_text(json.dumps(_ledger(2, 4, 128 * KB, OLD_STEP)))
    (tmp_path / "other.json").write_text(json.dumps({"schema": "something-else"}))
    found = wire.load_ledgers(str(tmp_path))
    assert len(found) == 2
    with pytest.raises(ValueError, match="several ledgers for 2x4"):
        wire.ledger_for(found, 2, 4, 128 * KB)
    assert wire.ledger_for(found, 4, 4, 128 * KB) is None
    with pytest.raises(ValueError, match="not a wire ledger"):
        wire.price({"schema": "x"}, "h100-ndr-ibgda")


# --- command line -------------------------------------------------------------------------------

class _Run:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _cli(*args: str, check: bool = True) -> _Run:
    """``nvrar model ARGS`` in this process (the parser and handlers nvrar/cli.py registers)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = model_cli.main(["model", *args])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
            if not isinstance(exc.code, int):
                err.write(str(exc.code))
    run = _Run(code, out.getvalue(), err.getvalue())
    if check:
        assert run.returncode == 0, run.stderr
    return run


def test_cli_entry_point(tmp_path):
    """The installed entry point: python -m nvrar.cli model --ledger FILE --wire NAME."""
    led = _ledger(2, 4, 128 * KB, OLD_STEP, chain=3)
    path = tmp_path / "2x4_128K.json"
    path.write_text(json.dumps(led))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "nvrar.cli", "model", "--ledger", str(path), "--wire",
                           "h100-ndr-ibgda", "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["total_us"] == pytest.approx(wire.price(led, "h100-ndr-ibgda")["total_us"])


def test_cli_prices_a_ledger(tmp_path):
    led = _ledger(2, 4, 128 * KB, OLD_STEP, chain=3)
    path = tmp_path / "2x4_128K.json"
    path.write_text(json.dumps(led))
    out = json.loads(_cli("--ledger", str(path), "--wire", "h100-ndr-ibgda", "--json").stdout)
    assert out["total_us"] == pytest.approx(wire.price(led, "h100-ndr-ibgda")["total_us"])
    assert [s["phase"] for s in out["steps"]] == ["stage_in", "reduce_scatter", "inter_node", "all_gather"]
    text = _cli("--ledger", str(path), "--wire", "a100-slingshot").stdout
    assert "never a result" in text and "proxy_commands 28.00" in text
    ext = json.loads(_cli("--ledger", str(path), "--wire", "a100-slingshot", "--nodes", "8", "--json").stdout)
    assert ext["layout"] == "8x4" and ext["extrapolated_from"]["layout"] == "2x4"
    costs = _cli("--wire", "h100-ndr-ibrc").stdout
    assert "consistency_us" in costs and "h100-ndr400" in costs and "never a result" in costs
    bad = _cli("--ledger", str(path), check=False)
    assert bad.returncode == 2 and "--wire" in bad.stderr
    bad = _cli("--ledger", str(path), "--wire", "nope", check=False)
    assert bad.returncode == 2 and "unknown wire profile" in bad.stderr


def test_cli_wire_table(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    for size in (128 * KB, 1024 * KB):
        (old / f"2x8_{size}.json").write_text(json.dumps(_ledger(2, 8, size, OLD_STEP, chain=7)))
        (new / f"2x8_{size}.json").write_text(json.dumps(
            _ledger(2, 8, size, dict(messages_max_per_peer=1, put_signals=1, inter_node_bytes=size // 8),
                    chain=1)))
    (new / "4x8_128K.json").write_text(json.dumps(
        _ledger(4, 8, 128 * KB, dict(messages_max_per_peer=1, put_signals=1, inter_node_bytes=16384), chain=1)))
    out = json.loads(_cli("--wire-table", "--wire", "h100-ndr-ibgda", "--old-ledgers", str(old),
                          "--new-ledgers", str(new), "--json").stdout)
    assert out["gpus_per_node"] == 8 and "never a result" in out["note"]
    table = out["table"]
    assert set(table) == {str(s * KB) for s in (128, 256, 512, 1024, 2048)}
    assert set(table[str(128 * KB)]) == {"2", "4", "8", "16"}
    c = table[str(128 * KB)]
    assert c["2"]["old"]["how"] == "ledger" and c["4"]["old"]["how"] == "extrapolated from 2x8"
    assert c["4"]["new"]["how"] == "ledger" and c["16"]["new"]["how"] == "extrapolated from 4x8"
    # NCCL: Azure H100 2x8 128 KB is published (50 us), 4 nodes is modelled
    assert c["2"]["nccl"] == {"us": 50.0, "how": "measured", "range": [50, 50], "source": c["2"]["nccl"]["source"]}
    assert c["4"]["nccl"]["how"] == "modelled"
    assert c["2"]["nccl_over_new"] == pytest.approx(50.0 / c["2"]["new"]["us"])
    assert table[str(256 * KB)]["2"]["old"] is None
    text = _cli("--wire-table", "--wire", "a100-slingshot", "--old-ledgers", str(old)).stdout
    assert "never a result" in text and "| 128K | 2x4 | - | - | 55.5 M |" in text
    missing = _cli("--wire-table", "--wire", "a100-slingshot", "--old-ledgers", str(tmp_path / "nope"),
                   check=False)
    assert missing.returncode != 0 and "not a directory" in missing.stderr


def test_alpha_beta_model_keeps_its_meaning():
    # --profile/--table still run the alpha-beta model (tests/test_model.py has the numbers)
    out = json.loads(_cli("--profile", "perlmutter", "--nodes", "2", "--bytes", "128K", "--json").stdout)
    assert out["profile"] == "perlmutter" and "nvrar" in out["predicted_us"]
    assert glob.glob(str(ROOT / "nvrar" / "model" / "wire.py"))


def test_inter_node_byte_floor_by_hand():
    # 3 nodes: fold-in, exchange, fold-out; the busiest PE sends in two of them. Two-shot, 2 chunks
    # of 256 KB over 4 GPUs: 64 KB per sending step -> 2 x 2 x 65536.
    led = _ledger(3, 4, 512 * KB, OLD_STEP, chunks=2, protocol="ll")
    led["call"]["max"]["inter_node_bytes"] = 555
    got = wire.inter_node_byte_floor(led)
    assert got == {"floor": 262144.0, "budget": pytest.approx(262144 * 2.1), "measured": 555}
    # one-shot with put-with-signal on 8 nodes: the whole 128 KB in each of 3 exchanges, 1.05x
    one = wire.inter_node_byte_floor(_ledger(8, 2, 128 * KB, PLAN_B, algorithm="one-shot"))
    assert one["floor"] == 3 * 131072 and one["budget"] == pytest.approx(3 * 131072 * 1.05)
