"""Shared pytest configuration. Multi-rank tests start real processes (tests/_launch.py) or run
under mpirun (tests/mpi); GPU tests live in tests/gpu and skip without a GPU."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
