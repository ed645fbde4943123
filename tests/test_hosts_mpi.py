"""Open MPI's mpirun across namespace hosts (tests/_netns_mpi.py, what benchmarks/hosts_bench.py
launches MPI_Allreduce with): 2 hosts x 2 ranks, each rank nvrar over MPI.COMM_WORLD with the
inter-host half over UCX, bitwise equal to MPI_Allreduce. Catches the launch breaking (agent,
TMPDIR, interfaces) and pip's Open MPI, which bundles its own UCX, taking the place of the libucx
wheel's (nvrar._setup.preload_ucx). Skipped with the reason without root, namespaces, UCX, mpirun
or mpi4py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

import _netns
import _netns_mpi

HERE = os.path.dirname(os.path.abspath(__file__))
WHY_NOT = _netns.why_not()
MPIRUN, NO_MPI = _netns_mpi.find_mpirun()
try:
    import libucx  # noqa: F401

    NO_UCX = None
except ImportError:
    NO_UCX = "UCX is not installed (pip install 'nvrar[ucx]')"

pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT)),
              pytest.mark.skipif(NO_UCX is not None, reason=str(NO_UCX)),
              pytest.mark.skipif(bool(NO_MPI), reason=NO_MPI)]


def test_mpirun_across_namespace_hosts_2x2():
    with tempfile.TemporaryDirectory(prefix="nvrar-hosts-mpi-") as tmp:
        with _netns.Hosts(2, tmp) as hosts:
            launch = _netns_mpi.MpiHosts(hosts, tmp)
            launch.start()
            cmd = launch.command(MPIRUN, 2, [sys.executable, os.path.join(HERE, "_hosts_mpi_task.py")])
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=_netns_mpi.mpirun_env())
            finally:
                codes = launch.stop()
            shm = [open(os.path.join(tmp, f"shm-{i}.txt")).read().split() for i in range(2)]
        assert not hosts.exists()
    assert r.returncode == 0, f"mpirun failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    rows = sorted((json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")), key=lambda d: d["rank"])
    assert [d["rank"] for d in rows] == [0, 1, 2, 3], r.stdout
    assert [d["host"] for d in rows] == ["nvrhost0", "nvrhost0", "nvrhost1", "nvrhost1"]
    for d in rows:
        assert d["mpi_rank"] == d["rank"] and d["size"] == 4 and d["bootstrap"] == "mpi"
        assert (d["nodes"], d["ranks_per_node"]) == (2, 2)
        assert d["equal"], f"rank {d['rank']}: nvrar's sum differs from MPI_Allreduce's"
        assert d["transports"] and all(t.startswith("tcp") for t in d["transports"]), d["transports"]
    assert codes == [0, 0]
    assert shm == [[], []], f"left in the hosts' /dev/shm: {shm}"
