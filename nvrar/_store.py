"""A minimal key-value store over TCP for the rendezvous of ranks that have neither
torch.distributed nor MPI (torchrun-style environment variables, ``nvrar-bench`` spawning local
ranks).

Rank 0 serves it on MASTER_ADDR:MASTER_PORT for the duration of one rendezvous; every rank (rank 0
included) is a client. Keys and values are bytes; nothing is unpickled, so a stray connection can
at worst disturb the rendezvous, never run code. Every operation has a deadline.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Dict, Optional

from .errors import NvrarError, NvrarTimeoutError

__all__ = ["StoreServer", "StoreClient"]

_OP_HELLO, _OP_SET, _OP_GET, _OP_ADD, _OP_DONE = b"H", b"S", b"G", b"A", b"D"
_OK, _MISSING = b"\x00", b"\x01"
_MAX_FIELD = 1 << 24  # largest key or value accepted (bytes)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise ConnectionError("store connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _send_field(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_field(sock: socket.socket) -> bytes:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    if n > _MAX_FIELD:
        raise ConnectionError(f"store field of {n} bytes is too large")
    return _recv_exact(sock, n)


class StoreServer:
    """Serves the store until ``expected_clients`` have said done, or the deadline passes."""

    def __init__(self, host: str, port: int, expected_clients: int, timeout: float, session: bytes = b"") -> None:
        self._session = session
        self._data: Dict[bytes, bytes] = {}
        self._cond = threading.Condition()
        self._done = 0
        self._expected = expected_clients
        self._deadline = time.monotonic() + timeout
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise NvrarError(
                f"bootstrap: rank 0 cannot listen on {host}:{port} ({exc}); is MASTER_PORT already in use "
                "(for example by torchrun's agent store, or a process group)?"
            ) from None
        self._sock.listen(256)
        self._sock.settimeout(0.2)
        self._threads = []
        self._acceptor = threading.Thread(target=self._accept_loop, name="nvrar-store", daemon=True)
        self._acceptor.start()

    def _finished(self) -> bool:
        return self._done >= self._expected or time.monotonic() > self._deadline

    def _accept_loop(self) -> None:
        while True:
            with self._cond:
                if self._finished():
                    break
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)
        self._sock.close()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(max(0.1, self._deadline - time.monotonic()))
        try:
            while True:
                op = _recv_exact(conn, 1)
                key = _recv_field(conn)
                if op == _OP_HELLO:
                    # A client of another rendezvous (the previous one still closing on this port,
                    # or the next one arriving early) is told so, and retries.
                    conn.sendall(_OK if key == self._session else _MISSING)
                    if key != self._session:
                        return
                elif op == _OP_SET:
                    value = _recv_field(conn)
                    with self._cond:
                        self._data[key] = value
                        self._cond.notify_all()
                    conn.sendall(_OK)
                elif op == _OP_GET:
                    (wait_s,) = struct.unpack("!d", _recv_exact(conn, 8))
                    deadline = min(time.monotonic() + wait_s, self._deadline)
                    with self._cond:
                        while key not in self._data and time.monotonic() < deadline:
                            self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
                        value = self._data.get(key)
                    if value is None:
                        conn.sendall(_MISSING)
                    else:
                        conn.sendall(_OK)
                        _send_field(conn, value)
                elif op == _OP_ADD:
                    (delta,) = struct.unpack("!q", _recv_exact(conn, 8))
                    with self._cond:
                        new = int(self._data.get(key, b"0")) + delta
                        self._data[key] = str(new).encode()
                        self._cond.notify_all()
                    conn.sendall(struct.pack("!q", new))
                elif op == _OP_DONE:
                    with self._cond:
                        self._done += 1
                        self._cond.notify_all()
                    conn.sendall(_OK)
                    return
                else:
                    return  # not our protocol: drop the connection
        except (OSError, ConnectionError, struct.error):
            return
        finally:
            conn.close()

    def wait_closed(self, timeout: float) -> None:
        """Wait (bounded) until every client said done, then stop listening."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._done < self._expected and time.monotonic() < min(end, self._deadline):
                self._cond.wait(0.05)
            self._expected = 0  # stop the acceptor even on timeout
        self._acceptor.join(timeout=1.0)


class StoreClient:
    """One rank's connection to the store; ``timeout`` bounds every operation."""

    def __init__(self, host: str, port: int, timeout: float, rank: int, session: bytes = b"") -> None:
        self._rank = rank
        self._timeout = timeout
        self._where = f"{host}:{port}"
        deadline = time.monotonic() + timeout
        delay = 0.01
        last: Optional[Exception] = None
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
                try:
                    sock.sendall(_OP_HELLO)
                    _send_field(sock, session)
                    if _recv_exact(sock, 1) != _OK:
                        raise ConnectionError("the store serves another rendezvous")
                except (OSError, ConnectionError):
                    sock.close()
                    raise
                self._sock = sock
                break
            except (OSError, ConnectionError) as exc:  # the server may not be up yet
                last = exc
                if time.monotonic() + delay > deadline:
                    raise NvrarTimeoutError(
                        f"bootstrap: rank {rank} could not reach the rendezvous store at {self._where} within "
                        f"{timeout:.0f} s ({last}); is rank 0 running, and are MASTER_ADDR/MASTER_PORT right?",
                        rank=rank, peer=0, phase="bootstrap", kind="timeout",
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(timeout + 5.0)

    def _lost(self, exc: Exception) -> NvrarError:
        return NvrarTimeoutError(
            f"bootstrap: rank {self._rank} lost the rendezvous store at {self._where} ({exc}); rank 0 probably exited",
            rank=self._rank, peer=0, phase="bootstrap", kind="timeout",
        )

    def set(self, key: bytes, value: bytes) -> None:
        try:
            self._sock.sendall(_OP_SET)
            _send_field(self._sock, key)
            _send_field(self._sock, value)
            _recv_exact(self._sock, 1)
        except (OSError, ConnectionError) as exc:
            raise self._lost(exc) from None

    def get(self, key: bytes, timeout: Optional[float] = None) -> Optional[bytes]:
        """The value of ``key``, waiting for it up to ``timeout``; None if it never came."""
        try:
            self._sock.sendall(_OP_GET)
            _send_field(self._sock, key)
            self._sock.sendall(struct.pack("!d", self._timeout if timeout is None else timeout))
            status = _recv_exact(self._sock, 1)
            if status == _MISSING:
                return None
            return _recv_field(self._sock)
        except (OSError, ConnectionError) as exc:
            raise self._lost(exc) from None

    def add(self, key: bytes, delta: int) -> int:
        try:
            self._sock.sendall(_OP_ADD)
            _send_field(self._sock, key)
            self._sock.sendall(struct.pack("!q", delta))
            (value,) = struct.unpack("!q", _recv_exact(self._sock, 8))
            return value
        except (OSError, ConnectionError) as exc:
            raise self._lost(exc) from None

    def close(self) -> None:
        try:
            self._sock.sendall(_OP_DONE)
            _send_field(self._sock, b"")
            _recv_exact(self._sock, 1)
        except (OSError, ConnectionError):
            pass
        finally:
            self._sock.close()
