"""nvrar-bench end to end: started bare (it launches its ranks), under mpirun, with emulated
nodes; the table shows the peers side by side, the JSON has the contract keys, the plot exists."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

RESULT_KEYS = {"backend", "algorithm", "bytes", "count", "dtype", "op", "median_us", "p99_us", "min_us",
               "algbw_gbps", "busbw_gbps", "wrong"}
QUICK = ["--min-bytes", "8K", "--max-bytes", "32K", "--iters", "5", "--warmup", "1"]


def bench_cmd():
    exe = shutil.which("nvrar-bench") or os.path.join(os.path.dirname(sys.executable), "nvrar-bench")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "nvrar.bench"]


def clean_env(**extra):
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"):
        env.pop(k, None)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_osc": "^ucx"})
    env.update(extra)
    return env


def run(cmd, tmp_path, timeout=300):
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env(), cwd=tmp_path)
    assert res.returncode == 0, f"{cmd}\nstdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}"
    return res.stdout


def load(path):
    with open(path) as f:
        data = json.load(f)
    assert set(data) == {"meta", "results"}
    for row in data["results"]:
        assert RESULT_KEYS <= set(row), set(row)
        assert row["wrong"] == 0, row
        assert row["min_us"] <= row["median_us"] <= row["p99_us"]
    return data


def test_bare_start_two_ranks_with_json_and_plot(tmp_path):
    out = run(bench_cmd() + QUICK + ["--json", "r.json", "--plot", "r.png"], tmp_path)
    assert "# world 2 ranks" in out and "busbw" in out
    data = load(tmp_path / "r.json")
    backends = {r["backend"] for r in data["results"]}
    assert "nvrar" in backends
    assert {"mpi", "gloo"} <= backends, "the CPU peers must run in the same run"
    sizes = sorted({r["bytes"] for r in data["results"]})
    assert sizes == [8192, 16384, 32768]
    for size in sizes:  # peers side by side at every size
        assert {r["backend"] for r in data["results"] if r["bytes"] == size} >= {"nvrar", "mpi", "gloo"}
    assert data["meta"]["skipped"]["nccl"] and data["meta"]["skipped"]["nvshmem"]
    png = (tmp_path / "r.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10000
    print(out)


def test_local_launcher_with_emulated_nodes(tmp_path):
    out = run(bench_cmd() + QUICK + ["--launcher", "local", "--ranks", "3", "--ranks-per-node", "1",
                                     "--backends", "nvrar,mpi", "--json", "r.json"], tmp_path)
    data = load(tmp_path / "r.json")
    assert data["meta"]["world_size"] == 3 and data["meta"]["num_nodes"] == 3
    assert "mpi" in data["meta"]["skipped"]  # not launched by mpirun: reported, not an error
    assert "skipped: mpi" in out
    assert data["meta"]["control"] == "nvrar"  # no MPI, no torch: a control communicator of its own


@pytest.mark.skipif(shutil.which("mpirun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "mpirun")),
                    reason="mpirun not installed")
def test_under_mpirun_four_ranks_two_per_node(tmp_path):
    mpirun = shutil.which("mpirun") or os.path.join(os.path.dirname(sys.executable), "mpirun")
    out = run([mpirun, "-n", "4", "--oversubscribe"] + bench_cmd() + QUICK +
              ["--ranks-per-node", "2", "--dtype", "bfloat16", "--json", "r.json"], tmp_path)
    data = load(tmp_path / "r.json")
    assert data["meta"]["world_size"] == 4 and data["meta"]["num_nodes"] == 2
    assert data["meta"]["launcher"] == "mpirun/srun"  # started by the user's mpirun, not by a bare start
    assert {r["dtype"] for r in data["results"]} == {"bfloat16"}
    assert "mpi/MPI_Allreduce" in data["meta"]["skipped"]  # MPI has no bfloat16
    # the text report says the same
    assert "# world 4 ranks, 2 per node (2 nodes)" in out and "# total #wrong: 0" in out
    assert "gloo" in {r["backend"] for r in data["results"]}
    # the benchmark's own coordination goes through MPI under mpirun, never through gloo, whose
    # tcp loop threads were measured busy beside the timed backends (docs/results.md)
    assert data["meta"]["control"] == "mpi"


CONTROL_DEADLINE = """
import sys, time
from mpi4py import MPI
from nvrar.bench.runner import Control
ctl = Control(None, timeout=1.0)
assert ctl.kind == "mpi", ctl.kind
if MPI.COMM_WORLD.Get_rank() == 1:
    time.sleep(30)  # never reaches the barrier
t0 = time.monotonic()
try:
    ctl.barrier()
except SystemExit as exc:
    print(f"raised after {time.monotonic() - t0:.2f} s: {exc}", flush=True)
    MPI.COMM_WORLD.Abort(3)
