"""Hosts on one machine for the cross-host tests: network namespaces joined by a bridge.

Every host is a network namespace with one veth into a bridge that lives in a namespace of its
own (nothing touches the machine's own network), and its processes run under one agent per host
started with ``unshare --uts --ipc --pid --fork --mount --propagation private --mount-proc``: its
own host name, System V IPC, process ids, /proc and a tmpfs /dev/shm of its own. So two hosts share
no shared memory, no cross-memory attach (other pid namespace) and no loopback: UCX can reach
another host only over its network (tcp). Needs root (CI runs as root); ``why_not()`` says why
hosts cannot be made here, for the tests' skip reason.

Names carry this process's pid, so parallel test runs do not collide; every namespace is deleted
on exit, on failure too.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from typing import Dict, List, Optional, Sequence

SUBNET = "10.99.0"  # only inside the bridge namespace of one test: never routed anywhere


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def why_not() -> Optional[str]:
    """None when namespace hosts can be made here, else the reason."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root (CI runs as root)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"network-namespace hosts need `{tool}`"
    probe = f"nvrprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot make a network namespace: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    r = subprocess.run(["unshare", "--uts", "--ipc", "--pid", "--fork", "--mount", "--propagation", "private",
                        "--mount-proc", "true"], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"cannot unshare the UTS/IPC/PID/mount namespaces: {r.stderr.strip()}"
    return None


class Hosts:
    """``n`` hosts; ``addr(i)`` is host i's address, ``hostname(i)`` its name."""

    def __init__(self, n: int, workdir: str) -> None:
        self.n = n
        self.workdir = workdir
        tag = f"{os.getpid() % 100000}"
        self.tag = tag
        self.bridge_ns = f"nvrb{tag}"
        self.ns = [f"nvrh{tag}x{i}" for i in range(n)]
        self.agents: List[Optional[subprocess.Popen]] = [None] * n
        self._made: List[str] = []

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def hostname(self, i: int) -> str:
        return f"nvrhost{i}"

    def __enter__(self) -> "Hosts":
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        _ip("netns", "add", self.bridge_ns)
        self._made.append(self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, ns in enumerate(self.ns):
            _ip("netns", "add", ns)
            self._made.append(ns)
            # One veth pair per host, made inside the bridge namespace (no name in the machine's own).
            _ip("-n", self.bridge_ns, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.bridge_ns, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def start(self, i: int, ranks: Sequence[Dict[str, object]]) -> subprocess.Popen:
        """Starts host i's agent, which starts its ranks (each {"argv": [...], "env": {...}, "log": path})
        and, once they all exited, lists its /dev/shm into workdir/shm-<i>.txt."""
        lines = [f"hostname {self.hostname(i)}", "mount -t tmpfs -o size=1g,mode=1777 tmpfs /dev/shm"]
        for r in ranks:
            env = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in dict(r["env"]).items())  # type: ignore[arg-type]
            argv = " ".join(shlex.quote(str(a)) for a in r["argv"])  # type: ignore[attr-defined]
            lines.append(f"env {env} {argv} > {shlex.quote(str(r['log']))} 2>&1 &")
        lines.append("wait")
        lines.append(f"ls -A /dev/shm > {shlex.quote(os.path.join(self.workdir, f'shm-{i}.txt'))}")
        cmd = ["ip", "netns", "exec", self.ns[i], "unshare", "--uts", "--ipc", "--pid", "--fork", "--mount",
               "--propagation", "private", "--mount-proc", "sh", "-c", "\n".join(lines)]
        agent = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
        self.agents[i] = agent
        return agent

    def pid_one(self, i: int) -> Optional[int]:
        """The pid (in this namespace) of host i's agent shell, the init of its pid namespace."""
        agent = self.agents[i]
        if agent is None:
            return None
        try:
            with open(f"/proc/{agent.pid}/task/{agent.pid}/children") as f:
                kids = f.read().split()
        except OSError:
            return None
        return int(kids[0]) if kids else None

    def kill_host(self, i: int) -> None:
        """SIGKILL of every process of host i (its pid namespace's init: the kernel kills the rest)."""
        pid = self.pid_one(i)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)

    def link_down(self, i: int) -> None:
        _ip("-n", self.ns[i], "link", "set", "eth0", "down")

    def wait(self, timeout: float) -> List[Optional[int]]:
        """Exit codes of the agents (None: still running at the deadline)."""
        deadline = time.monotonic() + timeout
        codes: List[Optional[int]] = []
        for agent in self.agents:
            if agent is None:
                codes.append(None)
                continue
            try:
                codes.append(agent.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def close(self) -> None:
        for i, agent in enumerate(self.agents):
            if agent is not None and agent.poll() is None:
                self.kill_host(i)
                try:
                    os.killpg(agent.pid, signal.SIGKILL)
                except OSError:
                    pass
                try:
                    agent.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made = []

    def exists(self) -> List[str]:
        """The namespaces of this object that still exist (for the tests' clean-up check)."""
        listed = _ip("netns", "list", check=False).stdout
        return [ns for ns in [self.bridge_ns, *self.ns] if ns in listed.split()]
