"""nvrar's TCP rendezvous store (issue 13, items 2, 4, 9): only this user's processes, or holders
of the session secret, are served; malformed and oversized messages are refused with an error
the ranks raise as NvrarError; setup is fast; bad launcher variables are named."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

import nvrar
from nvrar import _store
from nvrar.bootstrap import SingleBootstrap
from _launch import HERE, assert_all_ok, describe, free_port, launch

INTRUDER = os.path.join(HERE, "_intruder.py")
SECRET = "0123456789abcdef-test-secret"


# -- real ranks under attack -----------------------------------------------------------------
def _attack_during(world: int, seconds: float, env: dict, setuid: int = -1):
    port = free_port()
    cmd = [sys.executable, INTRUDER, str(port), str(seconds)] + (["--setuid", str(setuid)] if setuid >= 0 else [])
    intruder = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = json.loads(intruder.stdout.readline() or "{}")
        assert ready.get("ready"), intruder.stderr.read()
        # Rank 1 arrives 1 s late: the window the attack of the issue needed.
        res = launch(world, "store", {"late": 1, "delay": 1.0, "calls": 5, "timeout": 30},
                     env={"MASTER_PORT": str(port), **env}, timeout=120)
        out, err = intruder.communicate(timeout=seconds + 30)
    finally:
        if intruder.poll() is None:
            intruder.kill()
            intruder.communicate()
    summary = json.loads(out.strip().splitlines()[-1])
    return ready, res, summary, err


def _check_unharmed(res, summary, err):
    reports = assert_all_ok(res)
    assert all(rep["checked"] == 5 for rep in reports), reports
    assert summary["connected"] > 0, f"the intruder never reached the store: {summary} {err}"
    assert summary["accepted"] == [], f"the store served the intruder: {summary['accepted'][:3]}"


def test_another_user_is_refused_and_the_ranks_are_unaffected():
    if os.geteuid() != 0:
        pytest.skip("needs root to run the intruder as another user (uid 65534)")
    ready, res, summary, err = _attack_during(2, 3.0, {}, setuid=65534)
    assert ready["uid"] == 65534
    _check_unharmed(res, summary, err)
    # It was told why (a misconfigured rank of another user would raise this message).
    assert any("uid 65534" in r for r in summary["replies"]), summary["replies"]
    print(summary["attempts"], "attempts,", summary["connected"], "connections, replies:", summary["replies"][:3])


def test_rank_0_names_the_refused_connections_when_a_rank_never_arrives():
    if os.geteuid() != 0:
        pytest.skip("needs root to run the intruder as another user (uid 65534)")
    port = free_port()
    intruder = subprocess.Popen([sys.executable, INTRUDER, str(port), "3", "--setuid", "65534"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert json.loads(intruder.stdout.readline() or "{}").get("ready"), intruder.stderr.read()
        res = launch(2, "store", {"timeout": 3}, start=[0], env={"MASTER_PORT": str(port)}, timeout=60)
    finally:
        intruder.kill()
        intruder.communicate()
    exc = res[0].report["exception"]
    assert exc["is_timeout"] and "rank 1 never arrived" in exc["message"], exc
    assert "the store refused connections" in exc["message"] and "uid 65534" in exc["message"], exc


def test_without_the_session_secret_a_client_is_refused_and_the_ranks_are_unaffected():
    """With NVRAR_SESSION_SECRET, a process of the same user that lacks it cannot take part:
    forged proofs, garbage and oversized messages are refused; the ranks compute correctly."""
    ready, res, summary, err = _attack_during(2, 3.0, {"NVRAR_SESSION_SECRET": SECRET})
    _check_unharmed(res, summary, err)
    joined = " ".join(summary["replies"])
    assert "authentication failed" in joined, summary["replies"]
    assert "unknown operation" in joined, summary["replies"]
    assert "exceeds the limit" in joined, summary["replies"]


@pytest.mark.parametrize("ranks_env,needle", [
    ([{"NVRAR_SESSION_SECRET": SECRET}, {"NVRAR_SESSION_SECRET": SECRET + "x"}], "differs"),
    ([{"NVRAR_SESSION_SECRET": SECRET}, {}], "requires NVRAR_SESSION_SECRET"),
    ([{}, {"NVRAR_SESSION_SECRET": SECRET}], "runs without NVRAR_SESSION_SECRET"),
    ([{"NVRAR_SESSION_SECRET": "short"}, {"NVRAR_SESSION_SECRET": "short"}], "at least 16"),
])
def test_secret_mismatch_is_a_clear_error(ranks_env, needle):
    t0 = time.monotonic()
    res = launch(2, "store", {"timeout": 4}, per_rank_env=ranks_env, timeout=60)
    assert time.monotonic() - t0 < 40
    errors = [r.report["exception"] for r in res if r.report and "exception" in r.report]
    assert errors, describe(res)
    named = [e for e in errors if needle in e["message"]]
    assert named and all(e["is_nvrar"] for e in named), errors
    print(named[0]["message"])


def test_rank_0_names_the_rank_whose_secret_differs():
    """Rank 1 raises at once (authentication failed); rank 0, left waiting for it, says at its
    deadline why rank 1 never arrived instead of only that it did not."""
    res = launch(2, "store", {"timeout": 3}, per_rank_env=[{"NVRAR_SESSION_SECRET": SECRET},
                                                          {"NVRAR_SESSION_SECRET": SECRET + "x"}], timeout=60)
    by_rank = {r.rank: r.report["exception"] for r in res if r.report and "exception" in r.report}
    assert set(by_rank) == {0, 1}, describe(res)
    assert "differs" in by_rank[1]["message"], by_rank[1]
    msg = by_rank[0]["message"]
    assert "rank 1 never arrived" in msg and "saying it is rank 1 left during authentication" in msg, msg
    assert "NVRAR_SESSION_SECRET differs" in msg, msg


# -- the protocol, in process (real sockets, this user) ----------------------------------------
def _server(world: int = 2, secret=None, timeout: float = 20.0):
    port = free_port()
    return port, _store.StoreServer("127.0.0.1", port, world, timeout, session=b"s", secret=secret)


def _raw_hello(port: int, rank: int = 1) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(struct.pack("!cII", b"H", 1, 20) + b"s" + struct.pack("!i16s", rank, b"\0" * 16))
    assert sock.recv(6) == b"\x00\x00\x00\x00\x01U"
    return sock


def _error_reply(sock: socket.socket) -> str:
    status, n = struct.unpack("!cI", sock.recv(5))
    assert status == b"\x02"
    return sock.recv(n).decode()


def _allgather(port: int, world: int, secret=None) -> list:
    out = [None] * world

    def rank(r):
        c = _store.StoreClient("127.0.0.1", port, 10, r, session=b"s", secret=secret)
        c.set(f"k/{r}".encode(), f"v{r}".encode())
        out[r] = [c.get(f"k/{q}".encode(), 5) for q in range(world)]
        c.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_malformed_and_oversized_messages_are_refused_and_the_store_serves_on():
    port, server = _server()
    try:
        garbage = socket.create_connection(("127.0.0.1", port), timeout=5)
        garbage.sendall(b"\xff" * 64)
        assert "unknown operation" in _error_reply(garbage)
        big = _raw_hello(port, 1)
        big.sendall(struct.pack("!cII", b"S", 4, 16 << 20) + b"k/xx")
        assert "16777216 bytes exceeds the limit" in _error_reply(big)
        big.close()
        garbage.close()
        assert _allgather(port, 2) == [[b"v0", b"v1"]] * 2
    finally:
        server.wait_closed(5)


def test_fake_done_messages_do_not_close_the_store():
    port, server = _server()
    try:
        for _ in range(2):  # "done" before authenticating: not our protocol, refused
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(struct.pack("!cII", b"D", 0, 0))
            assert "first message must be a hello" in _error_reply(s)
            s.close()
        assert _allgather(port, 2) == [[b"v0", b"v1"]] * 2
    finally:
        server.wait_closed(5)


def test_keys_are_written_once_and_ranks_connect_once():
    port, server = _server()
    try:
        a = _store.StoreClient("127.0.0.1", port, 10, 0, session=b"s")
        b = _store.StoreClient("127.0.0.1", port, 10, 1, session=b"s")
        a.set(b"k", b"first")
        with pytest.raises(nvrar.NvrarError, match="already set"):
            b.set(b"k", b"second")
        with pytest.raises(nvrar.NvrarError, match="already connected"):
            _store.StoreClient("127.0.0.1", port, 10, 0, session=b"s")
        assert a.get(b"k", 1) == b"first"
        with pytest.raises(nvrar.NvrarError, match="exceeds the store's limits"):
            a.set(b"big", b"x" * (_store.MAX_VALUE_BYTES + 1))
        a.close()
    finally:
        server.wait_closed(1)


def test_a_malformed_reply_is_an_nvrar_error():
    """A rank facing a server that breaks the protocol raises NvrarError, never a bare exception."""
    for reply in (b"\x07\x00\x00\x00\x00", b"\x00\x7f\xff\xff\xff"):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]

        def serve(listener=listener, reply=reply):
            conn, _ = listener.accept()
            conn.recv(64)
            conn.sendall(reply)
            time.sleep(1)
            conn.close()

        t = threading.Thread(target=serve)
        t.start()
        try:
            with pytest.raises(nvrar.NvrarError, match="malformed reply|answered the hello|reply of"):
                _store.StoreClient("127.0.0.1", port, 5, 0, session=b"s")
        finally:
            t.join(5)
            listener.close()


def test_secret_handshake_in_process():
    key = _store.secret_key(SECRET)
    port, server = _server(secret=key)
    try:
        assert _allgather(port, 2, secret=key) == [[b"v0", b"v1"]] * 2
    finally:
        server.wait_closed(5)


def test_socket_owner_names_this_user_and_nobody_else():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = socket.create_connection(listener.getsockname())
    conn, _ = listener.accept()
    try:
        assert _store.socket_owner(client.getsockname(), client.getpeername()) == os.geteuid()
        assert _store.socket_owner(conn.getsockname(), conn.getpeername()) == os.geteuid()
        assert _store.socket_owner(("127.0.0.1", 1), client.getpeername()) is None
    finally:
        for s in (client, conn, listener):
            s.close()


def test_a_bootstrap_value_that_does_not_decode_is_an_nvrar_error():
    class Garbage(SingleBootstrap):
        def allgather(self, value):
            return [b"\xff\xfe not json"]

    with pytest.raises(nvrar.NvrarError, match="rank 0 received from rank 0 a settings that does not decode"):
        nvrar.Communicator(Garbage())


# -- launcher variables (item 9): named, before any communication -----------------------------
@pytest.mark.parametrize("var,value,needle", [
    ("RANK", "abc", "RANK='abc' is not an integer"),
    ("RANK", "-1", "RANK='-1' must be >= 0"),
    ("RANK", "7", "RANK=7 is out of range for WORLD_SIZE=2"),
    ("WORLD_SIZE", "two", "WORLD_SIZE='two' is not an integer"),
    ("MASTER_PORT", "abc", "MASTER_PORT='abc' is not an integer"),
    ("MASTER_PORT", "99999", "MASTER_PORT=99999 is not a TCP port"),
    ("MASTER_ADDR", "no-such-host.invalid", "MASTER_ADDR='no-such-host.invalid' does not resolve"),
])
def test_bad_launcher_variable_is_named(var, value, needle):
    t0 = time.monotonic()
    res = launch(2, "store", {"timeout": 30}, env={var: value}, timeout=60)
    assert time.monotonic() - t0 < 25, "a bad variable must fail at once, not at the bootstrap deadline"
    for r in res:
        assert r.returncode == 1, describe(res)
        exc = r.report["exception"]
        assert exc["is_nvrar"] and needle in exc["message"], exc
    print(res[0].report["exception"]["message"])


def test_port_held_by_another_process_is_named():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        res = launch(2, "store", {"timeout": 3}, start=[0], env={"MASTER_PORT": str(port)}, timeout=60)
    finally:
        holder.close()
    exc = res[0].report["exception"]
    assert exc["is_nvrar"] and "the port is in use" in exc["message"], exc


# -- setup time (item 4) -----------------------------------------------------------------------
def test_setup_time_benchmark_runs_and_setup_is_fast(tmp_path):
    """benchmarks/setup_time.py, briefly. Nagle's algorithm on the store's replies cost ~40 ms per
    round (a median of 282 ms at 2 ranks before the fix, 5 ms after, on an idle host)."""
    script = os.path.join(os.path.dirname(HERE), "benchmarks", "setup_time.py")
    out = tmp_path / "setup.json"
    proc = subprocess.run([sys.executable, script, "--ranks", "2", "--iters", "5", "--json", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert rows[0]["world"] == 2 and rows[0]["iters"] == 5
    assert rows[0]["median_ms"] < 150, rows
    print(proc.stdout)
