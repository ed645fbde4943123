"""The shared-memory segments of the CPU executor: space reserved at setup (a short /dev/shm is
a clear error at construction on every rank, never SIGBUS in a call), and the segments of ranks
killed during setup swept as soon as their creators are known dead. Real processes throughout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import nvrar
from _launch import free_port, private_shm_prefix

HERE = os.path.dirname(os.path.abspath(__file__))


def _private_mount_namespace() -> list:
    """A command prefix that runs its command in a private mount namespace where it may mount a
    tmpfs on /dev/shm; pytest.skip with the reason where none can be made."""
    prefix, why = private_shm_prefix()
    if prefix is None:
        pytest.skip(why)
    return prefix


# Run inside the namespace: mount the short /dev/shm, start the ranks, report what each did and
# what /dev/shm holds afterwards.
_DRIVER = r"""
import json, os, subprocess, sys
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=56m", "tmpfs", "/dev/shm"], check=True)
sys.path.insert(0, sys.argv[1])
import _launch
res = _launch.launch(4, "seg_smallshm", {"empty_bytes": 16 << 20, "array_bytes": 32 << 20}, timeout=150)
print(json.dumps({"ranks": [{"rc": r.returncode, "report": r.report, "stderr": r.stderr[-1500:]} for r in res],
                  "left": sorted(os.listdir("/dev/shm"))}))
"""


def test_short_dev_shm_fails_at_construction_on_every_rank():
    """Issue 12: 4 ranks, /dev/shm a 56 MB tmpfs, ~48 MB per segment. Each segment alone fits
    (the old per-rank check passed), together they do not: every rank must raise NvrarError at
    construction, naming the space needed and how to get it; no signal, nothing left behind."""
    prefix = _private_mount_namespace()
    proc = subprocess.run(prefix + [sys.executable, "-c", _DRIVER, HERE], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    for r, rank in enumerate(data["ranks"]):
        assert rank["rc"] >= 0, f"rank {r} died of signal {-rank['rc']}:\n{rank['stderr']}"
        rep = rank["report"]
        assert rep is not None and rep.get("constructed") is False, f"rank {r} got past construction: {rank}"
        err = rep["error"]
        assert err["is_nvrar"], err
        msg = err["message"]
        assert "/dev/shm" in msg and "--shm-size" in msg and "heap_bytes" in msg, msg
        assert "cannot reserve" in msg and "bytes" in msg, msg
    assert data["left"] == [], f"segments left in /dev/shm: {data['left']}"


_RANK = ("import nvrar\n"
         "c = nvrar.Communicator(timeout=30)\n"
         "c.close()\n")


def _ours(pids) -> list:
    # Names carry the creator's pid: nvrar-<pid namespace>-<pid>-<start time>-<random> (earlier
    # versions: nvrar-<pid>-<random>).
    out = []
    for n in os.listdir("/dev/shm"):
        parts = n.split("-")
        if n.startswith("nvrar-") and len(parts) in (3, 5) and int(parts[2 if len(parts) == 5 else 1]) in pids:
            out.append(n)
    return out


def test_segments_of_ranks_killed_during_setup_are_swept():
    """Issue 13, item 8: ranks killed (SIGKILL, SIGTERM) while their segments exist, i.e. inside
    setup, leave them in /dev/shm; the next setup of the same user removes every one of them at
    once (their creators are dead), not an hour later."""
    left: list = []
    attempts = 0
    while len(left) < 4 and attempts < 40:
        attempts += 1
        port = free_port()
        procs = []
        for r in range(2):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            env.pop("LOCAL_WORLD_SIZE", None)
            procs.append(subprocess.Popen([sys.executable, "-c", _RANK], env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        pids = {p.pid for p in procs}
        sig = signal.SIGKILL if attempts % 2 else signal.SIGTERM
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            if _ours(pids):  # a segment exists: the ranks are inside setup
                break
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)
        for p in procs:
            p.wait(timeout=30)
        left += _ours(pids)
    assert left, f"no rank could be killed inside setup in {attempts} attempts (the test could not fail)"
    try:
        nvrar.Communicator().close()  # a new setup of this user
        still = [n for n in left if os.path.exists("/dev/shm/" + n)]
        assert not still, f"{len(still)} of {len(left)} orphaned segments left after a new setup: {still}"
    finally:
        for n in left:
            if os.path.exists("/dev/shm/" + n):
                os.unlink("/dev/shm/" + n)
