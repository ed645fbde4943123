"""The correctness matrix under mpirun: every layout (W, G) is a sub-communicator of
MPI.COMM_WORLD, bootstrapped over MPI. Ranks assert on the gathered reports of all ranks, so
every rank passes or fails together (no rank is left waiting in a collective)."""

from __future__ import annotations

import pytest

import nvrar
import _matrix

LAYOUTS = [(2, 1), (2, 2), (3, 1), (4, 2), (6, 2), (8, 4), (5, 1), (3, 3)]


def world():
    from mpi4py import MPI

    return MPI, MPI.COMM_WORLD


@pytest.mark.parametrize("W,G", LAYOUTS, ids=[f"W{w}G{g}" for w, g in LAYOUTS])
def test_layout(W, G):
    MPI, comm_world = world()
    if comm_world.size < W:
        pytest.skip(f"needs {W} ranks, launched with {comm_world.size}")
    sub = comm_world.Split(0 if comm_world.rank < W else MPI.UNDEFINED, comm_world.rank)
    report = None
    if sub != MPI.COMM_NULL:
        with nvrar.Communicator(group=sub, ranks_per_node=G, max_bytes=8192, timeout=60) as comm:
            assert comm.bootstrap == "mpi" and comm.world_size == W and comm.num_nodes == W // G
            report = _matrix.run_matrix(comm, quick=True)
            report["burst"] = _matrix.run_burst(comm, calls=200, seed=W * 10 + G)
        sub.Free()
    reports = [r for r in comm_world.allgather(report) if r is not None]
    assert len(reports) == W
    for section in ("matrix", "random", "burst"):
        pick = (lambda r: r) if section == "matrix" else (lambda r, s=section: r[s])
        assert all(pick(r)["failures"] == [] for r in reports), [pick(r)["failures"] for r in reports]
        assert len({pick(r)["digest"] for r in reports}) == 1, f"{section}: ranks differ bitwise"
    assert reports[0]["checked"] > 500


def test_default_bootstrap_is_mpi_comm_world():
    _, comm_world = world()
    with nvrar.Communicator(timeout=60) as comm:
        assert comm.bootstrap == "mpi"
        assert comm.world_size == comm_world.size and comm.rank == comm_world.rank
        assert comm.ranks_per_node == comm.world_size  # one host: the launcher's local size
        import numpy as np

        x = np.full(4099, comm.rank, dtype=np.int32)
        comm.all_reduce(x)
        assert np.all(x == sum(range(comm.world_size)))
