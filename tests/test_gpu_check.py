"""scripts/gpu_check.sh --dry-run: everything the one-GPU check can check without a GPU (the order
of its deadlines, its steps' sum, its environment functions, the build plan, the tests' order and
NVSHMEM init modes, collection of tests/gpu, the sweep's arguments, the verdict parser), so that a
broken script is caught here and in CI, before a device minute is spent on it; and
scripts/gpu_verdict.py on the sample log and on a log cut off before its verdict."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERDICT = os.path.join(ROOT, "scripts", "gpu_verdict.py")
SAMPLE = os.path.join(ROOT, "tests", "data", "gpu_check-sample.log")


def deadlines(log):
    """The deadlines the dry run printed: [(device, launcher, grace, pytest-timeout, step), ...]."""
    rx = (r"gpu_check (?:netpath )?deadlines: device (\d+) s < launcher (\d+) s \+ grace (\d+) s "
          r"< pytest-timeout (\d+) s < (?:smoke|netpath) step (\d+) s")
    return [tuple(int(x) for x in m) for m in re.findall(rx, log)]


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

    # The deadlines of a GPU test, in order, as the check sets them: device 15 < launcher 45 (+ its
    # kill grace) < pytest-timeout 55 < the step's; the same for the network path.
    found = deadlines(log)
    assert len(found) == 2, log[-3000:]
    assert found[0][:2] == (15, 45) and found[0][3] == 55, found
    for device, launcher, grace, pytest_timeout, step in found:
        assert device < launcher and launcher + grace < pytest_timeout < step, found
    plan = re.search(r"^gpu_check plan: (.*) budget=(\d+)$", log, re.M)
    steps = dict(kv.split("=") for kv in plan.group(1).split())
    assert list(steps)[:6] == ["setup", "wheels", "build-smoke", "info", "smoke", "build-all"], steps
    assert sum(int(v) for v in steps.values()) == int(plan.group(2)) == int(m.group(1)), (steps, plan.group(2))
    # the init-mode split and the order of the tests
    split = re.search(r"^gpu_check init split: (.*)$", log, re.M).group(1)
    assert re.search(r"test_gpu\.py: \d+ launches, NVRAR_NVSHMEM_INIT=nvrar;", split), split
    assert re.search(r"test_gpu_smoke\.py: 2 launches, NVRAR_NVSHMEM_INIT=nvrar;", split), split
    assert re.search(r"test_gpu_nvshmem4py\.py: \d+ launches, NVRAR_NVSHMEM_INIT=nvshmem4py$", split), split
    order = re.search(r"^gpu_check test order: (.*) \(\d+ tests\)$", log, re.M).group(1)
    assert [c.split("(")[0] for c in order.split()] == ["smoke", "matrix", "graph", "timeout", "fused", "cupy",
                                                       "netpath", "nvshmem4py"], order
    assert re.search(r"^gpu_check build plan: all 18 nvcc units, smoke 5, rest 15; left to all after smoke and rest: 0",
                     log, re.M), log[-3000:]
    # the dry run's own log reads as a complete verdict
    own = subprocess.run([sys.executable, VERDICT, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert own.returncode == 0 and "dry-run verdict" in own.stdout and "steps not ok: none" in own.stdout, own.stdout
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
    """scripts/fetch_gpu_wheels.sh fetches what travels (Python 3.12, linux x86_64, at most 64 MiB with the
    working tree, leaving the optional libucx out where the sum with it is over);
    gpu_check's offline check passes on it and fails, naming the gap, once a requirement is missing."""
    whl = tmp_path / "whl"
    fetch = subprocess.run(["bash", os.path.join(ROOT, "scripts", "fetch_gpu_wheels.sh"), str(whl)], cwd=ROOT,
                           env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True, timeout=600)
    if fetch.returncode != 0 and "Could not find" in fetch.stderr + fetch.stdout:
        pytest.skip("the package registry cannot be reached from here: " + fetch.stderr[-500:])
    assert fetch.returncode == 0, fetch.stdout[-3000:] + fetch.stderr[-3000:]
    last = fetch.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"fetch_gpu_wheels: ([67]) wheels, (\d+) bytes \(\d+ MiB\) in .*, working tree (\d+) bytes", last)
    assert m and int(m.group(2)) + int(m.group(3)) <= 64 << 20, last  # what one device call carries, the tree too
    # 6: libucx (the optional network path) left out, said so, as the sum with it is over the limit
    assert (m.group(1) == "6") == ("left out libucx_cu13" in fetch.stdout), fetch.stdout[-2000:]
    good = _wheels_check(whl)
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-3000:]
    assert "Would install" in good.stdout and "nvshmem4py-cu13" in good.stdout, good.stdout[-2000:]
    for f in whl.iterdir():
        if f.name.startswith("cuda_core-"):
            f.unlink()
    bad = _wheels_check(whl)
    assert bad.returncode != 0 and "needs cuda.core>=0.5.0: neither carried nor on the GPU machine" in bad.stdout, \
        bad.stdout[-3000:]


def _verdict(path, *args):
    return subprocess.run([sys.executable, VERDICT, *args, str(path)], capture_output=True, text=True, timeout=60)


def test_verdict_of_the_sample_and_of_a_cut_off_log(tmp_path):
    """gpu_verdict.py reads every step, unit and note of the sample; a log cut off before its
    verdict is read from its step ends, said incomplete (exit 1), its unfinished steps "not
    reached"; a file that is no gpu_check log is refused (exit 2)."""
    import json

    full = _verdict(SAMPLE, "--json")
    assert full.returncode == 0, full.stdout + full.stderr
    v = json.loads(full.stdout)
    assert v["complete"] and not v["dry_run"] and v["final"] == {"status": 1, "elapsed": 302, "budget": 530}
    status = {s["name"]: (s["status"], s["elapsed"], s["deadline"]) for s in v["steps"]}
    assert status["smoke"] == ("ok", 24, 80) and status["tests"] == ("timeout", 163, 160), status
    assert status["netpath"][0] == "skipped" and status["build-rest"] == ("ok", 70, 205), status
    assert sum(v["plan"].values()) == v["budget"] == 530
    units = {(u["name"], u["set"]): u["seconds"] for u in v["units"]}
    assert units[("allreduce_float_OpSum.cu.o", "smoke")] == 36.9 and len(units) == 9, units
    text = _verdict(SAMPLE).stdout
    assert "nvcc units: 7 (smoke 5, rest 2); slowest allreduce_int32_t_OpMin.cu.o 41.5 s (rest)" in text, text
    assert "steps not ok: tests, sweep" in text, text

    with open(SAMPLE) as f:
        lines = f.read().splitlines()
    cut = tmp_path / "gpu_check.log"
    cut.write_text("\n".join(lines[:lines.index("step-end: smoke ok rc=0 elapsed=24 deadline=80") + 1]) + "\n")
    part = _verdict(tmp_path, "--json")
    assert part.returncode == 1, part.stdout + part.stderr
    p = json.loads(part.stdout)
    got = {s["name"]: s["status"] for s in p["steps"]}
    assert not p["complete"] and got["smoke"] == "ok" and got["tests"] == got["mps-stop"] == "not reached", got

    other = tmp_path / "other.log"
    other.write_text("nothing of gpu_check here\n")
    assert _verdict(other).returncode == 2
