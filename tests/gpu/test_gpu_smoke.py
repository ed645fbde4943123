"""First contact with a GPU (scripts/gpu_check.sh runs this file first, alone, with --maxfail=1):
nvrar's own NVSHMEM initialization (NVRAR_NVSHMEM_INIT=nvrar) and one float32 sum of each
inter-node protocol path (one-shot with LL packets, two-shot with LL packets, two-shot with
put-with-signal), on 2 ranks of one node each and on 4 ranks in 2 nodes of 2. It needs only the
float32 and bfloat16 sum instances of the kernel, which the check builds first
(NVRAR_CUDA_UNITS=smoke) while the other instances compile. Every rank's output (progress lines,
NVSHMEM_DEBUG=INFO) is printed, pass or fail."""

import pytest

from _launch import assert_all_ok, describe, launch
from test_gpu import LAUNCH_TIMEOUT, env

SMOKE_LAYOUTS = [(2, 1), (4, 2)]
CALLS = ["one-shot LL", "two-shot LL", "two-shot put-with-signal"]


@pytest.mark.parametrize("world,G", SMOKE_LAYOUTS, ids=[f"W{w}G{g}" for w, g in SMOKE_LAYOUTS])
def test_smoke(world, G):
    e = env("nvrar")
    res = launch(world, "gpu_smoke", {"G": G}, env=e, timeout=LAUNCH_TIMEOUT)
    print(describe(res))  # in the log even when it passes (pytest -rA): NVSHMEM_DEBUG=INFO's account of the init
    reports = assert_all_ok(res)
    for r in reports:
        assert [c["name"] for c in r["calls"]] == CALLS, r["calls"]
        assert r["failures"] == [], r["failures"]
