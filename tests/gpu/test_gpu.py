"""The GPU executor on real processes: the timeout path, the correctness matrix on CUDA tensors
(with emulated nodes, so that inter-node exchanges go through NVSHMEM), CUDA-graph replays, the
fused all-reduce + add + RMSNorm, cupy input. Several processes may share one GPU (NVSHMEM's
multi-process-per-GPU mode): the environment below is the one that mode needs. NVSHMEM is
initialized by nvrar itself here (NVRAR_NVSHMEM_INIT=nvrar): test_gpu_nvshmem4py.py alone goes
through nvshmem4py, so that a fault of the nvshmem4py stack fails those tests only.

Ordered by what they tell (scripts/gpu_check.sh runs test_gpu_smoke.py before, with --maxfail=1,
and test_gpu_nvshmem4py.py after): the core matrix (every layout, then put-with-signal only),
CUDA graphs, the timeout path (a hang reported with its phase, step and peer), the fused kernel,
cupy; the network-path test runs in its own step."""

import os

import pytest

from _launch import assert_all_ok, launch

# One GPU, several PEs: no network transport, no NVLS/NCCL inside NVSHMEM, bootstrap on loopback.
ONE_GPU_ENV = {
    "NVSHMEM_REMOTE_TRANSPORT": "none",
    "NVSHMEM_DISABLE_NVLS": "1",
    "NVSHMEM_DISABLE_NCCL": "1",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
    "NVSHMEM_SYMMETRIC_SIZE": "1G",
}


# The launcher's deadline per test (scripts/gpu_check.sh sets it below pytest-timeout's, so that a
# hang is reported with every rank's output instead of killing pytest).
LAUNCH_TIMEOUT = float(os.environ.get("NVRAR_GPU_LAUNCH_TIMEOUT", "600"))


def env(init="nvrar"):
    """The ranks' environment: one GPU's NVSHMEM settings (the caller's NVSHMEM_* win, NVSHMEM_DEBUG
    included) and how NVSHMEM is initialized (NVRAR_NVSHMEM_INIT, fixed by the test module)."""
    e = dict(ONE_GPU_ENV)
    e.update({k: v for k, v in os.environ.items() if k.startswith("NVSHMEM_")})  # the caller's settings win
    e["NVRAR_NVSHMEM_INIT"] = init
    return e


LAYOUTS = [(2, 1), (4, 2), (2, 2), (3, 1)]


@pytest.mark.parametrize("world,G", LAYOUTS, ids=[f"W{w}G{g}" for w, g in LAYOUTS])
def test_gpu_matrix(world, G):
    reports = assert_all_ok(launch(world, "gpu_matrix", {"G": G}, env=env(), timeout=LAUNCH_TIMEOUT))
    for section in ("matrix", "random", "burst"):
        pick = (lambda r: r) if section == "matrix" else (lambda r, s=section: r[s])
        assert all(pick(r)["failures"] == [] for r in reports), [pick(r)["failures"] for r in reports]
        assert len({pick(r)["digest"] for r in reports}) == 1, f"{section}: ranks differ bitwise"


def test_gpu_matrix_put_with_signal_only():
    """LL off: every inter-node exchange is a put-with-signal."""
    e = env()
    e["NVRAR_LL_MAX_BYTES"] = "0"
    reports = assert_all_ok(launch(4, "gpu_matrix", {"G": 2}, env=e, timeout=LAUNCH_TIMEOUT))
    assert all(r["failures"] == [] and r["burst"]["failures"] == [] for r in reports)


def test_cuda_graph_1000_replays():
    reports = assert_all_ok(launch(2, "gpu_graph", {"G": 1, "replays": 1000}, env=env(), timeout=LAUNCH_TIMEOUT))
    assert all(r["wrong_replays"] == 0 and r["replays"] >= 30 for r in reports), reports


def test_timeout_raises_at_check():
    timeout = 5
    res = launch(3, "gpu_timeout", {"G": 1, "timeout": timeout}, env=env(), timeout=min(120, LAUNCH_TIMEOUT))
    reports = [r.report for r in res[:2]]
    for rep in reports:
        assert rep is not None and rep["raised"] is not None, rep
        assert rep["is_timeout"], rep
        assert rep["elapsed"] < timeout + 10, rep
        assert rep["phase"] in ("reduce-scatter", "inter-node", "all-gather", "one-shot-reduce"), rep


FUSED_LAYOUTS = [(2, 2), (4, 2)]


@pytest.mark.parametrize("world,G", FUSED_LAYOUTS, ids=[f"W{w}G{g}" for w, g in FUSED_LAYOUTS])
def test_gpu_fused_add_rms_norm(world, G):
    """all_reduce_add_rms_norm on the GPU executor (fused_kernel.cuh) against the unfused
    reference, 3 dtypes, rows across several chunks (max_bytes=1 MiB: 8 rows of h=4096 bf16 per
    two-shot chunk), h not a multiple of the rank count; bitwise identical across ranks."""
    args = {"G": G, "max_bytes": 1 << 20, "dtypes": ["float32", "float16", "bfloat16"], "rows": [1, 3, 17],
            "hs": [7, 33, 4096]}
    reports = assert_all_ok(launch(world, "gpu_fused", args, env=env(), timeout=LAUNCH_TIMEOUT))
    for r in reports:
        assert r["failures"] == [], r["failures"]
        assert r["worst_ulp"] <= 1 and r["cases"] >= 3 * 2 * 2 and r["checked"] == 3 * r["cases"], r
        assert all(v is not None for v in r["raised"].values()), r["raised"]
        assert r["raised"]["numpy"].startswith("TypeError") and "device='cuda'" in r["raised"]["numpy"], r["raised"]
        assert r["raised"]["cpu"].startswith("ValueError") and "cuda:" in r["raised"]["cpu"], r["raised"]
    assert len({r["digest"] for r in reports}) == 1, "ranks differ bitwise"


def test_cupy_input():
    pytest.importorskip("cupy")
    reports = assert_all_ok(launch(2, "gpu_cupy", {"G": 2}, env=env(), timeout=min(300, LAUNCH_TIMEOUT)))
    assert all(r["ok"] and r["ok_empty"] for r in reports)


@pytest.mark.skipif(os.environ.get("NVRAR_GPU_NETPATH") != "1",
                    reason="network-path mode only (scripts/gpu_check.sh: NVSHMEM_DISABLE_P2P=1, UCX over TCP)")
def test_netpath_matrix_through_host_proxy():
    """Two PEs, one per emulated node, peer-to-peer off: every exchange (LL packets from the llout
    staging, put-with-signal) goes through NVSHMEM's remote transport and its proxy thread."""
    e = env()
    assert e.get("NVSHMEM_DISABLE_P2P") == "1" and e.get("NVSHMEM_REMOTE_TRANSPORT") not in (None, "none"), e
    reports = assert_all_ok(launch(2, "gpu_matrix", {"G": 1}, env=e, timeout=LAUNCH_TIMEOUT))
    for section in ("matrix", "random", "burst"):
        pick = (lambda r: r) if section == "matrix" else (lambda r, s=section: r[s])
        assert all(pick(r)["failures"] == [] for r in reports), [pick(r)["failures"] for r in reports]
        assert len({pick(r)["digest"] for r in reports}) == 1, f"{section}: ranks differ bitwise"
