"""The barrier before every cold-timed call of the benchmarks (nvrar-bench's jobs, and
benchmarks/latency_check.py, which loads this file by its path so that any build of nvrar may be
the one it measures): the same code in every job, whatever MPI library the job runs under.

Why not the job's MPI_Barrier: the first rank out of a barrier waits out the barrier's exit skew
inside the timed call, so each job's barrier would be timed as part of the library it serves.
Same host (2-core AMD EPYC KVM guest, Linux 6.18), 2 ranks, median exit skew, 2026-12-04: Open
MPI 0.4-1.3 us, Intel MPI 0.6-0.9, MPICH 1.2-2.8; beside one spinning process Open MPI 2.2 us,
Intel MPI 0.45-0.7 (its mpiexec pins each rank to a core), MPICH 2.9-330.

Here each rank has a cache line of a file every rank of the job maps: a generation counter and
the CPU it last ran on. A rank bumps its counter and polls the others'. It yields its core while
the rank it waits for last ran on the same CPU (a spin there only keeps that rank off the core,
and under EEVDF a task that spun long is not handed the core back by the other's yield), and
after 20000 polls (about 2 ms) whatever the CPUs; at most ``timeout_s`` in all, then
RuntimeError naming the rank waited for. For ranks on one host, no more of them than the CPUs
they may run on: 4 ranks on 2 cores, it left a median skew of 36-52 us (yielding after 16
polls), so :func:`usable` says no there and the jobs keep their MPI_Barrier.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time

LINE = 64  # bytes per rank: [generation, CPU] as int64, on a cache line of its own


def usable(hosts: int, cpus_of_ranks: list) -> bool:
    """Whether the spin barrier serves a job on ``hosts`` hosts whose ranks may run on
    ``cpus_of_ranks`` (every rank's my_cpus(), gathered): one host, and no more ranks than the
    CPUs of the union of their masks (a launcher may pin each rank to one CPU, a container's
    cpuset may hold fewer than the host has). Every rank must pass the same values."""
    return hosts == 1 and len(cpus_of_ranks) <= len(set().union(*map(set, cpus_of_ranks)))


def my_cpus() -> list:
    """The CPUs this process may run on (gathered from every rank for usable())."""
    return sorted(os.sched_getaffinity(0))


class SpinBarrier:
    """One rank's end of the barrier kept in the file ``path`` (``create``: made where missing;
    every rank of the job may create and size it, before any rank's first :meth:`wait`, which
    the caller orders with a barrier of its own). The file may be unlinked once every rank has
    mapped it."""

    def __init__(self, path: str, rank: int, size: int, timeout_s: float = 120.0, create: bool = True) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"SpinBarrier: rank {rank} outside 0..{size - 1}")
        self.rank, self.size, self.gen, self.timeout_s = rank, size, 0, timeout_s
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        try:
            if os.fstat(fd).st_size < LINE * size:
                os.ftruncate(fd, LINE * size)  # zeros
            self._map = mmap.mmap(fd, LINE * size)
        finally:
            os.close(fd)
        self.cells = memoryview(self._map).cast("q")  # rank r: [8 r] generation, [8 r + 1] CPU
        self._cpu = ctypes.CDLL(None).sched_getcpu

    def wait(self) -> None:
        self.gen += 1
        g, cells, me = self.gen, self.cells, 8 * self.rank
        cpu = self._cpu()
        cells[me + 1] = cpu
        cells[me] = g
        polls, deadline = 0, time.monotonic() + self.timeout_s
        for r in range(self.size):
            while cells[8 * r] < g:
                polls += 1
                if polls & 63 == 0:
                    if polls > 20000 or cells[8 * r + 1] == cpu:
                        os.sched_yield()
                        cpu = self._cpu()
                        cells[me + 1] = cpu
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"spin barrier: rank {self.rank} waited {self.timeout_s:g} s for rank "
                                           f"{r} (barrier {g})")

    def close(self) -> None:
        self.cells.release()
        self._map.close()