"""


@pytest.mark.skipif(shutil.which("mpirun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "mpirun")),
                    reason="mpirun not installed")
def test_control_barrier_under_mpirun_has_a_deadline(tmp_path):
    """The benchmark's own MPI barrier waits at most --timeout for a rank that never comes, then
    ends the rank with an error naming it (and mpirun the job): no hang."""
    mpirun = shutil.which("mpirun") or os.path.join(os.path.dirname(sys.executable), "mpirun")
    t0 = time.monotonic()
    res = subprocess.run([mpirun, "-n", "2", "--oversubscribe", sys.executable, "-c", CONTROL_DEADLINE],
                         capture_output=True, text=True, timeout=60, env=clean_env(), cwd=tmp_path)
    elapsed = time.monotonic() - t0
    assert res.returncode != 0, res.stdout + res.stderr
    assert "rank 0: the benchmark's own barrier (MPI) waited 1 s (--timeout)" in res.stdout, res.stdout + res.stderr
    raised = float(res.stdout.split("raised after ")[1].split(" s")[0])
    assert 1.0 <= raised < 3.0 and elapsed < 25, (raised, elapsed)


def test_bad_arguments_are_rejected(tmp_path):
    res = subprocess.run(bench_cmd() + ["--min-bytes", "lots"], capture_output=True, text=True, timeout=60,
                         env=clean_env(), cwd=tmp_path)
    assert res.returncode == 2 and "not a size" in res.stderr
    res = subprocess.run(bench_cmd() + ["--buffers", "weird"], capture_output=True, text=True, timeout=60,
                         env=clean_env(), cwd=tmp_path)
    assert res.returncode == 2 and "--buffers" in res.stderr


def test_device_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    import nvrar

    if nvrar.build_info()["gpus"]:
        pytest.skip("a GPU is present: tests/gpu covers --device cuda")
    res = subprocess.run(bench_cmd() + ["--device", "cuda"], capture_output=True, text=True, timeout=60,
                         env=clean_env(), cwd=tmp_path)
    assert res.returncode == 2 and "--device cuda" in res.stderr, res.stderr


def test_algorithms_option_and_its_deprecated_spelling(tmp_path):
    """--algorithms picks nvrar's algorithms (the JSON key stays "algorithm"); --algos still works,
    with one note on stderr (not one per launched rank)."""
    args = QUICK + ["--launcher", "local", "--ranks", "2", "--backends", "nvrar", "--buffers", "ordinary"]
    for flag in ("--algorithms", "--algos"):
        res = subprocess.run(bench_cmd() + args + [flag, "two-shot", "--json", "r.json"], capture_output=True,
                             text=True, timeout=300, env=clean_env(), cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-4000:]
        data = load(tmp_path / "r.json")
        assert {r["algorithm"] for r in data["results"]} == {"two-shot"}, flag
        notes = res.stderr.count("--algos is deprecated; use --algorithms")
        assert notes == (1 if flag == "--algos" else 0), res.stderr


def test_timing_cold_warm_and_both(tmp_path):
    """--timing: cold rows (a barrier before every timed call), warm rows (back to back), or both;
    every row says which (key "timing"), and so does the header."""
    args = QUICK + ["--backends", "nvrar,mpi", "--buffers", "ordinary", "--algorithms", "auto"]
    for timing, expect in (("cold", {"cold"}), ("warm", {"warm"}), ("both", {"cold", "warm"})):
        run(bench_cmd() + args + ["--timing", timing, "--json", f"{timing}.json"], tmp_path)
        data = load(tmp_path / f"{timing}.json")
        assert data["meta"]["timing"] == timing
        assert {r["timing"] for r in data["results"]} == expect, timing
        for size in (8192, 16384, 32768):
            for backend in ("nvrar", "mpi"):
                got = sorted(r["timing"] for r in data["results"] if r["bytes"] == size and r["backend"] == backend)
                assert got == sorted(expect), (timing, size, backend, got)
    res = subprocess.run(bench_cmd() + ["--timing", "lukewarm"], capture_output=True, text=True, timeout=60,
                         env=clean_env(), cwd=tmp_path)
    assert res.returncode == 2 and "--timing" in res.stderr


def test_the_default_timing_is_both(tmp_path):
    run(bench_cmd() + QUICK + ["--backends", "nvrar", "--buffers", "symmetric", "--algorithms", "one-shot",
                               "--launcher", "local", "--json", "r.json"], tmp_path)
    data = load(tmp_path / "r.json")
    assert data["meta"]["timing"] == "both"
    assert sorted(r["timing"] for r in data["results"] if r["bytes"] == 8192) == ["cold", "warm"]


def _deepspeed_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def test_deepspeed_peer_runs_where_installed(tmp_path):
    """The DeepSpeed shm all-reduce beside nvrar in one run; where DeepSpeed is not installed the
    run still succeeds and says why the peer was skipped. Nothing of DeepSpeed's stays in
    /dev/shm (it never removes its 69 MB segments itself)."""
    before = set(os.listdir("/dev/shm"))
    out = run(bench_cmd() + QUICK + ["--backends", "nvrar,deepspeed", "--buffers", "ordinary", "--algorithms", "auto",
                                     "--timing", "cold", "--json", "r.json"], tmp_path, timeout=600)
    data = load(tmp_path / "r.json")
    skipped = data["meta"]["skipped"]
    rows = [r for r in data["results"] if r["backend"] == "deepspeed"]
    if not _deepspeed_installed():
        assert "not installed" in skipped["deepspeed"] and not rows
        return
    if rows:
        assert {r["bytes"] for r in rows} == {8192, 16384, 32768} and all(r["wrong"] == 0 for r in rows)
        assert "deepspeed/shm" in out
        left = sorted(f for f in set(os.listdir("/dev/shm")) - before if f.startswith("deepspeed_"))
        assert left == [], left
    else:  # installed, but its shm op cannot run here: skipped, with that reason
        reason = skipped.get("deepspeed") or skipped.get("deepspeed/shm", "")
        assert "shm" in reason or "avx" in reason, skipped


def test_deepspeed_absent_is_skipped_with_the_reason(tmp_path):
    """A DeepSpeed that cannot be imported (a package on PYTHONPATH that raises ImportError, as
    an absent one does) is reported as skipped, not an error."""
    fake = tmp_path / "fake" / "deepspeed"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named deepspeed (test)')\n")
    env = clean_env(PYTHONPATH=str(tmp_path / "fake"))
    res = subprocess.run(bench_cmd() + QUICK + ["--backends", "nvrar,deepspeed", "--buffers", "ordinary",
                                                "--algorithms", "auto", "--timing", "warm", "--json", "r.json"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    data = load(tmp_path / "r.json")
    assert "not installed" in data["meta"]["skipped"]["deepspeed"]
    assert {r["backend"] for r in data["results"]} == {"nvrar"}
    assert "skipped: deepspeed (DeepSpeed is not installed" in res.stdout


def test_spin_barrier_holds_every_rank_until_the_last_and_has_a_deadline(tmp_path):
    """nvrar/bench/spin_barrier.py, the barrier before every cold-timed call of nvrar-bench and
    latency_check: no rank leaves before the last one arrives, generation after generation, and a
    rank that never comes ends the wait with an error naming it."""
    import multiprocessing as mp

    from nvrar.bench.spin_barrier import SpinBarrier

    path = str(tmp_path / "barrier")
    ctx = mp.get_context("fork")
    left = ctx.Queue()

    def rank(r: int) -> None:
        b = SpinBarrier(path, r, 3, timeout_s=30)
        for g in range(5):
            if r == g % 3:
                time.sleep(0.05)  # a different late rank each generation
            arrived = time.monotonic()
            b.wait()
            left.put((g, r, arrived, time.monotonic()))

    SpinBarrier(path, 0, 3).close()  # the file sized before any rank waits
    procs = [ctx.Process(target=rank, args=(r,)) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    rows = [left.get(timeout=5) for _ in range(15)]
    for g in range(5):
        mine = [row for row in rows if row[0] == g]
        last_arrival = max(row[2] for row in mine)
        assert all(row[3] >= last_arrival for row in mine), mine
    alone = SpinBarrier(str(tmp_path / "alone"), 0, 2, timeout_s=0.3)
    with pytest.raises(RuntimeError, match="rank 0 waited 0.3 s for rank 1"):
        alone.wait()


def test_line_round_trip_probe_measures_and_rejects_bad_cpus():
    """nvrar._C.line_round_trip_ns, the host-state mark of latency_check's records: one positive
    figure per rep between two CPUs of this process (a cache-line round trip is above 10 ns and,
    on any host these tests run on, below 100 us); the same CPU twice, or a CPU outside this
    process's set, is an error, and the calling thread's CPU set is left as it was."""
    from nvrar import _C
    from nvrar.errors import NvrarError

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("the probe needs two CPUs; this process may use one")
    got = _C.line_round_trip_ns(cpus[0], cpus[1], trips=500, reps=3)
    assert len(got) == 3 and all(10 < x < 100_000 for x in got), got
    assert sorted(os.sched_getaffinity(0)) == cpus
    with pytest.raises(NvrarError, match="two different CPUs"):
        _C.line_round_trip_ns(cpus[0], cpus[0])
    outside = max(os.cpu_count() or 1, max(cpus) + 1)
    if outside < 1024:
        with pytest.raises(NvrarError, match="could not pin"):
            _C.line_round_trip_ns(cpus[0], outside)
    with pytest.raises(NvrarError, match="trips, reps and a deadline"):
        _C.line_round_trip_ns(cpus[0], cpus[1], trips=0)
