"""A rank killed (SIGKILL) at any point of a CPU communicator's set-up: every survivor raises
nvrar's error naming its rank and the phase within its deadline, at once where rank 0 (which serves
the store) died (or, killed late enough, the survivors complete their set-up and their first call
raises), and once they have exited nothing of that set-up is left in /dev/shm. The points are nvrar._setup.KILL_POINTS, reached through
NVRAR_TEST_KILL_AT; the ranks are plain numpy processes (no torch) bootstrapping through nvrar's
own store, in a private /dev/shm (a mount namespace with a tmpfs of its own), so that no other
test's set-up sweeps a leak away and a leak disturbs no other test."""

from __future__ import annotations

import glob
import json
import os
import random
import re
import subprocess
import sys
import time

import pytest

import nvrar
from _launch import private_shm_prefix
from nvrar import _setup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIOS = 20
LANES = 2          # scenarios run two at a time, each lane in a mount namespace and /dev/shm of its own
TIMEOUT_S = 3.0    # the ranks' deadline (timeout=)
MARGIN_S = 4.0     # what a survivor may take beyond it (process start on a loaded 2-core host)
PROMPT_S = 2.0     # rank 0 dead once every rank reached its store: the survivors raise at once, not at the deadline
WALL_S = 120.0     # the whole test
# From this point on, the survivors may complete their set-up (KILL_POINTS' comment).
LATE = _setup.KILL_POINTS.index("after-attach-status")
# From this point on, every rank has connected to rank 0's store (rank 0 has every rank's settings).
CONNECTED = _setup.KILL_POINTS.index("after-settings")

# One rank: a plain process that imports nvrar and numpy only; reports what its set-up and its
# first call did (one JSON line).
_RANK = r"""
import json, os, sys, time
import numpy as np
import nvrar
out = {"rank": int(os.environ["RANK"]), "pid": os.getpid(), "nvrar": nvrar.__file__}
def described(exc, t0):
    return {"type": type(exc).__name__, "is_nvrar": isinstance(exc, nvrar.NvrarError), "message": str(exc),
            "rank": getattr(exc, "rank", None), "peer": getattr(exc, "peer", None),
            "phase": getattr(exc, "phase", None), "elapsed": time.monotonic() - t0}
t0 = time.monotonic()
try:
    comm = nvrar.Communicator(timeout=float(sys.argv[1]), max_bytes=1 << 16, heap_bytes=0)
except Exception as exc:
    out["setup_error"] = described(exc, t0)
else:
    out["constructed_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    try:
        comm.all_reduce(np.ones(256, np.float32))
        out["call"] = "returned"
    except Exception as exc:
        out["call_error"] = described(exc, t0)
out["torch"] = "torch" in sys.modules
print(json.dumps(out), flush=True)
"""

# One lane, inside its mount namespace: a tmpfs of its own on /dev/shm, then the scenarios one
# after the other; after each, the nvrar segments left (looked at once every rank has exited,
# before the next set-up could sweep them), then removed.
_LANE = r"""
import json, os, socket, subprocess, sys, time
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", "/dev/shm"], check=True)
rank_code, timeout, scenarios = sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3])
drop = ("LOCAL_", "TORCHELASTIC_", "OMPI_", "PMI", "SLURM_", "MV2_", "MPI_", "NVRAR_")
base = {k: v for k, v in os.environ.items() if not k.startswith(drop)}

def creator(name):
    parts = name.split("-")  # nvrar-<pid namespace>-<pid>-<start time>-<random>
    return int(parts[2]) if name.startswith("nvrar-") and len(parts) == 5 and parts[2].isdigit() else None

results = []
for sc in scenarios:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    t0 = time.monotonic()
    for r in range(sc["world"]):
        env = dict(base, RANK=str(r), WORLD_SIZE=str(sc["world"]), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if r == sc["victim"]:
            env["NVRAR_TEST_KILL_AT"] = sc["point"]
        procs.append(subprocess.Popen([sys.executable, "-c", rank_code, str(timeout)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    ranks = []
    for p in procs:
        hung = False
        try:
            so, se = p.communicate(timeout=max(1.0, t0 + 4 * timeout + 20 - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
            p.kill()
            so, se = p.communicate()
        lines = [l for l in so.splitlines() if l.startswith("{")]
        ranks.append({"rc": p.returncode, "pid": p.pid, "hung": hung, "report": json.loads(lines[-1]) if lines else None,
                      "stderr": se[-1500:]})
    pids = {p.pid for p in procs}
    names = sorted(os.listdir("/dev/shm"))
    left = [n for n in names if creator(n) in pids]
    for n in names:
        os.unlink("/dev/shm/" + n)
    results.append(dict(sc, ranks=ranks, left=left, others=[n for n in names if n not in left],
                        wall=time.monotonic() - t0))
print(json.dumps(results))
"""


def draws(seed: int) -> list:
    """SCENARIOS draws of (world 2 or 3, victim, point); points may repeat, but native and Python
    points are both among them."""
    rng = random.Random(seed)
    out = []
    for _ in range(SCENARIOS):
        world = rng.choice((2, 3))
        out.append({"world": world, "victim": rng.randrange(world), "point": rng.choice(_setup.KILL_POINTS)})
    native = sorted(_setup.NATIVE_KILL_POINTS)
    python = [p for p in _setup.KILL_POINTS if p not in _setup.NATIVE_KILL_POINTS]
    if not any(d["point"] in _setup.NATIVE_KILL_POINTS for d in out):
        out[0]["point"] = rng.choice(native)
    if all(d["point"] in _setup.NATIVE_KILL_POINTS for d in out):
        out[1]["point"] = rng.choice(python)
    return out


