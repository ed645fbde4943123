"""scripts/gpu_check.sh --dry-run: everything the one-GPU check can check without a GPU (its
environment functions, the CUDA build, collection of tests/gpu, the sweep's arguments), so that a
broken script is caught here and in CI, before a device minute is spent on it."""

import os
import re
import subprocess
import sys

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
    assert len(os.listdir(tmp_path)) <= 8
