"""Faults and bad input across real processes: a peer that dies or never arrives, ranks that call
with different signatures, bad arguments, and the jitter mode that shakes the epoch protocol."""

import time

import pytest

from _launch import assert_all_ok, describe, launch


def fault(world, G, victim, mode, timeout, at=3, count=1000):
    t0 = time.monotonic()
    res = launch(world, "fault", {"G": G, "victim": victim, "mode": mode, "timeout": timeout, "at": at,
                                  "count": count}, timeout=timeout * 4 + 60)
    return res, time.monotonic() - t0


def survivors(res, victim):
    reports = [r.report for r in res if r.rank != victim]
    assert all(r is not None for r in reports), describe(res)
    return reports


@pytest.mark.parametrize("world,G,victim", [(4, 2, 3), (3, 1, 1), (5, 1, 4)])
def test_dead_peer_raises_timeout_everywhere(world, G, victim):
    timeout = 10.0
    res, _ = fault(world, G, victim, "die", timeout)
    assert res[victim].returncode == 3
    for rep in survivors(res, victim):
        err = rep.get("error")
        assert err is not None, f"rank {rep['rank']} did not raise: {rep}"
        assert err["is_timeout"], err
        assert rep["elapsed"] < timeout + 5, rep
        for word in ("rank", "phase", "step", "epoch"):
            assert word in err["message"], err["message"]
        assert err["rank"] == rep["rank"] and err["epoch"] >= 4
        assert rep["calls_ok"] == 3  # the calls before the fault were fine
        assert rep["after"]["is_nvrar"]  # a failed communicator stays failed
    print("\n".join(r.report["error"]["message"] for r in res if r.rank != victim))


def test_absent_peer_times_out_within_deadline():
    timeout = 3.0
    res, _ = fault(4, 2, 2, "absent", timeout)
    for rep in survivors(res, 2):
        err = rep["error"]
        assert err["is_timeout"], err
        assert rep["elapsed"] < timeout + 3, rep
        assert err["phase"] in ("reduce-scatter", "inter-node", "all-gather", "one-shot-reduce")
    print("\n".join(r.report["error"]["message"] for r in res if r.rank != 2))


@pytest.mark.parametrize("mode", ["count", "dtype", "op"])
@pytest.mark.parametrize("count", [1000, 100000], ids=["one-shot", "two-shot"])
def test_mismatch_raises_on_every_rank(mode, count):
    timeout = 30.0
    res, elapsed = fault(4, 2, 2, mode, timeout, count=count)
    assert elapsed < timeout, "a mismatch must be detected, not left to the deadline"
    for r in res:
        err = r.report and r.report.get("error")
        assert err is not None, describe(res)
        assert err["is_nvrar"] and not err["is_timeout"], err
        assert "mismatch" in err["message"], err["message"]
    msgs = [r.report["error"]["message"] for r in res]
    assert any("called all_reduce(count=" in m for m in msgs), msgs
    print("\n".join(msgs))


def test_bad_input_raises_before_communicating():
    from _matrix import bad_input_cases

    import torch

    expected = bad_input_cases(torch)
    reports = assert_all_ok(launch(2, "badinput", {"G": 2}))
    for rep in reports:
        for name, (_, exc_type, needle) in expected.items():
            got = rep["raised"][name]
            assert got is not None, f"{name} did not raise"
            assert got["type"] == exc_type, (name, got)
            assert needle in got["message"], (name, got)
        assert rep["good_call_ok"]
        assert rep["epoch"] == 1  # no bad call reached the protocol


@pytest.mark.parametrize("world,G,calls,extra", [
    (4, 2, 3000, {"NVRAR_CMA_MIN_BYTES": "64"}),  # pushes by cross-memory write
    (5, 1, 1500, {"NVRAR_LL_MAX_BYTES": "16K"}),  # inter-node LL packets for small shards
    (3, 3, 1500, {"NVRAR_CMA": "0"}),             # pulls from the segment
])
def test_jitter_thousands_of_calls(world, G, calls, extra):
    """Random delays before puts and after signals; every result checked exactly."""
    env = {"NVRAR_JITTER_US": "40", "NVRAR_JITTER_SEED": "12345", **extra}
    reports = assert_all_ok(launch(world, "jitter", {"G": G, "calls": calls, "max_bytes": 4096}, env=env, timeout=400))
    for rep in reports:
        assert rep["burst"]["failures"] == []
        assert rep["burst"]["checked"] == calls
        assert rep["epoch"] >= calls
    assert len({rep["burst"]["digest"] for rep in reports}) == 1


def test_rank_that_never_starts_times_out_in_bootstrap():
    res = launch(3, "fault", {"G": 1, "victim": -1, "mode": "none", "timeout": 3, "at": 0}, start=[0, 1],
                 env={"NVRAR_TIMEOUT_S": "3"}, timeout=60)
    for r in res:
        assert r.returncode == 1
        exc = r.report["exception"]
        assert exc["is_timeout"], exc
        assert "rank 2" in exc["message"], exc["message"]


def test_close_from_another_thread_during_a_call():
    res = launch(2, "close_race", {"G": 2}, timeout=120)
    rep = res[0].report
    assert res[0].returncode == 0 and rep is not None, describe(res)
    assert rep["joined"] and rep["close_s"] < 10
    assert "closed by another thread" in rep["thread"], rep


def test_bad_environment_on_one_rank_is_reported_by_every_rank():
    t0 = time.monotonic()
    res = launch(2, "fault", {"G": 2, "victim": -1, "mode": "none", "timeout": 30, "at": 0},
                 per_rank_env=[{}, {"NVRAR_JITTER_US": "abc"}], timeout=120)
    assert time.monotonic() - t0 < 25, "a bad setting must not cost the others the bootstrap deadline"
    for r in res:
        assert r.returncode == 1
        exc = r.report["exception"]
        assert exc["type"] == "ValueError" and "rank 1" in exc["message"] and "NVRAR_JITTER_US" in exc["message"], exc


@pytest.mark.parametrize("var,value", [("NVRAR_LL_MAX_BYTES", "16K"), ("NVRAR_ONESHOT_MAX_BYTES", "1K")])
def test_settings_that_differ_between_ranks_are_refused_at_construction(var, value):
    """Settings that decide what each round carries must agree; every rank says which differs."""
    res = launch(2, "fault", {"G": 1, "victim": -1, "mode": "none", "timeout": 30, "at": 0},
                 per_rank_env=[{}, {var: value}], timeout=120)
    for r in res:
        assert r.returncode == 1
        exc = r.report["exception"]
        assert exc["type"] == "ValueError" and f"ranks disagree on {var}" in exc["message"], exc