def check_survivor(sc: dict, r: int, rank: dict) -> list:
    """What is wrong with survivor ``r`` of scenario ``sc`` (nothing: [])."""
    rep = rank["report"]
    if rank["hung"] or rank["rc"] != 0 or rep is None:
        return [f"rank {r} exited with {rank['rc']}{' (hung, killed)' if rank['hung'] else ''}, report {rep}: "
                f"{rank['stderr']}"]
    bad = []
    if rep["torch"]:
        bad.append(f"rank {r} imported torch")
    late = _setup.KILL_POINTS.index(sc["point"]) >= LATE
    err = rep.get("setup_error") or rep.get("call_error")
    if err is None:
        return bad + [f"rank {r} raised nothing (set-up and call returned): {rep}"]
    if "setup_error" not in rep and not late:
        bad.append(f"rank {r} completed its set-up though its peer died before the last exchange: {rep}")
    msg = err["message"]
    if not err["is_nvrar"]:
        bad.append(f"rank {r} raised {err['type']}, not NvrarError: {msg}")
    if err["rank"] != r or f"rank {r}" not in msg or not err["phase"] or err["phase"] not in msg:
        bad.append(f"rank {r}'s error does not name its rank and phase (rank={err['rank']}, "
                   f"phase={err['phase']}): {msg}")
    if err["elapsed"] > TIMEOUT_S + MARGIN_S:
        bad.append(f"rank {r} raised after {err['elapsed']:.1f} s (deadline {TIMEOUT_S} s + {MARGIN_S} s): {msg}")
    if sc["victim"] == 0 and _setup.KILL_POINTS.index(sc["point"]) >= CONNECTED and err["elapsed"] > PROMPT_S:
        bad.append(f"rank {r} raised {err['elapsed']:.1f} s after it started, though rank 0 (its store) died: {msg}")
    return bad


def outcome_of(rank: dict, victim: bool) -> str:
    rep = rank["report"] or {}
    if victim:
        return "killed"
    for key, what in (("setup_error", "set-up raised"), ("call_error", "call raised")):
        if key in rep:
            return f"{what} after {rep[key]['elapsed']:.1f} s"
    return "?"


def test_kill_points_are_in_the_code():
    """Every point of KILL_POINTS is reached at exactly one place: the native ones in csrc/cpu,
    the others in nvrar/ (a misspelt point would never fire)."""
    native = "".join(open(p).read() for p in glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp")))
    python = "".join(open(p).read() for p in glob.glob(os.path.join(ROOT, "nvrar", "*.py")))
    assert len(set(_setup.KILL_POINTS)) == len(_setup.KILL_POINTS)
    assert _setup.NATIVE_KILL_POINTS < set(_setup.KILL_POINTS)
    for point in _setup.KILL_POINTS:
        where = {"native": len(re.findall(r'test_kill_point\([^;]*"' + re.escape(point) + r'"\)', native)),
                 "python": len(re.findall(r'die_at\(kill_at, "' + re.escape(point) + r'"\)', python))}
        assert where == ({"native": 1, "python": 0} if point in _setup.NATIVE_KILL_POINTS
                         else {"native": 0, "python": 1}), (point, where)


def test_a_rank_killed_anywhere_in_setup_leaves_nothing():
    prefix, why = private_shm_prefix()
    if prefix is None:
        pytest.skip(why)
    seed = int(os.environ.get("NVRAR_SETUP_FAULTS_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"\nseed {seed} (NVRAR_SETUP_FAULTS_SEED={seed} repeats this draw)")
    scenarios = draws(seed)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(nvrar.__file__)))] +
        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    t0 = time.monotonic()
    lanes = [subprocess.Popen(prefix + [sys.executable, "-c", _LANE, _RANK, str(TIMEOUT_S),
                                        json.dumps(scenarios[i::LANES])],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(LANES)]
    results = []
    for lane in lanes:
        out, err = lane.communicate(timeout=WALL_S + 60)
        assert lane.returncode == 0, err[-3000:]
        results += json.loads(out.strip().splitlines()[-1])
    wall = time.monotonic() - t0
    problems = []
    for sc in results:
        what = f"world {sc['world']}, rank {sc['victim']} killed at {sc['point']}"
        victim = sc["ranks"][sc["victim"]]
        bad = [] if victim["rc"] == -9 else [f"the victim exited with {victim['rc']}, not SIGKILL: {victim['report']} "
                                            f"{victim['stderr']}"]
        for r, rank in enumerate(sc["ranks"]):
            if r != sc["victim"]:
                bad += check_survivor(sc, r, rank)
        if sc["left"]:
            bad.append(f"left in /dev/shm: {sc['left']}")
        outcome = "; ".join(f"rank {r}: {outcome_of(rank, r == sc['victim'])}" for r, rank in enumerate(sc["ranks"]))
        print(f"{what}: {sc['wall']:.1f} s; {outcome}" + (f"  <-- {len(bad)} problem(s)" if bad else ""))
        problems += [f"{what}: {b}" for b in bad]
    reached = {sc["point"] for sc in results}
    print(f"{len(results)} scenarios in {wall:.1f} s; points {sorted(reached)}")
    assert len(results) == SCENARIOS
    assert reached & _setup.NATIVE_KILL_POINTS and reached - _setup.NATIVE_KILL_POINTS
    assert not problems, f"seed {seed}:\n" + "\n".join(problems)
    assert wall < WALL_S, f"{wall:.0f} s for {SCENARIOS} scenarios"
