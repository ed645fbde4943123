"""The CPU executor across hosts over UCX, on hosts this test makes itself: network namespaces
joined by a bridge, each host with its own network, UTS, IPC, PID and mount namespaces and its own
/dev/shm (tests/_netns.py), so that the only way between two hosts is their network.

Real processes only: every rank is `_worker.py` started by its host's agent, bootstrapping
through nvrar's own store on host 0 (MASTER_ADDR, NVRAR_SESSION_SECRET). Checked: which UCX
transport carried the traffic between hosts (tcp, never shared memory or cross-memory attach);
the correctness matrix, and bitwise equality with the same layout emulated on one host; faults (a
host killed, a link taken down in the middle of a call, a stopped rank on another host): every
survivor raises within the deadline + 1 s naming rank, peer, phase and step, no wrong data,
nothing left in any host's /dev/shm, the namespaces gone afterwards."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

import pytest

import _netns
from _hosts_tasks import FORGED
from nvrar import _C
from nvrar.settings import HD_MIN_BYTES_HOSTS
from _launch import HERE, WORKER, RankResult, assert_all_ok, describe, free_port, launch

WHY_NOT = _netns.why_not()
try:
    import libucx  # noqa: F401

    NO_UCX = None
except ImportError:
    NO_UCX = "UCX is not installed (pip install 'nvrar[ucx]')"

pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT)),
              pytest.mark.skipif(NO_UCX is not None, reason=str(NO_UCX))]

SECRET = secrets.token_hex(16)
ROOT = os.path.dirname(HERE)


def run_hosts(n_hosts: int, G: int, task: str, args: dict, timeout: float = 180.0, env: Optional[Dict] = None,
              during=None, workdir: Optional[str] = None, rank_env: Optional[Dict[int, Dict]] = None) -> Tuple[List[RankResult], List[str], List[str]]:
    """Runs `task` on n_hosts namespace hosts x G ranks each (rank = host * G + local).
    `during(hosts, workdir)` runs while the ranks run. Returns the ranks' results, every host's
    /dev/shm listing after its ranks exited, and the namespaces still present after clean-up."""
    tmp = workdir or tempfile.mkdtemp(prefix="nvrar-hosts-")
    W = n_hosts * G
    port = free_port()
    base_env = {k: v for k, v in os.environ.items()
                if k not in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_STEP_ID",
                             "TORCHELASTIC_USE_AGENT_STORE", "MASTER_ADDR", "MASTER_PORT")}
    try:
        hosts = _netns.Hosts(n_hosts, tmp)
        shm: List[str] = []
        with hosts:
            for h in range(n_hosts):
                ranks = []
                for local in range(G):
                    r = h * G + local
                    e = {"RANK": r, "WORLD_SIZE": W, "LOCAL_RANK": local, "LOCAL_WORLD_SIZE": G,
                         "MASTER_ADDR": hosts.addr(0), "MASTER_PORT": port, "NVRAR_SESSION_SECRET": SECRET,
                         "PYTHONUNBUFFERED": 1, "PYTHONPATH": ROOT,
                         "NVRAR_TUNING_FILE": os.path.join(tmp, "no-tuning-table.json")}
                    e.update(env or {})
                    e.update((rank_env or {}).get(r, {}))
                    full = dict(base_env)
                    full.update({k: str(v) for k, v in e.items()})
                    a = dict(args, dir=tmp)
                    ranks.append({"argv": [sys.executable, WORKER, task, json.dumps(a), os.path.join(tmp, f"rank{r}.json")],
                                  "env": full, "log": os.path.join(tmp, f"rank{r}.log")})
                hosts.start(h, ranks)
            if during is not None:
                during(hosts, tmp)
            codes = hosts.wait(timeout)
            for h in range(n_hosts):
                path = os.path.join(tmp, f"shm-{h}.txt")
                shm.append(open(path).read().strip() if os.path.exists(path) else "<host gone>")
        left = hosts.exists()
        results = []
        for r in range(W):
            path = os.path.join(tmp, f"rank{r}.json")
            report = json.load(open(path)) if os.path.exists(path) else None
            log = open(os.path.join(tmp, f"rank{r}.log")).read() if os.path.exists(os.path.join(tmp, f"rank{r}.log")) else ""
            rc = 0 if report is not None and "exception" not in report else 1
            if codes[r // G] is None:
                log += f"\n[test_hosts] host {r // G} still running after {timeout:.0f} s (killed)"
                rc = 1
            results.append(RankResult(r, rc, "", log[-4000:], report))
    finally:  # a failed start or wait leaves nothing of this run in /tmp either
        if workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    return results, shm, left


def emulated(world: int, args: dict) -> List[dict]:
    """The same task and layout on this host (args["G"]: ranks_per_node)."""
    return assert_all_ok(launch(world, "hosts_matrix", args, env={"NVRAR_SESSION_SECRET": SECRET}))


# (hosts, ranks per host, ranks_per_node): 2x2 with ranks_per_node=1 emulates two nodes inside each
# host, so that inter-node steps go through shared memory inside a host and over UCX between hosts.
LAYOUTS = [(2, 1, 1), (2, 2, 2), (3, 1, 1), (2, 2, 1)]


@pytest.mark.parametrize("n_hosts,per_host,G", LAYOUTS, ids=[f"{n}x{h}-G{g}" for n, h, g in LAYOUTS])
def test_matrix_across_hosts(n_hosts, per_host, G):
    """Correct on every rank, bitwise across ranks, bitwise equal to one host (there by recursive
    doubling only), over tcp only."""
    args = {"G": G, "max_bytes": 65536}
    # 2 x 2 as 4 nodes: halving-doubling across hosts for shards from 16 KB (its puts land at
    # offsets inside the zones), compared bitwise with recursive doubling on one host below.
    env = {"NVRAR_HD_MIN_BYTES": "16K"} if n_hosts * per_host // G >= 4 else None
    results, shm, left = run_hosts(n_hosts, per_host, "hosts_matrix", args, env=env)
    reports = assert_all_ok(results)
    assert left == [], f"namespaces left behind: {left}"
    assert shm == [""] * n_hosts, f"/dev/shm not empty after the run: {shm}"
    W = n_hosts * per_host
    for rep in reports:
        m = rep["matrix"]
        assert m["failures"] == [] and m["checked"] > 500, m["failures"]
        # Every rank of another host is reached over tcp (never posix, sysv or cma).
        for peer, tls in rep["transports"].items():
            same_host = int(peer) // per_host == rep["rank"] // per_host
            if same_host:
                assert tls == ""
            else:
                lanes = tls.split(",")
                assert lanes and all(lane.split("/")[0] == "tcp" for lane in lanes), (rep["rank"], peer, tls)
        assert rep["host"] == f"nvrhost{rep['rank'] // per_host}"
        # comm.settings says what the executor across hosts was built with: no LL packets,
        # halving-doubling from HD_MIN_BYTES_HOSTS (its default across hosts) or NVRAR_HD_MIN_BYTES
        hd_min = 16 << 10 if env else HD_MIN_BYTES_HOSTS
        assert rep["settings"] == {"ll_max_bytes": 0, "hd_min_bytes": hd_min}, rep["settings"]
    assert len({rep["matrix"]["digest"] for rep in reports}) == 1, "results differ between ranks (bitwise)"
    if env is not None:
        # NOTE [landings]: halving-doubling's puts from the other host were combined (or, one rank
        # per node, delivered into the output) as they arrived, not only from the zone; the
        # comparison with one host below shows the bits are the same.
        assert sum(rep["landings"][0] for rep in reports) > 0, [rep["landings"] for rep in reports]
    one_host = emulated(n_hosts * per_host, args)
    for rep, ref in zip(reports, one_host):
        assert len(rep["cases"]) >= 144
        diff = [k for k in rep["cases"] if rep["cases"][k] != ref["cases"].get(k)]
        assert diff == [], f"rank {rep['rank']}: differs from {n_hosts} x {G} emulated on one host: {diff[:5]}"
        assert len({json.dumps(r["cases"], sort_keys=True) for r in reports}) == 1
    assert W == len(reports)


def test_mismatch_across_hosts_raises_and_writes_nothing_out_of_bounds():
    """2 hosts x 2 ranks as 4 nodes, halving-doubling across hosts (whose puts are combined as
    they arrive where they match the expectation, NOTE [landings]): rank 3 calls with another
    count whose 16-bit signature collides with the others' (same flag words, 64 KB rounds of the
    same size at first, different call descriptions). Every rank raises at once, one of them a
    mismatch naming both counts; no output is written past its end; nothing is left behind."""
    counts = (100000, 131409)
    code = (_C.DTYPE_CODES["float32"], _C.OP_CODES["sum"], _C.ALGORITHM_CODES["two-shot"])
    assert _C.call_signature(counts[0], *code) == _C.call_signature(counts[1], *code)
    args = {"G": 1, "max_bytes": 65536, "timeout": 30, "counts": [counts[0]] * 3 + [counts[1]]}
    results, shm, left = run_hosts(2, 2, "hosts_mismatch", args, env={"NVRAR_HD_MIN_BYTES": "16K"})
    reports = assert_all_ok(results)
    assert left == [] and shm == ["", ""], (left, shm)
    kinds = []
    for rep in reports:
        assert rep["canary_intact"], f"rank {rep['rank']}: a peer wrote past the end of its output"
        err = rep["error"]
        assert err is not None and err["is_nvrar"], f"rank {rep['rank']} returned from a mismatched call: {err}"
        assert rep["elapsed"] < 10, f"rank {rep['rank']}: a mismatch must be caught at once ({rep['elapsed']:.1f} s)"
        kinds.append(err["kind"])
    mism = [rep["error"]["message"] for rep in reports if rep["error"]["kind"] == "mismatch"]
    assert mism, kinds
    assert any(all(f"count={c}," in m for c in counts) for m in mism), mism
    print("\n".join(rep["error"]["message"][:200] for rep in reports))


def _wait_ready(tmp: str, ranks: List[int], timeout: float = 240.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(tmp, f"ready-{r}")) for r in ranks):
            return time.time()
        time.sleep(0.05)
    raise AssertionError(f"ranks {ranks} never became ready")


TIMEOUT = 4.0


def check_survivors(results: List[RankResult], survivors: List[int], fault_at: float, what: str) -> None:
    print(f"\n{what}:")
    for r in survivors:
        rep = results[r].report or {}
        if "raised_at" in rep:
            print(f"  rank {r} raised {rep['raised_at'] - fault_at:.2f} s after: {rep['exception']['message'][:300]}")
    for r in survivors:
        rep = results[r].report
        assert rep is not None, f"rank {r} wrote no report ({what}):\n{describe(results)}"
        assert rep["wrong"] == 0, f"rank {r}: wrong data after {what}"
        exc = rep.get("exception")
        assert exc is not None, f"rank {r} did not raise after {what}: {rep}"
        assert exc["is_nvrar"], exc
        for field in ("rank", "peer", "phase", "step"):
            assert exc[field] is not None, (r, field, exc)
        assert exc["rank"] == r
        late = rep["raised_at"] - fault_at
        assert late <= TIMEOUT + 1.0, f"rank {r} raised {late:.2f} s after {what} (deadline {TIMEOUT} s + 1 s): {exc}"


def test_fault_host_killed():
    """2 hosts x 2 ranks, every rank of host 1 SIGKILLed inside calls: both survivors raise."""
    t: Dict[str, float] = {}

    def kill(hosts, tmp):
        _wait_ready(tmp, [0, 1, 2, 3])
        time.sleep(0.3)
        t["at"] = time.time()
        hosts.kill_host(1)

    results, shm, left = run_hosts(2, 2, "hosts_fault", {"G": 2, "timeout": TIMEOUT}, during=kill, timeout=120)
    check_survivors(results, [0, 1], t["at"], "host 1 killed")
    assert shm[0] == "" and left == []
    msgs = [results[r].report["exception"]["message"] for r in (0, 1)]
    assert any("rank 2" in m or "rank 3" in m for m in msgs), msgs


def test_fault_link_down():
    """3 hosts x 1 rank, host 2's link taken down in the middle of a call: every rank raises
    (the ones cut off too), within the deadline + 1 s."""
    t: Dict[str, float] = {}

    def down(hosts, tmp):
        _wait_ready(tmp, [0, 1, 2])
        time.sleep(0.3)
        t["at"] = time.time()
        hosts.link_down(2)

    results, shm, left = run_hosts(3, 1, "hosts_fault", {"G": 1, "timeout": TIMEOUT}, during=down, timeout=120)
    check_survivors(results, [0, 1, 2], t["at"], "host 2's link down")
    assert shm == ["", "", ""] and left == []


def _pid_with_env(marker: str) -> Optional[int]:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read().split(b"\0"):
                    return int(pid)
        except OSError:
            continue
    return None


def test_fault_rank_stopped():
    """2 hosts x 2 ranks, rank 3 stops itself (SIGSTOP) between calls: ranks 0, 1 (other host)
    and 2 (its host) raise within the deadline + 1 s; no wrong data."""
    t: Dict[str, float] = {}
    marker = f"NVRAR_TEST_VICTIM={os.getpid()}-{secrets.token_hex(4)}"

    def watch(hosts, tmp):
        _wait_ready(tmp, [0, 1, 2, 3])
        deadline = time.monotonic() + 60
        pid = None
        while time.monotonic() < deadline:
            pid = pid or _pid_with_env(marker)
            if pid is not None:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "T":
                        t["at"] = time.time()
                        break
            time.sleep(0.01)
        assert "at" in t, "rank 3 never stopped"
        # Once the survivors reported, the stopped rank goes (its host's agent then lists /dev/shm).
        deadline = time.monotonic() + 3 * TIMEOUT + 10
        while time.monotonic() < deadline and not all(os.path.exists(os.path.join(tmp, f"rank{r}.json"))
                                                      for r in (0, 1, 2)):
            time.sleep(0.05)
        os.kill(pid, 9)

    key, value = marker.split("=", 1)
    results, shm, left = run_hosts(2, 2, "hosts_fault", {"G": 2, "timeout": TIMEOUT, "victim": 3, "mode": "stop",
                                                          "at": 8}, rank_env={3: {key: value}}, during=watch, timeout=120)
    check_survivors(results, [0, 1, 2], t["at"], "rank 3 stopped")
    assert shm == ["", ""] and left == []


def test_forged_messages_refused():
    """2 hosts x 1 rank: every malformed message rank 0 forges (tests/_hosts_tasks.py FORGED) is
    refused by rank 1's link, none lands, and rank 1's next call raises a protocol violation that
    names rank, peer, phase and step."""
    results, shm, left = run_hosts(2, 1, "hosts_forged", {"timeout": 20.0})
    reps = [r.report for r in results]
    assert all(rep is not None for rep in reps), describe(results)
    assert all(rep.get("first_ok") for rep in reps), (reps, describe(results))
    assert reps[1]["refused"] == len(FORGED), reps[1]
    exc = reps[1].get("exception")
    assert exc is not None and exc["is_nvrar"], reps[1]
    assert "refused" in exc["message"] and exc["kind"] == "violation", exc
    for field in ("rank", "peer", "phase", "step"):
        assert exc[field] is not None, (field, exc)
    assert exc["rank"] == 1 and exc["peer"] == 0, exc
    # rank 0's second call either completed (rank 1 had sent its data before it raised) or raised
    assert reps[0].get("second_ok") is True or reps[0]["exception"]["is_nvrar"], reps[0]
    assert left == [] and shm == ["", ""], (left, shm)


def test_without_ucx_names_the_extra():
    """Where libucx cannot be imported, a communicator across hosts raises NvrarError naming
    nvrar[ucx] on every rank (none waits for another)."""
    results, shm, left = run_hosts(2, 1, "hosts_matrix", {"G": 1}, env={"NVRAR_TEST_HIDE_UCX": "1"}, timeout=120)
    for res in results:
        assert res.report is not None and "exception" in res.report, describe(results)
        msg = res.report["exception"]["message"]
        assert res.report["exception"]["type"] == "NvrarError" and "nvrar[ucx]" in msg, msg
    assert left == [] and shm == ["", ""]


def test_no_transport_between_hosts_names_the_ucx_settings():
    """With UCX restricted to shared memory (UCX_TLS=shm,self) no transport reaches the other
    host: every rank raises NvrarError at set-up naming the cause and the UCX variables to check,
    at once (no rank waits for the wire-up deadline), and leaves nothing in /dev/shm."""
    t0 = time.monotonic()
    results, shm, left = run_hosts(2, 1, "hosts_matrix", {"G": 1}, env={"UCX_TLS": "shm,self"}, timeout=120)
    for res in results:
        assert res.report is not None and "exception" in res.report, describe(results)
        msg = res.report["exception"]["message"]
        assert res.report["exception"]["type"] == "NvrarError", msg
        assert "no UCX transport reaches rank" in msg and "UCX_TLS (shm,self)" in msg, msg
    assert time.monotonic() - t0 < 60
    assert left == [] and shm == ["", ""]


def test_torch_backend_dtensor_across_hosts():
    """init_process_group("nvrar") on 2 hosts x 2 ranks: the world group is served by nvrar (not
    the fallback), and DTensor tensor parallelism gives what gloo gives, bitwise; so do the groups
    of a (dp, tp) mesh, dp across the hosts and tp inside each."""
    pytest.importorskip("torch")
    results, shm, left = run_hosts(2, 2, "hosts_torch", {}, env={"GLOO_SOCKET_IFNAME": "eth0"}, timeout=400)
    reports = assert_all_ok(results)
    for rep in reports:
        d = rep["dtensor"]
        assert d["eager_delta"] == 3 and d["eager_equal_gloo"] and d["eager_equal_unsharded"] and d["nonzero"], d
        assert rep["value"] and rep["stats"]["nvrar"] >= 4 and rep["stats"]["native"] == 0, rep
        # The subgroups of a (dp, tp) mesh: dp pairs across the hosts, tp pairs inside one; each
        # served by nvrar (none falls back) and equal to gloo's all-reduce over the same ranks.
        r = rep["rank"]
        sub = rep["subgroups"]
        assert sub["dp"]["ranks"] == [r % 2, r % 2 + 2] and sub["tp"]["ranks"] == [r - r % 2, r - r % 2 + 1], sub
        for dim in ("dp", "tp"):
            assert sub[dim]["equal_gloo"] and sub[dim]["nonzero"], (dim, sub)
            assert sub[dim]["stats"]["nvrar"] == 1 and sub[dim]["stats"]["native"] == 0, (dim, sub)
    assert shm == ["", ""] and left == []


def test_nvrar_bench_across_hosts():
    """`nvrar-bench` started by the launcher's variables on each host (one rank per host) runs the
    inter-host path and verifies its data (#wrong 0). The DeepSpeed peer, asked for, is skipped
    with the reason (its shm all-reduce serves one host; its setup would wait forever for the
    other host's segments), never waited for."""
    tmp = tempfile.mkdtemp(prefix="nvrar-hosts-bench-")
    try:
        hosts = _netns.Hosts(2, tmp)
        port = free_port()
        with hosts:
            for h in range(2):
                env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
                env.update({"MASTER_ADDR": hosts.addr(0), "MASTER_PORT": str(port), "RANK": str(h),
                            "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                            "NVRAR_SESSION_SECRET": SECRET, "PYTHONPATH": ROOT, "GLOO_SOCKET_IFNAME": "eth0"})
                argv = [sys.executable, "-m", "nvrar.bench", "--backends", "nvrar,deepspeed", "--min-bytes", "4K", "--max-bytes",
                        "16K", "--iters", "5", "--warmup", "2", "--json", os.path.join(tmp, f"bench{h}.json")]
                hosts.start(h, [{"argv": argv, "env": env, "log": os.path.join(tmp, f"bench{h}.log")}])
            codes = hosts.wait(240)
        log = open(os.path.join(tmp, "bench0.log")).read()
        assert codes == [0, 0], log[-3000:]
        assert "# total #wrong: 0" in log and "nvrar/two-shot" in log, log[-3000:]
        assert hosts.exists() == []
        with open(os.path.join(tmp, "bench0.json")) as f:
            data = json.load(f)
        why = data["meta"]["skipped"].get("deepspeed", "")
        assert "not installed" in why or "needs every rank on one host; these ranks run on 2 hosts" in why, why
        assert {r["backend"] for r in data["results"]} == {"nvrar"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_hosts_calls_benchmark_counts_every_piece():
    """benchmarks/hosts_calls.py (the per-call analysis of docs/results.md) on 2 hosts x 1 rank:
    every rank's data checked, and every timed call's put from the other host accounted for as
    pieces (NOTE [pieces]: 128 KB goes as three messages of at most 64 KB less 1 KB each)."""
    out = os.path.join(tempfile.mkdtemp(prefix="nvrar-hosts-calls-"), "calls.json")
    try:
        r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "hosts_calls.py"), "--hosts", "2",
                            "--bytes", "128K", "--iters", "30", "--warmup", "3", "--port", str(free_port()),
                            "--json", out], capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        with open(out) as f:
            recs = json.load(f)
    finally:
        shutil.rmtree(os.path.dirname(out), ignore_errors=True)
    assert [x["rank"] for x in recs] == [0, 1]
    for x in recs:
        assert x["checked"] and x["world"] == 2 and x["bytes"] == 128 << 10
        assert x["on_arrival"] + x["in_zone"] == 3 * 30, x
        assert 0 < x["median_us"] and 0 < x["phases_us_per_call"]["call"] and x["phases_us_per_call"]["remote"] > 0
    assert "rank 1: median" in r.stdout
