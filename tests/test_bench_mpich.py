"""nvrar-bench's other MPI libraries (nvrar.bench.mpilibs): the mpich wheel installed into a
temporary directory (pip install --prefix, not --target, which leaves out the wheel's lib/ and so
its libmpi; no pip cache outside that directory), then a bare
`nvrar-bench --backends nvrar,mpich` on 2 ranks, which runs MPICH's MPI_Allreduce as a job of its
own under MPICH's mpiexec: its rows exist, are right and carry MPICH's library version. Skipped,
naming what is missing, where the wheel cannot be installed (no network, no wheel for this
platform) or this mpi4py cannot bind to MPICH. Intel MPI's job runs only where impi-rt is
installed. Under a launcher, and where a library is missing, the peer is skipped with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from nvrar.bench import mpilibs

from test_bench import bench_cmd, clean_env

ARGS = ["--min-bytes", "8K", "--max-bytes", "16K", "--iters", "20", "--warmup", "2", "--timing", "cold",
        "--buffers", "ordinary", "--algorithms", "auto"]


def _env(**extra):
    env = clean_env(**extra)
    for k in ("NVRAR_MPICH_PREFIX", "NVRAR_IMPI_PREFIX", "MPI4PY_LIBMPI", "MPI4PY_MPIABI"):
        if k not in extra:
            env.pop(k, None)
    return env


@pytest.fixture(scope="module")
def mpich_dir(tmp_path_factory):
    """The mpich wheel in a temporary --prefix directory; the install's time is printed."""
    why = mpilibs.mpi4py_mpich_abi()
    if why:
        pytest.skip(why)
    base = tmp_path_factory.mktemp("mpich")
    target = base / "mpich"
    env = dict(os.environ, PIP_CACHE_DIR=str(base / "pip-cache"), PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_NO_INPUT="1")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-cache-dir", "--only-binary", ":all:",
           "--ignore-installed", "--no-warn-script-location", "--timeout", "20", "--prefix", str(target), "mpich"]
    t0 = time.monotonic()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=75, env=env)
    except subprocess.TimeoutExpired:
        pytest.skip("pip install --prefix DIR mpich took over 75 s (a slow or absent network)")
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["(no message)"])[-1]
        pytest.skip(f"the mpich wheel could not be installed (pip install --prefix DIR mpich: no network, "
                    f"no pip or no wheel for this platform): {tail}")
    print(f"pip install --prefix {target} mpich: {time.monotonic() - t0:.1f} s")
    return str(target)


def test_mpich_peer_from_a_bare_start(mpich_dir, tmp_path):
    env = _env(NVRAR_MPICH_PREFIX=mpich_dir)
    t0 = time.monotonic()
    res = subprocess.run(bench_cmd() + ARGS + ["--backends", "nvrar,mpich", "--json", "r.json"], capture_output=True,
                         text=True, timeout=150, env=env, cwd=tmp_path)
    elapsed = time.monotonic() - t0
    assert res.returncode == 0, f"stdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}"
    with open(tmp_path / "r.json") as f:
        data = json.load(f)
    assert set(data) == {"meta", "results"}
    rows = [r for r in data["results"] if r["backend"] == "mpich"]
    assert sorted(r["bytes"] for r in rows) == [8192, 16384], data["meta"].get("skipped")
    for r in rows:
        assert r["wrong"] == 0 and r["algorithm"] == "MPI_Allreduce" and r["timing"] == "cold"
        assert "MPICH" in r["library_version"] and "Intel" not in r["library_version"], r["library_version"]
        assert r["min_us"] <= r["median_us"] <= r["p99_us"]
    assert {r["bytes"] for r in data["results"] if r["backend"] == "nvrar"} == {8192, 16384}
    assert all(r["wrong"] == 0 for r in data["results"])
    jobs = {j["name"]: j for j in data["meta"]["jobs"]}
    assert set(jobs) == {"default", "mpich"}
    assert jobs["mpich"]["libmpi"].startswith(mpich_dir) and jobs["mpich"]["launcher"].startswith(mpich_dir)
    assert "MPICH" in jobs["mpich"]["library_version"]
    assert "mpich" in data["meta"]["versions"]
    # one table: the mpich rows beside nvrar's, each with its library's first line
    out = res.stdout
    assert "mpich/MPI_Allreduce" in out and "MPICH Version" in out and "# job mpich" in out, out
    assert out.count("# total #wrong: 0") == 1 and "# wrote r.json" in out
    print(out)
    print(f"nvrar-bench --backends nvrar,mpich: {elapsed:.1f} s")


