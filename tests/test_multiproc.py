"""The correctness matrix on real processes that pytest starts itself, one per rank, for every
rank layout (W ranks, G per node), including non-powers of two and emulated nodes."""

import pytest

from _launch import assert_all_ok, launch

LAYOUTS = [(2, 1), (2, 2), (3, 1), (4, 2), (6, 2), (8, 4), (5, 1), (3, 3)]


def check_reports(reports, world):
    assert len(reports) == world
    for section in ("matrix", "random", "burst"):
        pick = (lambda r: r) if section == "matrix" else (lambda r, s=section: r[s])
        for rep in reports:
            assert pick(rep)["failures"] == [], pick(rep)["failures"]
            assert pick(rep)["checked"] > 0
        digests = {pick(rep)["digest"] for rep in reports}
        assert len(digests) == 1, f"{section}: results differ between ranks (bitwise)"


# Result delivery: with a tiny threshold every two-shot shard goes by cross-memory write (or by
# direct store into a pool output); with NVRAR_CMA=0 private outputs pull from the segment.
# LL: every inter-node shard up to 64 KB goes as LL packets (the GPU's small-shard transport).
DELIVERY = {"cma": {"NVRAR_CMA_MIN_BYTES": "64"}, "pull": {"NVRAR_CMA": "0", "NVRAR_LL_MAX_BYTES": "64K"}}


@pytest.mark.parametrize("delivery", sorted(DELIVERY))
@pytest.mark.parametrize("world,G", LAYOUTS, ids=[f"W{w}G{g}" for w, g in LAYOUTS])
def test_matrix(world, G, delivery):
    """dtypes x ops x counts (0, 1, G-1, primes, > max_bytes) x in/out of place x zero-copy x
    variants, then 300 back-to-back calls of varying size with no barrier."""
    reports = assert_all_ok(launch(world, "matrix", {"G": G, "max_bytes": 8192, "burst": 300},
                                   env=DELIVERY[delivery]))
    check_reports(reports, world)
    assert reports[0]["checked"] >= 2000  # the whole matrix ran
    assert reports[0]["burst"]["checked"] == 300
    assert all(r["cma_enabled"] == (delivery == "cma") for r in reports)


def test_torch_distributed_groups():
    """Communicator() on an initialized gloo default group, and Communicator(group=subgroup)."""
    reports = assert_all_ok(launch(4, "torchgroup", {"G": 2}))
    for rep in reports:
        assert rep["bootstrap"] == "torch"
        assert rep["matrix"]["failures"] == [] and rep["sum_ok"]
    assert len({rep["matrix"]["digest"] for rep in reports}) == 1
    subs = [rep["sub"] for rep in reports if "sub" in rep]
    assert sorted(s["rank"] for s in subs) == [0, 1]
    assert all(s["world"] == 2 and s["max_ok"] for s in subs)


def test_launcher_drains_every_rank_while_it_waits(tmp_path):
    """A rank that prints far more than a pipe holds (the GPU tasks print two progress lines per
    call) while rank 0 waits for it: the launcher must take every rank's output at once. Draining
    rank 0 first left the last rank blocked in a write after about 600 GPU calls, and rank 0's
    kernel timed out waiting for it."""
    flag = str(tmp_path / "written")
    res = launch(2, "chatty", {"bytes": 1 << 20, "flag": flag, "wait": 20.0}, timeout=60)
    reports = assert_all_ok(res)
    assert reports[0]["saw_flag"], "the last rank never finished writing while rank 0 waited"
    assert len(res[1].stdout) >= (1 << 20) - 100 and len(res[1].stderr) >= (1 << 20) - 100
