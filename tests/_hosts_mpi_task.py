"""One rank of test_hosts_mpi.py, started by mpirun inside a namespace host: nvrar's Communicator
bootstrapped over MPI.COMM_WORLD (mpi4py imported by nvrar itself, after the UCX preload), one
exact int32 sum, compared bitwise with MPI_Allreduce of the same data; a JSON line on stdout."""

from __future__ import annotations

import json
import os
import socket
import sys

import numpy as np

import nvrar


def main() -> int:
    comm = nvrar.Communicator(timeout=30)
    from mpi4py import MPI  # already loaded by nvrar's bootstrap

    world = MPI.COMM_WORLD
    rank, size = comm.rank, comm.world_size
    x = ((np.arange(1 << 16, dtype=np.int64) * 7 + rank * 3) % 11 - 5).astype(np.int32)
    ref = x.copy()
    world.Allreduce(MPI.IN_PLACE, ref, op=MPI.SUM)
    comm.all_reduce(x)
    transports = sorted({comm._ex.link_transports(r) for r in range(size)} - {""})
    print(json.dumps({"rank": rank, "mpi_rank": world.rank, "host": socket.gethostname(), "size": size,
                      "nodes": comm.num_nodes, "ranks_per_node": comm.ranks_per_node, "bootstrap": comm.bootstrap,
                      "equal": bool(np.array_equal(x, ref)), "transports": transports, "pid": os.getpid()}),
          flush=True)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
