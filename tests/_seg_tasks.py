"""Worker tasks of tests/test_shm.py and tests/test_security.py (run by tests/_worker.py): the
shared-memory segments under a short /dev/shm, forged or foreign segments, a forked child."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import Any, List, Optional

import numpy as np

import nvrar
from nvrar import bootstrap as _bootstrap

from _worker import error_fields


def task_seg_smallshm(args: dict) -> dict:
    """Construct (default sizes), then fill an empty() buffer and reduce a large array: the
    script that died of SIGBUS when /dev/shm was smaller than the ranks' segments together."""
    out: dict = {"constructed": False}
    try:
        comm = nvrar.Communicator(timeout=30)
    except Exception as exc:
        out["error"] = error_fields(exc)
        return out
    out["constructed"] = True
    buf = comm.empty(args["empty_bytes"] // 4, np.float32)
    buf[:] = 1.0
    x = np.full(args["array_bytes"] // 4, 1.0, np.float32)
    comm.all_reduce(x)
    out["ok"] = bool(np.all(x == comm.world_size))
    del buf
    comm.close()
    return out


class _Tampering(_bootstrap.Bootstrap):
    """The rendezvous as a hostile local user could bend it (the attack of issue 13, item 2,
    without the race): on rank `at`, the segment name exchanged for rank `victim` is replaced by
    `forge(real name, session secret)`'s. Everything else passes through the real bootstrap."""

    def __init__(self, inner: _bootstrap.Bootstrap, at: int, victim: int, forge: Any) -> None:
        super().__init__(inner.rank, inner.world_size, inner.timeout)
        self.kind = inner.kind
        self._inner, self._at, self._victim, self._forge = inner, at, victim, forge
        self.secret: Optional[bytes] = None
        self.forged: Optional[str] = None

    def allgather(self, value: bytes) -> List[bytes]:
        got = self._inner.allgather(value)
        if self.rank != self._at:
            return got
        if all(b.startswith(b"/nvrar-") for b in got):  # names exchanged bare (as before the secret)
            self.forged = self._forge(got[self._victim].decode(), self.secret)
            return [self.forged.encode() if r == self._victim else b for r, b in enumerate(got)]
        try:
            entries = [json.loads(b) for b in got]
        except ValueError:
            return got
        if not all(isinstance(e, dict) for e in entries):
            return got
        if entries[0].get("secret"):
            self.secret = bytes.fromhex(entries[0]["secret"])
        if all("segment" in e for e in entries) and entries[self._victim]["segment"]:
            self.forged = self._forge(entries[self._victim]["segment"], self.secret)
            entries[self._victim]["segment"] = self.forged
            got = [json.dumps(e).encode() for e in entries]
        return got


_PAGE = 4096


def _forged_name(real: str) -> str:
    head, _ = real.rsplit("-", 1)
    return f"{head}-{os.urandom(16).hex()}"


def _forge_other_user(real: str, secret: Optional[bytes]) -> str:
    """Another user's copy of the victim's segment: its valid header (secret included: the
    strongest attacker), mode 0666, values 666 everywhere else."""
    name = _forged_name(real)
    size = os.stat("/dev/shm" + real).st_size
    with open("/dev/shm" + real, "rb") as f:
        header = f.read(_PAGE)
    # A real process of another user: forked, then setgid/setuid to nobody (65534) for good.
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.umask(0)
            fd = os.open("/dev/shm" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
            os.fchmod(fd, 0o666)
            os.ftruncate(fd, size)
            fill = np.full(1 << 18, 666.0, np.float32).tobytes()
            off = _PAGE
            while off < size:
                off += os.pwrite(fd, fill[: size - off], off)
            os.pwrite(fd, header, 0)
            os.close(fd)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"the unprivileged forger failed (status {status})")
    st = os.stat("/dev/shm" + name)
    assert st.st_uid == 65534 and st.st_mode & 0o777 == 0o666, st
    return name


def _forge_stale(real: str, secret: Optional[bytes]) -> str:
    """A segment of this user with a valid header but another session's secret (as a segment
    left by another session would be)."""
    assert secret is not None, "the session secret was not seen in the exchange"
    name = _forged_name(real)
    with open("/dev/shm" + real, "rb") as f:
        data = bytearray(f.read())
    at = data.find(secret, 0, _PAGE)
    assert at >= 0, "the session secret is not in the victim's header"
    data[at:at + len(secret)] = os.urandom(len(secret))
    fd = os.open("/dev/shm" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, bytes(data))
    finally:
        os.close(fd)
    return name


def task_seg_forged(args: dict) -> dict:
    inner = _bootstrap.create(None, 30.0)
    forge = {"other_user": _forge_other_user, "stale": _forge_stale}[args["forge"]]
    boot = _Tampering(inner, at=args["at"], victim=args["victim"], forge=forge)
    out: dict = {"constructed": False}
    try:
        comm = nvrar.Communicator(boot, timeout=20)
        out["constructed"] = True
        x = np.full(1024, 1.0, np.float32)
        comm.all_reduce(x)
        out["result"] = [float(v) for v in np.unique(x)]
        comm.close()
    except Exception as exc:
        out["error"] = error_fields(exc)
    finally:
        out["forged"] = boot.forged
        inner.close()
    return out


def _child(comm: Any, kept: np.ndarray, do_close: bool, w: int) -> None:
    """In a forked child: every entry point raises naming the fork, close() drops locally."""
    res: dict = {}
    for name, fn in (("all_reduce", lambda: comm.all_reduce(np.ones(1000, np.float32))),
                     ("all_reduce_kept", lambda: comm.all_reduce(kept)),
                     ("empty", lambda: comm.empty(16, np.float32)),
                     ("check", lambda: comm.check()),
                     ("algorithm_for", lambda: comm.algorithm_for(1024))):
        try:
            fn()
            res[name] = None
        except Exception as exc:
            res[name] = error_fields(exc)
    # The C++ guard on its own (the second line behind the Python check).
    try:
        comm._all_reduce(kept.ctypes.data, kept.ctypes.data, kept.size, 0, 0, 0)
        res["native"] = None
    except Exception as exc:
        res["native"] = error_fields(exc)
    if do_close:
        try:
            comm.close()
            res["close"] = "ok"
        except Exception as exc:
            res["close"] = error_fields(exc)
    os.write(w, json.dumps(res).encode())
    os.close(w)


def task_seg_fork(args: dict) -> dict:
    comm = nvrar.Communicator(timeout=15)
    rank = comm.rank
    kept = comm.empty(4096, np.float32)  # an empty() buffer the children inherit
    kept[:] = 3.0
    private = np.full(4096, 7.0, np.float32)  # never passed to a call by the parent
    out: dict = {"children": []}
    if rank == 0:
        for do_close in (True, False):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                try:
                    _child(comm, kept, do_close, w)
                except BaseException:
                    os._exit(5)
                # A normal exit: the garbage collector and atexit (nvrar closes its live
                # communicators) run in the child.
                del comm, kept
                gc.collect()
                sys.exit(0)
            os.close(w)
            deadline = time.monotonic() + 30
            status = None
            while time.monotonic() < deadline:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                time.sleep(0.01)
            else:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                status = "killed after 30 s"
            data = b""
            while chunk := os.read(r, 65536):
                data += chunk
            os.close(r)
            out["children"].append({"status": status if isinstance(status, str) else os.waitstatus_to_exitcode(status),
                                    "report": json.loads(data) if data else None})
    # The parent (and its peer) go on as if nothing happened.
    x = np.full(4096, float(rank + 1), np.float32)
    comm.all_reduce(x)
    out["sum_ok"] = bool(np.all(x == sum(r + 1 for r in range(comm.world_size))))
    comm.all_reduce(kept)
    out["kept_ok"] = bool(np.all(kept == 3.0 * comm.world_size))
    out["private_ok"] = bool(np.all(private == 7.0))
    out["epoch"] = comm._ex.epoch
    comm.close()
    return out


TASKS = {"seg_smallshm": task_seg_smallshm, "seg_forged": task_seg_forged, "seg_fork": task_seg_fork}