def test_mpich_prefix_site_packages_on_pythonpath_is_found(mpich_dir, monkeypatch):
    """Without NVRAR_MPICH_PREFIX, the --prefix install's site-packages on sys.path (PYTHONPATH)
    is found through the wheel's metadata (its RECORD names libmpi and mpiexec)."""
    import glob

    monkeypatch.delenv("NVRAR_MPICH_PREFIX", raising=False)
    site = glob.glob(os.path.join(mpich_dir, "lib", "python*", "site-packages"))
    assert site, os.listdir(mpich_dir)
    monkeypatch.setattr(sys, "path", site + sys.path)
    lib, why = mpilibs.find("mpich")
    assert why is None and lib is not None, why
    assert lib.libmpi.startswith(mpich_dir) and os.path.basename(lib.libmpi) == "libmpi.so.12"
    assert os.access(lib.mpiexec, os.X_OK)


def test_missing_library_is_skipped_with_what_to_install(tmp_path, monkeypatch):
    monkeypatch.delenv("NVRAR_MPICH_PREFIX", raising=False)
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    lib, why = mpilibs.find("mpich")
    assert lib is None and "pip install mpich --prefix DIR" in why and "NVRAR_MPICH_PREFIX=DIR" in why, why
    monkeypatch.delenv("NVRAR_IMPI_PREFIX", raising=False)
    lib, why = mpilibs.find("impi")
    assert lib is None and "pip install impi-rt==2021.16.1 --prefix DIR" in why, why
    # a --target install: its metadata without lib/ (pip leaves out a wheel's lib/ there)
    target = tmp_path / "target"
    (target / "mpich-5.0.2.dist-info").mkdir(parents=True)
    (target / "mpich-5.0.2.dist-info" / "RECORD").write_text("../libmpi.so.12,,\n../../bin/mpiexec,,\n")
    (target / "bin").mkdir()
    monkeypatch.setattr(sys, "path", [str(target)])
    lib, why = mpilibs.find("mpich")
    assert lib is None and "pip install --target leaves out" in why, why
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    # a prefix without the library: named, and the run goes on without it
    empty = tmp_path / "empty"
    empty.mkdir()
    res = subprocess.run(bench_cmd() + ARGS + ["--backends", "nvrar,mpich", "--launcher", "local", "--json", "r.json"],
                         capture_output=True, text=True, timeout=150, env=_env(NVRAR_MPICH_PREFIX=str(empty)),
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    with open(tmp_path / "r.json") as f:
        data = json.load(f)
    reason = data["meta"]["skipped"]["mpich"]
    assert f"NVRAR_MPICH_PREFIX={empty} has no lib/libmpi.so.12" in reason, reason
    assert {r["backend"] for r in data["results"]} == {"nvrar"}
    assert "skipped: " in res.stdout and "mpich (NVRAR_MPICH_PREFIX=" in res.stdout


def test_under_a_launcher_mpich_and_impi_are_skipped(tmp_path):
    """Started by the user's launcher the ranks have one MPI library already: mpich and impi are
    skipped with the reason, in the text and in the JSON."""
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if not os.path.exists(mpirun):
        pytest.skip("pip's Open MPI (mpirun) is not installed")
    res = subprocess.run([mpirun, "-n", "2", "--oversubscribe"] + bench_cmd() + ARGS +
                         ["--backends", "nvrar,mpi,mpich,impi", "--json", "r.json"],
                         capture_output=True, text=True, timeout=150, env=_env(), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    with open(tmp_path / "r.json") as f:
        data = json.load(f)
    for name in ("mpich", "impi"):
        assert "only by a bare start" in data["meta"]["skipped"][name], data["meta"]["skipped"]
        assert f"{name} (measured only by a bare start" in res.stdout
    assert {r["backend"] for r in data["results"]} == {"nvrar", "mpi"}
    assert all("Open MPI" in r["library_version"] for r in data["results"] if r["backend"] == "mpi")


def test_impi_peer_where_installed(tmp_path):
    """Intel MPI's job, where impi-rt is installed (NVRAR_IMPI_PREFIX, or the wheel on sys.path)."""
    lib, why = mpilibs.find("impi")
    if lib is None:
        pytest.skip(f"impi-rt is not installed here: {why}")
    why = mpilibs.mpi4py_mpich_abi()
    if why:
        pytest.skip(why)
    env = _env(NVRAR_IMPI_PREFIX=lib.prefix)
    res = subprocess.run(bench_cmd() + ARGS + ["--backends", "nvrar,impi", "--json", "r.json"], capture_output=True,
                         text=True, timeout=150, env=env, cwd=tmp_path)
    assert res.returncode == 0, f"stdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-4000:]}"
    with open(tmp_path / "r.json") as f:
        data = json.load(f)
    rows = [r for r in data["results"] if r["backend"] == "impi"]
    assert sorted(r["bytes"] for r in rows) == [8192, 16384], data["meta"].get("skipped")
    assert all(r["wrong"] == 0 and "Intel(R) MPI" in r["library_version"] for r in rows)
