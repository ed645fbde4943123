"""tests/mpi runs under an MPI launcher, one pytest per rank:

    mpirun -n 8 --oversubscribe python -m pytest tests/mpi

Outside mpirun every test here skips (tests/test_mpi_launch.py runs this directory under
mpirun as part of the normal suite)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nvrar.bootstrap import mpi_launched  # noqa: E402


HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    # This hook sees every collected item, not only this directory's: mark ours alone.
    if not mpi_launched():
        skip = pytest.mark.skip(reason="needs an MPI launcher: mpirun -n 8 python -m pytest tests/mpi")
        for item in items:
            if str(item.path).startswith(HERE + os.sep):
                item.add_marker(skip)
