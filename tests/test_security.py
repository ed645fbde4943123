"""Segments that are not the session's, and a forked child (issue 13, items 2 and 3). Real
processes: the ranks bootstrap through nvrar's TCP store; the forger of the other-user case is a
real process of an unprivileged user; the fork is os.fork."""

from __future__ import annotations

import os
import pwd

import pytest

from _launch import describe, launch


def _can_make_another_user() -> str:
    """'' if this process can start a process as `nobody`, else why not."""
    if os.geteuid() != 0:
        return "not root: cannot start a process as another user"
    try:
        pwd.getpwuid(65534)
    except KeyError:
        return "no user with uid 65534 (nobody) on this system"
    return ""


def _check_refused(results, victim: int, words) -> None:
    forged = [r.report.get("forged") for r in results if r.report]
    try:
        for r in results:
            assert r.returncode == 0 and r.report is not None, describe(results)
            rep = r.report
            assert rep["constructed"] is False, f"rank {r.rank} accepted the forged segment: {rep}\n" + describe(results)
            err = rep["error"]
            assert err["is_nvrar"], err
            assert f"rank {victim}" in err["message"], err["message"]
            for w in words:
                assert w in err["message"], err["message"]
    finally:
        for name in forged:
            if name and os.path.exists("/dev/shm" + name):
                os.unlink("/dev/shm" + name)
    assert forged[0], "the forged segment was never planted (the test could not fail)"


def test_segment_of_another_user_is_refused():
    """Another local user plants its own segment (mode 0666, the victim's valid header, even the
    session secret) under rank 1's name in rank 0's view of the exchange: rank 0 refuses to map
    it, and every rank raises NvrarError at construction naming rank 1."""
    why = _can_make_another_user()
    if why:
        pytest.skip(why)
    res = launch(2, "seg_forged", {"forge": "other_user", "at": 0, "victim": 1}, timeout=120)
    _check_refused(res, 1, ["uid 65534", "mode 0666", "0600"])


def test_segment_without_the_session_secret_is_refused():
    """A segment of this user with a valid header but another session's secret (a stale
    segment of another session) is refused by the rank that attaches it, naming its rank."""
    res = launch(2, "seg_forged", {"forge": "stale", "at": 0, "victim": 1}, timeout=120)
    _check_refused(res, 1, ["secret"])


def test_forked_child_cannot_use_the_communicator():
    """A child forked after setup gets NvrarError naming the fork at every entry (Python and the
    native guard behind it); its close(), garbage collection and exit release nothing of the
    parent's. The parent and its peer then reduce correctly; the parent's arrays are untouched."""
    res = launch(2, "seg_fork", timeout=120)
    for r in res:
        assert r.returncode == 0 and r.report is not None, describe(res)
        rep = r.report
        assert rep["sum_ok"] and rep["kept_ok"] and rep["private_ok"], rep
        assert rep["epoch"] == 2, rep  # exactly the parent's two calls ran
    children = res[0].report["children"]
    assert len(children) == 2, children
    for child in children:
        assert child["status"] == 0, child
        rep = child["report"]
        assert rep is not None, child
        for entry in ("all_reduce", "all_reduce_kept", "empty", "check", "algorithm_for", "native"):
            err = rep[entry]
            assert err is not None, f"{entry} in a forked child raised nothing"
            assert err["is_nvrar"], err
            msg = err["message"]
            assert "forked child" in msg and "create a new Communicator in the child" in msg, msg
    assert children[0]["report"]["close"] == "ok", children[0]
