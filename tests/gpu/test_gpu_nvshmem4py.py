"""nvrar and nvshmem4py sharing one NVSHMEM on a GPU (docs/gpu/executor.md, "nvrar and
nvshmem4py"): nvshmem4py first and nvrar joining it, nvrar first initializing through nvshmem4py,
zero-copy all-reduces of nvshmem.core.tensor buffers (below and above nvrar's segment, buffer
kinds differing per rank), and nvshmem4py's own calls after nvrar's. Needs nvshmem4py
(scripts/gpu_check.sh installs it from the wheels carried in .whl/). The only GPU tests that
initialize NVSHMEM through nvshmem4py (NVRAR_NVSHMEM_INIT=nvshmem4py; test_gpu.py runs nvrar's own)."""

import os

import pytest

from _launch import assert_all_ok, launch
from test_gpu import LAUNCH_TIMEOUT, env

from nvrar import _gpu



@pytest.fixture(autouse=True)
def _needs_nvshmem4py():
    if _gpu.nvshmem4py_version() is not None:
        return
    if os.environ.get("NVRAR_GPU_REQUIRED") == "1":  # scripts/gpu_check.sh: a skip would read as a pass
        pytest.fail("NVRAR_GPU_REQUIRED=1 but nvshmem4py is not installed (scripts/gpu_check.sh installs it from "
                    ".whl/, which scripts/fetch_gpu_wheels.sh fills)")
    pytest.skip("nvshmem4py is not installed (pip install '.[nvshmem4py]')")


def _check_reduces(r):
    assert r["failures"] == [], r["failures"]
    sym = r["symmetric"]
    assert sym["ordinary"] is False, sym  # torch's own memory is staged
    assert all(v for k, v in sym.items() if k not in ("ordinary", "mixed")), sym


def test_nvshmem4py_first_then_nvrar_joins():
    reports = assert_all_ok(launch(2, "gpu_n4p_join", {"G": 2}, env=env("nvshmem4py"), timeout=LAUNCH_TIMEOUT))
    for rank, r in enumerate(reports):
        _check_reduces(r)
        assert r["symmetric"]["mixed"] is (rank % 2 == 0), r["symmetric"]
        assert r["calls"]["put_ok"] and r["calls"]["reduce_ok"] in (None, True), r["calls"]
        assert r["status_after_close"] >= 2, r  # nvrar dropped only its own reference
        assert r["calls_after_close"]["put_ok"], r["calls_after_close"]


def test_nvrar_first_initializes_through_nvshmem4py():
    reports = assert_all_ok(launch(2, "gpu_n4p_init", {"G": 2}, env=env("nvshmem4py"), timeout=LAUNCH_TIMEOUT))
    for r in reports:
        assert r["n4p_initialized"] is True and r["status"] >= 2, r
        _check_reduces(r)
        assert r["calls"]["put_ok"] and r["calls"]["reduce_ok"] in (None, True), r["calls"]
        assert r["status_after_first_close"] >= 2, r
        assert r["status_after_last_close"] == 0 and r["n4p_initialized_after"] is False, r
