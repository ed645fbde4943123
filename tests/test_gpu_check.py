"""scripts/gpu_check.sh --dry-run: everything the one-GPU check can check without a GPU (its
environment functions, the CUDA build, collection of tests/gpu, the sweep's arguments), so that a
broken script is caught here and in CI, before a device minute is spent on it."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    last = [line for line in out.splitlines() if line.strip()][-1]
    m = re.fullmatch(r"gpu_check dry-run: budget (\d+) s", last)
    assert m, f"last line {last!r}:\n{out[-3000:]}"
    assert int(m.group(1)) <= 540, last
    log = (tmp_path / "gpu_check.log").read_text()
    for step in ("environment", "tests/gpu: collected", "sweep arguments: OK", "script syntax: OK"):
        if step == "environment":
            assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in log and "NVSHMEM_DISABLE_P2P=1" in log, log[-3000:]
        else:
            assert step in log, log[-3000:]
    assert "build:" in log
    carried = os.path.join(ROOT, ".whl")
    if os.path.isdir(carried) and any(f.endswith(".whl") for f in os.listdir(carried)):
        assert "wheels: install offline for Python 3.12" in log, log[-3000:]
    else:
        assert "wheels: none carried" in log, log[-3000:]
    assert len(os.listdir(tmp_path)) <= 8


def _wheels_check(folder):
    """gpu_check.sh's own wheels_check function, run on `folder`."""
    script = os.path.join(ROOT, "scripts", "gpu_check.sh")
    cmd = f'source <(sed -n "/^wheels_check() {{/,/^}}/p" {script}); wheels_check {folder}'
    env = dict(os.environ, PY=sys.executable)
    return subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=180)


def test_fetched_wheels_install_offline_and_an_incomplete_set_is_refused(tmp_path):
    """scripts/fetch_gpu_wheels.sh fetches what travels (Python 3.12, linux x86_64, at most 64 MiB);
    gpu_check's offline check passes on it and fails, naming the gap, once a requirement is missing."""
    whl = tmp_path / "whl"
    fetch = subprocess.run(["bash", os.path.join(ROOT, "scripts", "fetch_gpu_wheels.sh"), str(whl)], cwd=ROOT,
                           env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True, timeout=600)
    if fetch.returncode != 0 and "Could not find" in fetch.stderr + fetch.stdout:
        pytest.skip("the package registry cannot be reached from here: " + fetch.stderr[-500:])
    assert fetch.returncode == 0, fetch.stdout[-3000:] + fetch.stderr[-3000:]
    last = fetch.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"fetch_gpu_wheels: 7 wheels, (\d+) bytes \(\d+ MiB\) in .*", last)
    assert m and int(m.group(1)) <= 64 << 20, last
    good = _wheels_check(whl)
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-3000:]
    assert "Would install" in good.stdout and "nvshmem4py-cu13" in good.stdout, good.stdout[-2000:]
    for f in whl.iterdir():
        if f.name.startswith("cuda_core-"):
            f.unlink()
    bad = _wheels_check(whl)
    assert bad.returncode != 0 and "needs cuda.core>=0.5.0: neither carried nor on the GPU machine" in bad.stdout, \
        bad.stdout[-3000:]
