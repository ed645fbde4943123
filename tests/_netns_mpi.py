"""Open MPI's mpirun across the namespace hosts of tests/_netns.py (benchmarks/hosts_bench.py, test_hosts_mpi.py).

mpirun runs in the bridge namespace, which gets the address LAUNCH_ADDR (a login node, on no
host), and PRRTE starts its daemons inside the hosts through an ssh agent written for the run
(``--prtemca plm_ssh_agent``): ``agent HOST COMMAND...`` maps HOST (address or name) to the pid
of that host's init and runs COMMAND under ``nsenter`` into its net/UTS/IPC/PID/mount namespaces.
Why each piece is needed:

* mpirun inside a host cannot be the launcher: the agent runs in mpirun's PID namespace and
  mount (its own /proc), where the other hosts' pids do not exist; hence the bridge namespace.
* ``plm_ssh_no_tree_spawn 1``: with tree spawn a daemon inside a host would run the agent for
  the next hosts, from a PID namespace where their pids are not visible either.
* every host gets a TMPDIR of its own: the hosts share /tmp (one file system), PRRTE names its
  session directory ``prted.<pid>`` and a daemon's pid is alike in every fresh PID namespace (the
  second daemon then fails with "The PMIx server's listener thread failed to start").
* ``oob_tcp_if_include`` / ``btl_tcp_if_include`` the subnet (the bridge's interface is br0, the
  hosts' eth0); pml ob1 with btls self,sm,tcp: shared memory inside a host (its ranks share IPC
  and PID namespaces), tcp between hosts (PRRTE knows them as different nodes).

Written for Open MPI 5 (PRRTE); ``find_mpirun()`` says why not where it is absent or another MPI.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, List, Tuple

import _netns

LAUNCH_ADDR = f"{_netns.SUBNET}.254"  # mpirun's, on the bridge
SUBNET_CIDR = f"{_netns.SUBNET}.0/24"


def find_mpirun() -> Tuple[str, str]:
    """(mpirun, "") or ("", why not): Open MPI 5's mpirun (PRRTE's ssh agent parameter) and mpi4py."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "", "mpi4py is not installed (pip install 'nvrar[bench]')"
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    mpirun = mpirun if os.path.exists(mpirun) else (shutil.which("mpirun") or "")
    if not mpirun:
        return "", "no mpirun next to this Python or on PATH (pip install 'nvrar[bench]')"
    try:
        version = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return "", f"{mpirun} --version failed: {exc}"
    first = version.strip().splitlines()[0] if version.strip() else ""
    if "Open MPI" not in first or not first.split()[-1].startswith("5."):
        return "", f"{mpirun} is {first or 'unknown'}; the launch across namespace hosts is written for Open MPI 5 (PRRTE)"
    return mpirun, ""


class MpiHosts:
    """Inside ``with _netns.Hosts(n, workdir) as hosts``: ``MpiHosts(hosts, workdir).command(...)``
    is an mpirun command line that starts ranks in those hosts. ``start()`` first (it keeps every
    host alive until ``stop()``)."""

    def __init__(self, hosts: "_netns.Hosts", workdir: str) -> None:
        self.hosts = hosts
        self.workdir = workdir
        self.stop_file = os.path.join(workdir, f"stop-{hosts.tag}-{hosts.n}")
        self.agent = os.path.join(workdir, f"ssh-agent-{hosts.n}.sh")

    def start(self, timeout: float = 30.0) -> None:
        h = self.hosts
        if os.path.exists(self.stop_file):  # an earlier launch's, in the same workdir: it would end the agents at once
            os.remove(self.stop_file)
        _netns._ip("-n", h.bridge_ns, "addr", "add", f"{LAUNCH_ADDR}/24", "dev", "br0")
        for i in range(h.n):
            h.start(i, [self._idle(os.path.join(self.workdir, f"idle-{h.n}-{i}.log"))])
        deadline = time.monotonic() + timeout
        while any(h.pid_one(i) is None for i in range(h.n)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"namespace hosts: the agents did not start within {timeout:.0f} s")
            time.sleep(0.05)
        self._write_agent()

    def stop(self, timeout: float = 30.0) -> List[Any]:
        open(self.stop_file, "w").close()
        return self.hosts.wait(timeout)

    def _idle(self, log: str) -> Dict[str, Any]:
        """What keeps a host alive while mpirun's daemons run in it: a loop that ends with the stop file."""
        return {"argv": ["sh", "-c", f"while [ ! -e {shlex.quote(self.stop_file)} ]; do sleep 0.5; done"],
                "env": {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, "log": log}

    def _write_agent(self) -> None:
        h = self.hosts
        cases = []
        for i in range(h.n):
            tmp = os.path.join(self.workdir, f"tmp-{h.n}-host{i}")
            os.makedirs(tmp, exist_ok=True)
            cases.append(f"  {h.addr(i)}|{h.hostname(i)}) pid={h.pid_one(i)}; tmp={shlex.quote(tmp)} ;;")
        body = "\n".join([
            "#!/bin/sh",
            "# PRRTE's plm_ssh_agent for namespace hosts (tests/_netns_mpi.py): agent HOST COMMAND...",
            "host=$1; shift",
            'case "$host" in',
            *cases,
            '  *) echo "namespace-host agent: unknown host $host" >&2; exit 255 ;;',
            "esac",
            'exec nsenter -t "$pid" -n -u -i -p -m -- env TMPDIR="$tmp" sh -c "$*"',
            "",
        ])
        with open(self.agent, "w") as f:
            f.write(body)
        os.chmod(self.agent, 0o755)

    def command(self, mpirun: str, ranks_per_host: int, argv: List[str], mca: Tuple[Tuple[str, str], ...] = (),
                env: Tuple[str, ...] = ()) -> List[str]:
        h = self.hosts
        host_list = ",".join(f"{h.addr(i)}:{ranks_per_host}" for i in range(h.n))
        cmd = ["ip", "netns", "exec", h.bridge_ns, mpirun, "-n", str(h.n * ranks_per_host), "--host", host_list,
               "--bind-to", "none",
               "--prtemca", "plm_ssh_agent", self.agent, "--prtemca", "plm_ssh_no_tree_spawn", "1",
               "--prtemca", "oob_tcp_if_include", SUBNET_CIDR,
               "--mca", "pml", "ob1", "--mca", "btl", "self,sm,tcp", "--mca", "btl_tcp_if_include", SUBNET_CIDR,
               "--mca", "osc", "^ucx"]
        for key, value in mca:
            cmd += ["--mca", key, value]
        for e in ("MASTER_ADDR=" + h.addr(0), *env):
            cmd += ["-x", e]
        return cmd + list(argv)


def mpirun_env() -> Dict[str, str]:
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
