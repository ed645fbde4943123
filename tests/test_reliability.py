"""Reliability across real processes (issue 13 items 1, 5, 6, 7; issue 12 "deadline promise"):
call mismatches whose 16-bit signatures collide, NaN in max/min, Ctrl-C inside a call, a peer
that closed its communicator but lives on, and the deadline with a stopped peer."""

import os
import signal
import threading
import time

import pytest

from _launch import assert_all_ok, describe, launch

from nvrar import _C

F32, SUM = _C.DTYPE_CODES["float32"], _C.OP_CODES["sum"]


# -- 13.1: a call mismatch the 16-bit signature cannot see ----------------------------------------

@pytest.mark.parametrize("G,counts,algorithm,where,env", [
    # the case of the issue: the push all-gather wrote 31,409 floats past rank 0's array
    (2, (100000, 131409), "two-shot", "private", {}),
    (2, (100000, 131409), "two-shot", "pool", {}),                      # pushes into the heap
    (2, (401, 431), "one-shot", "private", {}),
    (1, (252, 361), "two-shot", "private", {}),                         # inter-node put-with-signal
    (1, (252, 361), "two-shot", "private", {"NVRAR_LL_MAX_BYTES": "16K"}),  # inter-node LL packets
], ids=["push-cma", "push-pool", "one-shot", "inter-put", "inter-ll"])
def test_colliding_signatures_raise_mismatch_and_write_nothing_out_of_bounds(G, counts, algorithm, where, env):
    code = _C.ALGORITHM_CODES[algorithm]
    assert _C.call_signature(counts[0], F32, SUM, code) == _C.call_signature(counts[1], F32, SUM, code)
    res = launch(2, "mismatch_bounds", {"G": G, "algorithm": algorithm, "where": where, "timeout": 30},
                 per_rank_args=[{"count": counts[0]}, {"count": counts[1]}], env=env, timeout=120)
    reports = assert_all_ok(res)
    for rep in reports:
        assert rep["canary_intact"], f"rank {rep['rank']}: a peer wrote past the end of its buffer"
        err = rep["error"]
        assert err is not None, f"rank {rep['rank']} returned {'right' if rep.get('result_ok') else 'wrong'} data"
        assert err["is_nvrar"] and err["kind"] == "mismatch", err
        assert rep["elapsed"] < 10, "a mismatch must be caught at once, not at the deadline"
        for c in counts:
            assert f"count={c}," in err["message"], err["message"]
    print("\n".join(r["error"]["message"] for r in reports))


# -- 13.5: NaN, inf and signed zeros in max/min ---------------------------------------------------

@pytest.mark.parametrize("world,G", [(2, 2), (4, 2), (3, 1)])
def test_max_min_propagate_nan_like_torch_bitwise_on_every_rank(world, G):
    # counts: one-shot and two-shot sizes, several chunks (max_bytes 8 KiB), odd tails
    reports = assert_all_ok(launch(world, "nan", {"G": G, "counts": [7, 1000, 5003]}, timeout=300))
    for rep in reports:
        assert rep["failures"] == [], rep["failures"][:5]
        assert rep["checks"] == 3 * 2 * 3 * 2
    for key in reports[0]["digests"]:
        assert len({rep["digests"][key] for rep in reports}) == 1, f"{key}: ranks differ"


# -- 13.6: Ctrl-C inside a call --------------------------------------------------------------------

def test_sigint_in_a_waiting_rank_raises_keyboardinterrupt_and_aborts_peers_at_once(tmp_path):
    """Ranks 0 and 1 wait inside all_reduce for rank 2, which stays away; SIGINT to rank 1: it
    raises KeyboardInterrupt within a fraction of a second, rank 0 raises at once naming it, and
    rank 2 raises as soon as it calls. The deadline (30 s) is far away."""
    pidfile = str(tmp_path / "pid")
    sent = {}

    def interrupt():
        path = pidfile + "1"
        deadline = time.monotonic() + 60
        while not (os.path.exists(path) and os.path.exists(pidfile + "0")) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # both are inside their waits by now
        sent["at"] = time.time()
        os.kill(int(open(path).read()), signal.SIGINT)

    t = threading.Thread(target=interrupt)
    t.start()
    res = launch(3, "sigint", {"G": 3, "timeout": 30, "waiters": [0, 1], "absent_s": 4, "pidfile": pidfile},
                 timeout=120)
    t.join()
    reports = assert_all_ok(res)
    victim, waiter, late = reports[1], reports[0], reports[2]
    assert victim["error"]["type"] == "KeyboardInterrupt", victim
    assert victim["raised_at"] - sent["at"] < 0.5, victim
    assert victim["after"]["is_nvrar"] and "interrupted" in victim["after"]["message"], victim["after"]
    assert waiter["error"]["is_nvrar"] and not waiter["error"]["is_timeout"], waiter
    assert "aborted by rank 1" in waiter["error"]["message"] and "KeyboardInterrupt" in waiter["error"]["message"]
    assert waiter["raised_at"] - sent["at"] < 0.5, waiter
    assert "aborted by rank 1" in late["error"]["message"] and late["elapsed"] < 0.5, late
    print(victim["after"]["message"], waiter["error"]["message"], sep="\n")


# -- 13.7: a peer that closed its communicator but lives on ---------------------------------------

@pytest.mark.parametrize("mode", ["close", "gc", "close_live"])
@pytest.mark.parametrize("count", [1000, 100000], ids=["one-shot", "two-shot"])
def test_closed_peer_is_named_at_once(mode, count):
    timeout = 30.0
    res = launch(3, "closed_peer", {"G": 3, "victim": 2, "mode": mode, "timeout": timeout, "linger_s": 6,
                                    "count": count}, timeout=120)
    reports = assert_all_ok(res)
    assert reports[2]["lived"]
    for rep in reports[:2]:
        err = rep["error"]
        assert err is not None and err["is_nvrar"] and not err["is_timeout"], rep
        assert "rank 2 closed its communicator" in err["message"], err["message"]
        assert rep["elapsed"] < 1.0, rep
    print("\n".join(r["error"]["message"] for r in reports[:2]))


def test_close_from_another_thread_returns_within_a_second_while_the_peer_is_absent():
    res = launch(2, "close_race", {"G": 2}, timeout=120)
    rep = res[0].report
    assert res[0].returncode == 0 and rep is not None, describe(res)
    assert rep["joined"] and "closed by another thread" in rep["thread"], rep
    assert rep["close_s"] < 1.0, rep


# -- issue 12: every survivor raises within the deadline -------------------------------------------

@pytest.mark.parametrize("G", [2, 4])
def test_stopped_peer_every_survivor_raises_within_the_deadline(G):
    """One of 4 ranks stops (SIGSTOP) before a call whose buffers go by cross-memory transfers:
    every survivor raises within timeout + 1 s (the README's promise), none waits a second
    deadline for the stopped rank."""
    timeout = 4.0
    res = launch(4, "stop", {"G": G, "victim": 3, "at": 2, "timeout": timeout, "kill_after_s": timeout + 8},
                 timeout=120)
    for r in res[:3]:
        rep = r.report
        assert r.returncode == 0 and rep is not None, describe(res)
        assert rep["calls_ok"] == 2 and rep["error"]["is_nvrar"], rep
        assert rep["elapsed"] < timeout + 1.0, rep
    print([round(r.report["elapsed"], 2) for r in res[:3]])
