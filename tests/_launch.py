"""Start real worker processes (one per rank) with torchrun-style environment variables, and
collect what each one reports. Used by the multi-process tests; no mocks: every rank is a real
process bootstrapping through nvrar's own rendezvous store."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_worker.py")
# Between the SIGTERM that ends a rank past its deadline (its Python stacks printed) and the SIGKILL.
KILL_GRACE_S = 5.0


def private_shm_prefix() -> Tuple[Optional[List[str]], str]:
    """(a command prefix that runs its command in a private mount namespace where it may mount a
    tmpfs on /dev/shm, "") or (None, why none can be made here)."""
    if shutil.which("unshare") is None:
        return None, "unshare (util-linux) is not installed: cannot build a private /dev/shm"
    why = []
    for prefix in (["unshare", "-m", "--propagation", "private"], ["unshare", "-r", "-m", "--propagation", "private"]):
        probe = subprocess.run(prefix + ["sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True,
                               text=True, timeout=30)
        if probe.returncode == 0:
            return prefix, ""
        why.append(f"{' '.join(prefix)}: {probe.stderr.strip()[-200:]}")
    return None, "cannot mount a private tmpfs on /dev/shm (" + "; ".join(why) + ")"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str
    report: Optional[dict]


def launch(world: int, task: str, args: Optional[dict] = None, env: Optional[Dict[str, str]] = None,
           timeout: float = 240.0, per_rank_args: Optional[List[dict]] = None,
           start: Optional[List[int]] = None, per_rank_env: Optional[List[Dict[str, str]]] = None,
           executable: str = sys.executable) -> List[RankResult]:
    """Run `_worker.py task` on `world` ranks; returns one RankResult per rank (in rank order).
    `executable` is the Python the ranks run under (default this one; the engine tests name
    .venv-engines/bin/python, scripts/engines_env.sh).

    Each worker writes its JSON report to a file; workers still running at `timeout` get SIGTERM
    (each prints every thread's Python stack to its stderr), then SIGKILL after KILL_GRACE_S (the
    test then fails on their return codes: a hang is a failure, never a silent pass). `start`
    names the ranks to start (default all): the others never arrive."""
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="nvrar-test-")
    ranks: List[_Rank] = []
    try:
        for r in (range(world) if start is None else start):
            a = dict(args or {})
            if per_rank_args is not None:
                a.update(per_rank_args[r])
            e = dict(os.environ)
            for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_STEP_ID", "LOCAL_WORLD_SIZE",
                      "TORCHELASTIC_USE_AGENT_STORE"):
                e.pop(k, None)
            e.update({"RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                      "PYTHONUNBUFFERED": "1",
                      # hermetic: a tuning table in the user's cache must not change what the tests see
                      "NVRAR_TUNING_FILE": os.path.join(tmp, "no-tuning-table.json")})
            e.update(env or {})
            if per_rank_env is not None:
                e.update(per_rank_env[r])
            report = os.path.join(tmp, f"rank{r}.json")
            cmd = [executable, WORKER, task, json.dumps(a), report]
            # Output into files, never pipes: a pipe that nobody drains while the launcher waits for
            # another rank fills (64 KiB) and blocks the rank's next write, a hang of the test
            # harness that looks like one of the protocol (a rank stuck in a print while its peer's
            # kernel waits for it).
            out_f = open(os.path.join(tmp, f"rank{r}.out"), "w+", errors="replace")
            err_f = open(os.path.join(tmp, f"rank{r}.err"), "w+", errors="replace")
            ranks.append(_Rank(r, report, subprocess.Popen(cmd, env=e, stdin=subprocess.DEVNULL, stdout=out_f,
                                                           stderr=err_f), out_f, err_f))
        deadline = time.monotonic() + timeout
        late = False
        try:
            for rk in ranks:
                try:
                    rk.p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    late = True
                    break
        except BaseException as exc:  # pytest-timeout, a SIGTERM of the whole step (tests/gpu/conftest.py)
            _interrupted(ranks, exc)
            raise
        notes: Dict[int, str] = {}
        if late:
            # Past the deadline: SIGTERM to every rank still running at once (_worker.py has
            # faulthandler print every thread's Python stack on it), SIGKILL after the grace period.
            for r, how in _stop(ranks).items():
                notes[r] = f"\n[launch] rank {r} still running at the {timeout:.0f} s test deadline: stopped ({how})"
        results = []
        for rk in ranks:
            data = None
            if os.path.exists(rk.report):
                with open(rk.report) as f:
                    data = json.load(f)
            results.append(RankResult(rk.rank, rk.p.returncode, rk.output(0), rk.output(1) + notes.get(rk.rank, ""), data))
        return results
    finally:  # the reports are read above: no rank outlives the call, nothing of it stays in /tmp
        for rk in ranks:
            if rk.p.poll() is None:
                rk.p.kill()
                rk.p.wait()
            rk.out_f.close()
            rk.err_f.close()
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class _Rank:
    rank: int
    report: str
    p: subprocess.Popen
    out_f: Any
    err_f: Any

    def output(self, which: int) -> str:
        """What the rank wrote to stdout (0) or stderr (1) so far."""
        f = self.err_f if which else self.out_f
        f.flush()
        f.seek(0)
        return f.read()


def _stop(ranks: List["_Rank"]) -> Dict[int, str]:
    """SIGTERM to every rank of `ranks` still running, at once; SIGKILL to those still running
    KILL_GRACE_S later. How each was stopped, by rank."""
    running = [rk for rk in ranks if rk.p.poll() is None]
    for rk in running:
        rk.p.terminate()
    grace_end = time.monotonic() + KILL_GRACE_S
    how: Dict[int, str] = {}
    for rk in running:
        how[rk.rank] = "SIGTERM"
        try:
            rk.p.wait(timeout=max(0.1, grace_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            rk.p.kill()
            rk.p.wait()
            how[rk.rank] = f"SIGTERM, then SIGKILL {KILL_GRACE_S:.0f} s later"
    return how


def _interrupted(ranks: List[_Rank], exc: BaseException) -> None:
    """The launcher itself interrupted while ranks run (pytest-timeout, or the step's deadline):
    SIGTERM to every rank still running (each prints its Python stacks), at most KILL_GRACE_S for
    them to end, and every rank's output written straight to file descriptor 2 (the log of
    scripts/gpu_check.sh, which runs pytest with --capture=sys: it survives the test's end)."""
    _stop(ranks)
    results = [RankResult(rk.rank, rk.p.returncode, rk.output(0), rk.output(1), None) for rk in ranks]
    text = (f"\n[launch] interrupted ({type(exc).__name__}: {str(exc)[:200]}) while {len(ranks)} ranks ran: "
            f"stopped (SIGTERM); their output:\n{describe(results)}\n")
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass


def progress_lines(stderr: str, keep: int = 40) -> List[str]:
    """The progress lines of a GPU task (tests/_gpu_tasks.py: "[rank R +T s] ..."), the last `keep`."""
    return [line for line in stderr.splitlines() if line.startswith("[rank ")][-keep:]


def describe(results: List[RankResult]) -> str:
    """Every rank's return code, progress lines (so that a long NVSHMEM_DEBUG output does not hide
    where a rank was), and the tails of its stdout and stderr (its Python stacks, if stopped)."""
    parts = []
    for res in results:
        prog = progress_lines(res.stderr)
        parts.append(f"--- rank {res.rank} rc={res.returncode}\n"
                     + ("progress:\n" + "\n".join(prog) + "\n" if prog else "")
                     + f"stdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}")
    return "\n".join(parts)


def assert_all_ok(results: List[RankResult]) -> List[dict]:
    """Every rank exited 0 and reported; returns the reports."""
    bad = [r for r in results if r.returncode != 0 or r.report is None]
    assert not bad, "ranks failed:\n" + describe(results)
    return [r.report for r in results]
