"""Communicator.all_reduce_add_rms_norm on real processes: against the unfused reference (the same
all-reduce, then the add and RMSNorm in fp32), within 1 ulp for x and bitwise for the residual;
bitwise identical across ranks; one-shot and two-shot give the same bits; errors."""

import pytest

from _launch import assert_all_ok, launch

DTYPES = ["float32", "float16", "bfloat16"]


@pytest.mark.parametrize("world,G", [(2, 2), (4, 4), (4, 2), (2, 1)], ids=["W2G2", "W4G4", "W4G2", "W2G1"])
def test_fused_matches_reference(world, G):
    # h not a multiple of the rank count; rows from 1 (fewer rows than ranks) to 64; a small
    # max_bytes so that the larger calls run in several chunks.
    args = {"G": G, "dtypes": DTYPES, "rows": [1, 3, 16, 64], "hs": [1, 7, 257, 1000], "max_bytes": 16384}
    reports = assert_all_ok(launch(world, "fused_check", args))
    for rep in reports:
        assert rep["failures"] == [], rep["failures"][:10]
        assert rep["checked"] == 3 * 4 * 4 * 3
        assert rep["worst_ulp"] <= 1
    assert len({rep["digest"] for rep in reports}) == 1, "x / residual differ between ranks (bitwise)"


def test_fused_bad_inputs_raise_before_communication():
    reports = assert_all_ok(launch(2, "fused_errors", {"G": 2}))
    for rep in reports:
        assert all(v is not None for v in rep["raised"].values()), rep["raised"]
        assert rep["epoch_before_good_call"] == 0  # nothing was communicated by the bad calls
        assert rep["good_ok"]
        assert "all_reduce_add_rms_norm" in rep["raised"]["shape"]
        assert "overlap" in rep["raised"]["overlap"]


@pytest.mark.parametrize("mode,algo", [("eps", "two-shot"), ("h", "two-shot"), ("h", "one-shot"), ("plain", None)])
def test_fused_mismatch(mode, algo):
    reports = assert_all_ok(launch(2, "fused_mismatch", {"G": 2, "mode": mode, "victim": 1, "algo": algo,
                                                         "timeout": 30}))
    for rep in reports:
        assert rep["error"] is not None and "mismatch" in rep["error"], rep
        assert "all_reduce_add_rms_norm(" in rep["error"], rep["error"]
    if mode == "eps":
        assert any("eps=1e-05" in rep["error"] for rep in reports), [r["error"] for r in reports]
    if mode == "h":
        assert any("h=4" in rep["error"] and "h=6" in rep["error"] for rep in reports), [r["error"] for r in reports]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fused_torch(backend):
    reports = assert_all_ok(launch(2, "fused_torch", {"backend": backend}, timeout=400))
    for rep in reports:
        for d in ("float32", "bfloat16"):
            assert rep[f"{d}_returns_inputs"] and rep[f"{d}_eager_ok"], rep
            assert rep[f"{d}_compiled_equal"], rep
            assert rep[f"{d}_fallback_used"] and rep[f"{d}_fallback_residual_ok"], rep
            assert rep[f"{d}_fallback_ulp"] <= (4 if d == "float32" else 1), rep
    for d in ("float32", "bfloat16"):
        assert len({rep[f"{d}_digest"] for rep in reports}) == 1
