"""Tests of nvrar.model: volumes, counts, latency model, fit and the plan/model/fit CLI.

Expected numbers are computed by hand (literals, or arithmetic written out here independently of
the implementation), not read back from the code under test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from nvrar.model import (
    CARDS,
    PARAMS,
    PROFILES,
    Profile,
    allreduce_calls,
    fit,
    get_card,
    hybrid_volume,
    make_plan,
    message_bytes,
    nccl_terms,
    observations_from_bench,
    pp_volume,
    predict,
    tp_volume,
)
from nvrar.model.anchors import residuals
from nvrar.model.cli import parse_size
from nvrar.model.latency import evaluate, flat_rd_terms, nvrar_terms
from nvrar.model.volume import stage_layers

ROOT = Path(__file__).resolve().parents[1]
KB, MB = 1024, 1024 * 1024

# --- volumes and counts -------------------------------------------------------------------------


def test_allreduce_counts_l32():
    # 2L+1 = 65 per forward pass; decode: 65 * (128 - 1) = 8255.
    assert allreduce_calls(32, 128, tp=8) == {"prefill": 65, "decode": 8255}
    assert allreduce_calls(32, 1, tp=2) == {"prefill": 65, "decode": 0}
    assert allreduce_calls(32, 128, tp=1) == {"prefill": 0, "decode": 0}


def test_tp_volume_closed_form_by_hand():
    # L=32, h=4096, v=128256, Sp=Sd=128, b=2, t=4:
    # (65 * 255 * 4096 * 2) * 2*3/4 = 135_782_400 * 1.5 = 203_673_600
    # logits: 128 * (128256 / 4) * 2 = 8_208_384
    assert tp_volume(32, 4096, 128256, 128, 128, tp=4) == 211_881_984
    # t = 1: one rank, nothing crosses a link (no all-reduce, no logits gather).
    assert tp_volume(32, 4096, 128256, 128, 128, tp=1) == 0


def test_pp_volume_closed_form_by_hand():
    # (4-1) * 2 * 255 * 4096 * 2 = 12_533_760
    assert pp_volume(4096, 128, 128, pp=4) == 12_533_760
    assert pp_volume(4096, 128, 128, pp=1) == 0


def _hybrid_by_simulation(layers, hidden, vocab, sp, sd, t, p, b):
    """Walk the pipeline token by token and add up what one chain of ranks sends."""
    per_stage = [layers // p + (1 if i < layers % p else 0) for i in range(p)]
    sent = 0.0
    for _ in range(sp + sd - 1):
        for stage, n in enumerate(per_stage):
            calls = 2 * n + (1 if stage == 0 else 0)
            sent += calls * 2 * (t - 1) / t * hidden * b  # ring all-reduce, per rank
            if stage + 1 < p:
                sent += 2 * hidden * b / t  # my slice of hidden state + residual
                sent += (t - 1) / t * 2 * hidden * b  # next stage's all-gather, per rank
    if t > 1:
        sent += sd * vocab / t * b  # logits gather in the last stage's TP group
    return sent


@pytest.mark.parametrize("t,p", [(1, 1), (2, 1), (1, 3), (4, 2), (8, 5), (3, 7)])
def test_hybrid_matches_simulation(t, p):
    card = get_card("llama-2-13b")
    got = hybrid_volume(card.layers, card.hidden, card.vocab, 17, 9, t, p, 2).total
    want = _hybrid_by_simulation(card.layers, card.hidden, card.vocab, 17, 9, t, p, 2)
    assert got == pytest.approx(want, rel=1e-12)


def test_hybrid_reduces_to_tp_and_pp():
    card = get_card("llama-3.1-70b")
    args = (card.layers, card.hidden, card.vocab, 512, 64)
    for t in (1, 2, 4, 8):
        assert hybrid_volume(*args, tp=t, pp=1).total == pytest.approx(tp_volume(*args, tp=t))
    for p in (1, 2, 4, 8):
        assert hybrid_volume(*args, tp=1, pp=p).total == pytest.approx(
            pp_volume(card.hidden, 512, 64, p))
        assert hybrid_volume(*args, tp=1, pp=p).logits == 0


def test_pp_volume_independent_of_t_and_tp_grows_with_t():
    card = get_card("llama-3.1-8b")
    args = (card.layers, card.hidden, card.vocab, 128, 128)
    stage_traffic = [
        hybrid_volume(*args, tp=t, pp=4).p2p + hybrid_volume(*args, tp=t, pp=4).allgather
        for t in (1, 2, 4, 8, 16)
    ]
    assert stage_traffic == pytest.approx([pp_volume(card.hidden, 128, 128, 4)] * 5)
    tp = [tp_volume(*args, tp=t) for t in (1, 2, 4, 8, 16)]
    assert all(a < b for a, b in zip(tp, tp[1:]))


# The published closed forms (arXiv 2507.14392; docs/planner.md), written out here with exact
# fractions, independently of nvrar.model.volume.
def _closed_v_tp(L, h, v, sp, sd, t, b):
    if t == 1:
        return Fraction(0)
    s = sp + sd - 1
    return (2 * L + 1) * s * h * b * Fraction(2 * (t - 1), t) + sd * Fraction(v, t) * b


def _closed_v_pp(h, sp, sd, p, b):
    return (p - 1) * 2 * (sp + sd - 1) * h * b


def _closed_v_hyb(L, h, v, sp, sd, t, p, b):
    s = sp + sd - 1
    allreduce = (2 * L + 1) * s * h * b * Fraction(2 * (t - 1), t)
    handoff = (p - 1) * s * 2 * h * b * Fraction(1, t)  # my 1/t slice to the next stage
    allgather = (p - 1) * s * 2 * h * b * Fraction(t - 1, t)  # the next stage rebuilds it
    logits = sd * Fraction(v, t) * b if t > 1 else Fraction(0)
    return allreduce + handoff + allgather + logits


_TP_GRID = [(t, 1) for t in (2, 3, 4, 8, 16)]
_PP_GRID = [(1, p) for p in (1, 2, 3, 4, 8)]
_HYBRID_GRID = [(2, 2), (4, 2), (8, 2), (2, 4), (8, 4), (16, 2), (3, 5)]
_LENGTHS = [(128, 128), (1024, 256), (1, 1), (17, 9)]


@pytest.mark.parametrize("t,p", _TP_GRID + _PP_GRID + _HYBRID_GRID)
def test_plan_volume_matches_closed_forms(t, p):
    for card in CARDS.values():
        L, h, v = card.layers, card.hidden, card.vocab
        for sp, sd in _LENGTHS:
            for b in (2, 4):
                plan = make_plan(card, tp=t, pp=p, prompt=sp, decode=sd, bytes_per_elem=b)
                got = plan["volume_bytes"]
                want = _closed_v_hyb(L, h, v, sp, sd, t, p, b)
                assert got == pytest.approx(float(want), rel=1e-12, abs=0), (card.name, sp, sd, b)
                if p == 1:
                    assert got == pytest.approx(float(_closed_v_tp(L, h, v, sp, sd, t, b)),
                                                rel=1e-12, abs=0)
                if t == 1:
                    assert got == _closed_v_pp(h, sp, sd, p, b)
                    assert plan["volume_breakdown_bytes"]["logits"] == 0
                    assert plan["volume_breakdown_bytes"]["allgather"] == 0
                else:
                    assert plan["volume_breakdown_bytes"]["logits"] == pytest.approx(
                        sd * v / t * b, rel=1e-12)


def test_cli_plan_pure_pp_has_no_logits_gather():
    out = json.loads(_cli("plan", "--model", "llama-3.1-8b", "--tp", "1", "--pp", "4",
                          "--prompt", "128", "--decode", "128", "--json").stdout)
    # V_pp = (p-1) * 2 * (Sp+Sd-1) * h * b = 3 * 2 * 255 * 4096 * 2
    assert out["volume_bytes"] == 12_533_760
    assert out["volume_breakdown_bytes"]["logits"] == 0
    assert out["allreduce_calls"] == {"prefill": 0, "decode": 0}


def test_message_bytes_and_stage_layers():
    assert message_bytes(4096, 2, batch=8, tokens=1) == 65_536
    assert message_bytes(4096, 2, batch=8, tokens=128) == 8_388_608
    assert stage_layers(126, 4) == [32, 32, 31, 31]
    with pytest.raises(ValueError, match="pp=5"):
        stage_layers(4, 5)
    with pytest.raises(ValueError, match="prompt"):
        hybrid_volume(32, 4096, 128256, 0, 4)


def test_model_cards_cite_config_json():
    assert set(CARDS) == {"llama-3.2-3b", "llama-3.1-8b", "llama-2-13b", "llama-3.1-70b",
                          "llama-3.1-405b"}
    for card in CARDS.values():
        assert card.source.startswith("https://huggingface.co/")
        assert card.source.endswith("/config.json")
        assert card.heads % card.kv_heads == 0 and card.hidden % card.heads == 0
    with pytest.raises(KeyError, match="llama-3.1-8b"):
        get_card("gpt-5")


def test_plan_counts_and_stage_split():
    plan = make_plan(get_card("llama-3.1-8b"), tp=4, pp=2, prompt=128, decode=128, batch=4)
    assert plan["allreduce_calls"] == {"prefill": 65, "decode": 8255}
    assert plan["allreduce_calls_per_stage"] == [33, 32]
    assert plan["p2p_calls"] == {"prefill": 1, "decode": 127}
    assert plan["message_bytes"] == {"prefill": 4 * 128 * 4096 * 2, "decode": 4 * 4096 * 2}


# --- latency model ------------------------------------------------------------------------------

# Round numbers so that the expected latencies can be worked out by hand.
# GB/s -> B/us: x 1e3. nvl 100 GB/s = 1e5 B/us, hbm 1000 GB/s = 1e6 B/us, net 10 GB/s = 1e4 B/us.
TOY = Profile(
    name="toy", description="hand-checkable", gpus_per_node=4, nics_per_node=4,
    nvrar_overhead_us=10.0, nvl_alpha_us=1.0, nvl_bw_GBps=100.0, hbm_bw_GBps=1000.0,
    net_ll_alpha_us=5.0, net_signal_alpha_us=8.0, net_bw_GBps=10.0,
    nccl_base_us=5.0, nccl_nvl_alpha_us=0.5, nccl_ring_net_alpha_us=10.0,
    nccl_tree_net_alpha_us=20.0, nccl_ring_bw_GBps=20.0, nccl_tree_bw_GBps=10.0,
    nccl_intra_bw_GBps=50.0,
)
M = 1_000_000  # bytes; shard on 4 GPUs = 250_000


@pytest.mark.parametrize("nodes,variant,transport,want", [
    # overhead 10 + stage-in 2 + two NVLink phases 2 + 2*3*250000/1e5 = 15 + RS reduce 0.5
    # + 2 RD steps * (8 + 25) = 66 + 2 reduces * 0.75 = 1.5
    (4, "two_shot", "signal", 97.0),
    # LL: each step 5 + 2 * 25 = 55
    (4, "two_shot", "ll", 141.0),
    # N = 3: one exchange + fold-in + fold-out = 3 steps of 33, 2 reduces
    (3, "two_shot", "signal", 130.0),
    # one-shot: 10 + 2 + phase 1 + 3e6/1e5 = 30 + reduce 2 + 2 steps * (8 + 100) + 2 * 3 = 6
    (4, "one_shot", "signal", 267.0),
    # single node: 10 + 2 + 2 + 15 + 0.5
    (1, "two_shot", "ll", 29.5),
])
def test_nvrar_cost_by_hand(nodes, variant, transport, want):
    got = evaluate(nvrar_terms(M, nodes, 4, TOY, variant, transport), TOY)
    assert got == pytest.approx(want, rel=1e-9)


def test_nic_sharing_scales_network_bytes():
    # 8 GPUs on 4 NICs: every rank gets half a NIC, so the 2 RD steps of 125000-byte shards cost
    # 2 * (8 + 2 * 12.5) instead of 2 * (8 + 12.5).
    shared = evaluate(nvrar_terms(M, 4, 8, TOY, "two_shot", "signal"), TOY)
    alone = evaluate(nvrar_terms(M, 4, 8, TOY.updated(nics_per_node=8), "two_shot", "signal"), TOY)
    assert shared - alone == pytest.approx(25.0)


def test_nccl_and_flat_rd_by_hand():
    # ring, 2 x 4: 5 + (14 - 2) * 1.8 * 0.5 + 2 * 10 + (14/8) * 1e6 / 2e4 = 5 + 10.8 + 20 + 87.5
    assert evaluate(nccl_terms(M, 2, 4, "ring"), TOY) == pytest.approx(123.3)
    # tree, 8 x 4: 5 + 2 * (3 * 1.8 * 0.5 + 3 * 20) + 2e6 / 1e4
    assert evaluate(nccl_terms(M, 8, 4, "tree"), TOY) == pytest.approx(330.4)
    # ring, 1 x 8: 5 + 14 * 0.5 + (14/8) * 1e6 / 5e4
    assert evaluate(nccl_terms(M, 1, 8, "ring"), TOY) == pytest.approx(47.0)
    # flat RD, 2 x 4 = 8 ranks: 10 + 2 + 2 NVLink steps * (1 + 10) + 1 net step (8 + 100)
    # + 3 reduces * 3
    assert evaluate(flat_rd_terms(M, 2, 4, TOY, "signal"), TOY) == pytest.approx(151.0)


@pytest.mark.parametrize("profile", sorted(PROFILES))
@pytest.mark.parametrize("nodes,gpus", [(1, 4), (2, 4), (3, 8), (16, 4), (5, 1)])
def test_latency_increases_with_size(profile, nodes, gpus):
    sizes = [1 << k for k in range(10, 26)]
    preds = [predict(s, nodes, gpus, PROFILES[profile])["predicted_us"] for s in sizes]
    for key in preds[0]:
        series = [p[key] for p in preds]
        assert all(a < b for a, b in zip(series, series[1:])), key


@pytest.mark.parametrize("nodes", [2, 4, 8, 16])
@pytest.mark.parametrize("size", [128 * KB, 256 * KB, 512 * KB, 1 * MB, 2 * MB])
def test_nvrar_beats_nccl_ring_on_perlmutter(nodes, size):
    pred = predict(size, nodes, 4, PROFILES["perlmutter"])
    assert pred["predicted_us"]["nvrar"] < pred["predicted_us"]["nccl_ring"]
    assert pred["speedup_vs_nccl"] > 1.0


def test_profiles_document_every_parameter():
    for profile in PROFILES.values():
        for name in PARAMS:
            assert getattr(profile, name) > 0, (profile.name, name)
            assert profile.sources.get(name), (profile.name, name)


@pytest.mark.parametrize("profile", ["perlmutter", "h100-ndr400"])
def test_profiles_match_their_anchors(profile):
    rows = [r for r in residuals(PROFILES[profile]) if r["calibrated"]]
    assert len(rows) >= 3
    for r in rows:
        assert abs(r["rel_error"]) < 0.30, r


# --- fit ----------------------------------------------------------------------------------------

TRUTH = PROFILES["perlmutter"].updated(
    nvrar_overhead_us=4.0, net_ll_alpha_us=12.0, net_signal_alpha_us=9.0, net_bw_GBps=20.0,
    nccl_ring_net_alpha_us=8.0, nccl_tree_net_alpha_us=30.0, nccl_ring_bw_GBps=15.0,
    nccl_tree_bw_GBps=25.0,
)
LAYOUTS = [(1, 4), (2, 4), (3, 4), (4, 4), (8, 4), (4, 1), (8, 1)]
SIZES = [8 * KB, 32 * KB, 128 * KB, 512 * KB, 2 * MB]


def _bench_doc(nodes, gpus, profile, algorithms):
    results = []
    for size in SIZES:
        pred = predict(size, nodes, gpus, profile)["predicted_us"]
        for backend, algorithm, key in algorithms:
            results.append({"backend": backend, "algorithm": algorithm, "bytes": size,
                            "count": size // 2, "dtype": "bf16", "op": "sum",
                            "median_us": pred[key], "p99_us": pred[key], "min_us": pred[key],
                            "algbw_gbps": 0.0, "busbw_gbps": 0.0, "wrong": 0})
    results.append({"backend": "mpi", "algorithm": "default", "bytes": 4096, "median_us": 1.0,
                    "wrong": 0})
    results.append({"backend": "nvrar", "algorithm": "two_shot_ll", "bytes": 4096,
                    "median_us": 1e6, "wrong": 3})
    return {"meta": {"world_size": nodes * gpus, "ranks_per_node": gpus, "hardware": "synthetic"},
            "results": results}


ALL_ALGOS = [("nvrar", "two_shot_ll", "nvrar_two_shot_ll"),
             ("nvrar", "two_shot_signal", "nvrar_two_shot_signal"),
             ("nvrar", "one_shot_ll", "nvrar_one_shot_ll"),
             ("nccl", "ring", "nccl_ring"), ("nccl", "tree", "nccl_tree"),
             ("nccl", "auto", "nccl")]


def test_fit_recovers_known_parameters():
    obs = [o for n, g in LAYOUTS for o in observations_from_bench(_bench_doc(n, g, TRUTH, ALL_ALGOS))]
    result = fit(obs, PROFILES["perlmutter"], fix=["hbm_bw_GBps"], prior_weight=1e-4)
    for name in ("nvrar_overhead_us", "nvl_alpha_us", "net_ll_alpha_us", "net_signal_alpha_us",
                 "net_bw_GBps", "nccl_ring_net_alpha_us", "nccl_tree_net_alpha_us",
                 "nccl_ring_bw_GBps", "nccl_tree_bw_GBps"):
        assert getattr(result.profile, name) == pytest.approx(getattr(TRUTH, name), rel=0.02), name
    assert result.rms_rel_error < 1e-3
    assert "hbm_bw_GBps" not in result.fitted


def test_fit_with_one_backend_leaves_the_other_alone():
    algos = [("nccl", "auto", "nccl")]
    obs = [o for n, g in LAYOUTS for o in observations_from_bench(_bench_doc(n, g, TRUTH, algos))]
    assert {o.backend for o in obs} == {"nccl"}
    start = PROFILES["perlmutter"]
    result = fit(obs, start)
    assert all(name.startswith("nccl_") for name in result.fitted)
    assert result.profile.net_ll_alpha_us == start.net_ll_alpha_us
    assert result.profile.nccl_ring_bw_GBps == pytest.approx(TRUTH.nccl_ring_bw_GBps, rel=0.05)
    with pytest.raises(ValueError, match="no usable rows"):
        fit([], start)


# --- command line -------------------------------------------------------------------------------

def _cli(*args, check=True):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "nvrar.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_parse_size():
    assert parse_size("128K") == 131072
    assert parse_size("2M") == 2097152
    assert parse_size("1048576") == 1048576
    assert parse_size("512KiB") == 524288
    assert parse_size("1.5M") == 1572864
    with pytest.raises(Exception, match="not a size"):
        parse_size("12Q")


def test_cli_plan_json():
    out = json.loads(_cli("plan", "--model", "llama-3.1-8b", "--tp", "8", "--pp", "2",
                          "--prompt", "128", "--decode", "128", "--batch", "4",
                          "--profile", "perlmutter", "--nodes", "4", "--gpus-per-node", "4",
                          "--json").stdout)
    assert out["allreduce_calls"] == {"prefill": 65, "decode": 8255}
    # (65 * 255 * 4096 * 2) * 2*7/8 + 1 * 2 * 255 * 4096 * 2 + 128 * (128256 / 8) * 2
    assert out["volume_bytes"] == pytest.approx(237_619_200 + 4_177_920 + 4_104_192)
    assert out["layout"]["tp_nodes"] == 2 and out["layout"]["tp_gpus_per_node"] == 4
    tok = out["comm_us_per_token"]
    assert 0 < tok["nvrar"] < tok["nccl"]


def test_cli_plan_text_and_errors():
    text = _cli("plan", "--model", "llama-3.2-3b", "--tp", "4", "--prompt", "64",
                "--decode", "8").stdout
    assert "prefill 57, decode 399" in text
    bad = _cli("plan", "--model", "llama-3.2-3b", "--tp", "3", "--prompt", "64", "--decode", "8",
               "--profile", "perlmutter", check=False)
    assert bad.returncode == 2 and "does not tile" in bad.stderr


def test_cli_model_json_and_plot(tmp_path):
    out = json.loads(_cli("model", "--profile", "perlmutter", "--nodes", "2",
                          "--gpus-per-node", "4", "--bytes", "128K", "--json").stdout)
    assert out["bytes"] == 131072
    assert {"nvrar", "nccl_ring", "nccl_tree", "flat_rd"} <= set(out["predicted_us"])
    assert out["predicted_us"]["nvrar"] < out["predicted_us"]["nccl_ring"]
    pytest.importorskip("matplotlib")
    plot = tmp_path / "lat.png"
    _cli("model", "--profile", "h200", "--nodes", "4", "--bytes", "1M", "--plot", str(plot))
    assert plot.stat().st_size > 1000


def test_cli_fit_roundtrip(tmp_path):
    files = []
    for n, g in LAYOUTS:
        path = tmp_path / f"bench_{n}x{g}.json"
        path.write_text(json.dumps(_bench_doc(n, g, TRUTH, ALL_ALGOS)))
        files.append(str(path))
    fitted = tmp_path / "fitted.json"
    out = json.loads(_cli("fit", *files, "--profile", "perlmutter", "--fix", "hbm_bw_GBps",
                          "-o", str(fitted), "--json").stdout)
    assert out["profile"]["net_bw_GBps"] == pytest.approx(TRUTH.net_bw_GBps, rel=0.05)
    pred = json.loads(_cli("model", "--profile", str(fitted), "--nodes", "4", "--bytes", "512K",
                           "--json").stdout)
    want = predict(512 * KB, 4, 4, TRUTH)["predicted_us"]["nccl_ring"]
    assert pred["predicted_us"]["nccl_ring"] == pytest.approx(want, rel=0.02)


def test_cli_table_and_anchors():
    table = json.loads(_cli("model", "--profile", "perlmutter", "--table", "--json").stdout)["table"]
    assert set(table) == {"128K", "256K", "512K", "1M", "2M"}
    assert set(table["1M"]) == {"2", "4", "8", "16"}
    cell = table["1M"]["4"]
    assert cell["ratio"] == pytest.approx(cell["nccl_us"] / cell["nvrar_us"])
    anchors = json.loads(_cli("model", "--profile", "perlmutter", "--anchors", "--json").stdout)
    assert any(r["key"] == "nvrar_two_shot_ll" for r in anchors["anchors"])
    missing = _cli("model", "--profile", "perlmutter", "--nodes", "2", check=False)
    assert missing.returncode == 2 and "--bytes" in missing.stderr
