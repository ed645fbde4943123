"""A minimal key-value store over TCP for the rendezvous of ranks that have neither
torch.distributed nor MPI (torchrun-style environment variables, ``nvrar-bench`` spawning local
ranks).

Rank 0 serves it on MASTER_ADDR:MASTER_PORT for the duration of one rendezvous; every rank (rank 0
included) is a client. Keys and values are bytes; nothing is unpickled. Every operation has a
deadline, every message a size bound.

NOTE [store trust]
The store decides what the ranks see (segment names, settings, NVSHMEM ids), so only the ranks of
this rendezvous may talk to it. A connection is served only after one of:

* uid check (default): the connecting socket is found in this host's /proc/net/tcp{,6}, established,
  and owned by this process's user. The client checks the server's socket the same way before it
  believes any reply. Another user's process is refused at accept, before a byte is read; a process
  on another host (or in another network namespace) is refused with a message naming
  NVRAR_SESSION_SECRET. The user's own processes are trusted: they could read the ranks' memory
  anyway.
* session secret (NVRAR_SESSION_SECRET, equal on every rank, set by the launcher): a mutual
  HMAC-SHA256 challenge-response on per-connection nonces; required of every client when set,
  and the only way across hosts. Traffic is authenticated at connection time, not encrypted:
  the network between hosts is trusted not to rewrite TCP streams (as for torch's TCPStore).

Keys are written once (a second write of a key is refused), and keys, values, the number of keys
and the bytes held are bounded; a violation is answered with an error the rank raises as
NvrarError, never a bare exception.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import os
import socket
import struct
import threading
import time
from typing import Dict, List, Optional, Set, Tuple

from .errors import NvrarError, NvrarTimeoutError

__all__ = ["StoreServer", "StoreClient", "socket_owner", "secret_key",
           "MAX_KEY_BYTES", "MAX_VALUE_BYTES", "MAX_KEYS", "MAX_STORE_BYTES"]

_OP_HELLO, _OP_PROOF, _OP_SET, _OP_GET, _OP_DONE = b"H", b"P", b"S", b"G", b"D"
_OP_NAMES = {_OP_HELLO: "hello", _OP_PROOF: "proof", _OP_SET: "set", _OP_GET: "get", _OP_DONE: "done"}
_OK, _MISSING, _ERROR, _OTHER = b"\x00", b"\x01", b"\x02", b"\x03"
_REQ = struct.Struct("!cII")  # op, key length, value length; then key, value
_REP = struct.Struct("!cI")   # status, payload length; then payload

MAX_KEY_BYTES = 1024            # rendezvous keys are ~40 bytes
MAX_VALUE_BYTES = 1 << 20       # rendezvous values are JSON settings, segment names, ids: < 4 KiB
MAX_KEYS = 1 << 16              # a rendezvous writes world_size keys per round, a handful of rounds
MAX_STORE_BYTES = 64 << 20      # all keys and values together
_HANDSHAKE_S = 5.0              # a connection must authenticate within this time
_MAX_PENDING = 32               # connections being authenticated or refused at once; more are dropped
_NONCE = 16
_HELLO = struct.Struct("!i16s")  # rank, client nonce
_MODE_UID, _MODE_SECRET = b"U", b"S"


def secret_key(secret: str) -> bytes:
    """The HMAC key of a session secret (NVRAR_SESSION_SECRET)."""
    return hashlib.sha256(b"nvrar-session-secret\0" + secret.encode()).digest()


def _mac(key: bytes, who: bytes, session: bytes, rank: int, nonce_c: bytes, nonce_s: bytes) -> bytes:
    msg = b"nvrar-store/" + who + b"\0" + struct.pack("!I", len(session)) + session + struct.pack("!i", rank)
    return hmac.new(key, msg + nonce_c + nonce_s, hashlib.sha256).digest()


# -- who owns a socket ---------------------------------------------------------------------------
def _norm(addr: Tuple) -> Tuple[object, int]:
    ip = ipaddress.ip_address(str(addr[0]).split("%")[0])
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, int(addr[1])


def _parse_proc_addr(text: str) -> Tuple[object, int]:
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip: object = ipaddress.IPv4Address(raw[::-1])
    else:  # four host-order 32-bit words
        ip = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
    return ip, int(port, 16)


_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLMSG_ERROR, _TCP_ESTABLISHED = 4, 20, 2, 1
_NOCOOKIE = 0xFFFFFFFF


def _diag_owner(local: Tuple[object, int], remote: Tuple[object, int]) -> Tuple[bool, Optional[int]]:
    """(answered, uid) of one socket looked up by its 4-tuple through NETLINK_SOCK_DIAG (what `ss`
    uses; unprivileged, microseconds). answered=False when netlink is unavailable."""
    ip_l, ip_r = local[0], remote[0]
    family = socket.AF_INET if ip_l.version == 4 else socket.AF_INET6  # type: ignore[attr-defined]
    sockid = struct.pack("!HH16s16s", local[1], remote[1], ip_l.packed.ljust(16, b"\0"),  # type: ignore[attr-defined]
                         ip_r.packed.ljust(16, b"\0"))  # type: ignore[attr-defined]
    req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_ESTABLISHED) + sockid + struct.pack(
        "=III", 0, _NOCOOKIE, _NOCOOKIE)
    msg = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, 1, 1, 0) + req  # NLM_F_REQUEST
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(1.0)
            nl.send(msg)
            data = nl.recv(65536)
    except (OSError, AttributeError):
        return False, None
    if len(data) < 16:
        return False, None
    _, kind, _, _, _ = struct.unpack_from("=IHHII", data)
    if kind == _NLMSG_ERROR:
        (err,) = struct.unpack_from("=i", data, 16)
        return err in (-errno.ENOENT, 0), None  # ENOENT: no such socket on this host
    if kind != _SOCK_DIAG_BY_FAMILY or len(data) < 16 + 72:
        return False, None
    state = data[17]
    uid = struct.unpack_from("=I", data, 16 + 4 + 48 + 12)[0]
    return True, (uid if state == _TCP_ESTABLISHED else None)


def socket_owner(local: Tuple, remote: Tuple) -> Optional[int]:
    """The uid owning this host's established TCP socket whose own address is ``local`` and whose
    peer is ``remote``; None when there is none (a socket of another host or network namespace, or
    one already closing: a closing socket no longer names its owner). Asked through netlink
    (sock_diag), else read from /proc/net/tcp{,6} (milliseconds on a busy host)."""
    want_local, want_remote = _norm(local), _norm(remote)
    answered, uid = _diag_owner(want_local, want_remote)
    if answered:
        return uid
    tag = f":{want_local[1]:04X} "
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            continue
        for line in text.splitlines()[1:]:
            if tag not in line:
                continue
            fields = line.split()
            if len(fields) < 8 or fields[3] != "01":  # 01: ESTABLISHED
                continue
            try:
                if _parse_proc_addr(fields[1]) == want_local and _parse_proc_addr(fields[2]) == want_remote:
                    return int(fields[7])
            except ValueError:
                continue
    return None


# -- framing -------------------------------------------------------------------------------------
class _Malformed(Exception):
    """A message that breaks the protocol or its bounds (the text says which)."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("store connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _recv_request(sock: socket.socket, max_key: int, max_value: int) -> Tuple[bytes, bytes, bytes]:
    op, nkey, nvalue = _REQ.unpack(_recv_exact(sock, _REQ.size))
    if op not in _OP_NAMES:
        raise _Malformed(f"unknown operation byte {op!r} (not an nvrar store client?)")
    if nkey > max_key:
        raise _Malformed(f"{_OP_NAMES[op]}: key of {nkey} bytes exceeds the limit of {max_key}")
    if nvalue > max_value:
        raise _Malformed(f"{_OP_NAMES[op]}: value of {nvalue} bytes exceeds the limit of {max_value}")
    body = _recv_exact(sock, nkey + nvalue)
    return op, body[:nkey], body[nkey:]


def _peer_text(sock: socket.socket) -> str:
    try:
        return str(sock.getpeername()[0])
    except OSError:
        return "an address that is gone"


def _reply(sock: socket.socket, status: bytes, payload: bytes = b"") -> None:
    sock.sendall(_REP.pack(status, len(payload)) + payload)  # one send: no Nagle stall


class StoreServer:
    """Serves the store until ``expected_clients`` ranks have said done, or the deadline passes."""

    def __init__(self, host: str, port: int, expected_clients: int, timeout: float, session: bytes = b"",
                 secret: Optional[bytes] = None) -> None:
        self._session = session
        self._key = secret
        self._uid = os.geteuid()
        self._data: Dict[bytes, bytes] = {}
        self._bytes = 0
        self._cond = threading.Condition()
        self._done: Set[int] = set()
        self._connected: Set[int] = set()
        # Ranks whose connection closed without "done": dead (or failed and gone); there is nothing
        # left to serve them, so wait_closed does not wait for them.
        self._gone: Set[int] = set()
        self._pending = 0
        self.refused: List[str] = []  # why connections were refused (the first few), for rank 0's errors
        self._expected = expected_clients
        self._deadline = time.monotonic() + timeout
        infos = resolve(host, port, "rank 0 (serving the rendezvous store)", passive=True)
        family, _, _, _, sockaddr = infos[0]
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind(sockaddr)
        except OSError as exc:
            self._sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise NvrarError(
                    f"bootstrap: rank 0 cannot listen on MASTER_ADDR:MASTER_PORT = {host}:{port}: the port is in use "
                    "(by torchrun's agent store, a process group, or another job?); pick another MASTER_PORT"
                ) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise NvrarError(
                    f"bootstrap: rank 0 cannot listen on MASTER_ADDR={host} ({sockaddr[0]}): not an address of this "
                    "host; rank 0 serves the rendezvous store, so it must run on the host MASTER_ADDR names"
                ) from None
            raise NvrarError(f"bootstrap: rank 0 cannot listen on {host}:{port} ({exc})") from None
        self._sock.listen(256)
        self._sock.settimeout(0.2)
        self._acceptor = threading.Thread(target=self._accept_loop, name="nvrar-store", daemon=True)
        self._acceptor.start()

    def _finished(self) -> bool:
        return len(self._done) >= self._expected or time.monotonic() > self._deadline

    def _accept_loop(self) -> None:
        while True:
            with self._cond:
                if self._finished():
                    break
            try:
                conn, peer = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            try:
                owner = socket_owner(peer, conn.getsockname())
            except (OSError, ValueError):
                owner = None
            refusal = ""
            if owner is not None and owner != self._uid:
                refusal = (f"the rendezvous store serves only the processes of uid {self._uid}; this connection "
                           f"comes from uid {owner}")
            elif owner is None and self._key is None:
                refusal = (f"the rendezvous store accepts only processes of uid {self._uid} on this host unless "
                           "every rank has the same NVRAR_SESSION_SECRET; this connection comes from another host "
                           f"or network namespace ({peer[0]})")
            if refusal:
                self._note_refused(refusal)
            with self._cond:
                if self._pending >= _MAX_PENDING and (refusal or owner is None):
                    conn.close()  # a flood of strangers: drop without a word
                    continue
                self._pending += 1
            if refusal:
                threading.Thread(target=self._refuse, args=(conn, refusal), daemon=True).start()
            else:
                threading.Thread(target=self._serve, args=(conn, owner is not None), daemon=True).start()
        self._sock.close()

    def _refuse(self, conn: socket.socket, why: str) -> None:
        """Tell a refused client why (a misconfigured rank then raises it), then drop it."""
        try:
            conn.settimeout(1.0)
            _reply(conn, _ERROR, why.encode())
            conn.shutdown(socket.SHUT_WR)
            end = time.monotonic() + 1.0
            while time.monotonic() < end and conn.recv(4096):  # drain, so that the reply is not reset
                pass
        except OSError:
            pass
        finally:
            conn.close()
            with self._cond:
                self._pending -= 1

    def _handshake(self, conn: socket.socket, same_user: bool) -> Optional[int]:
        """The authenticated rank of ``conn``, or None (the client was answered and is dropped)."""
        op, session, value = _recv_request(conn, 256, _HELLO.size)
        if op != _OP_HELLO or len(value) != _HELLO.size:
            raise _Malformed("the first message must be a hello")
        if session != self._session:
            # A client of another rendezvous (the previous one still closing on this port, or the
            # next one arriving early) is told so, and retries.
            _reply(conn, _OTHER)
            return None
        rank, nonce_c = _HELLO.unpack(value)
        if not 0 <= rank < self._expected:
            self._note_refused(f"a process at {_peer_text(conn)} said it is rank {rank}, outside 0..{self._expected - 1} "
                               "(launched with another WORLD_SIZE?)")
            raise _Malformed(f"hello from rank {rank}, outside 0..{self._expected - 1}")
        with self._cond:
            if rank in self._connected:
                raise _Malformed(f"rank {rank} is already connected (two processes started with RANK={rank}?)")
        if self._key is None:
            if not same_user:  # refused at accept already; never served
                raise _Malformed("connection of an unknown user")
            _reply(conn, _OK, _MODE_UID)
        else:
            nonce_s = os.urandom(_NONCE)
            _reply(conn, _OK, _MODE_SECRET + nonce_s + _mac(self._key, b"server", session, rank, nonce_c, nonce_s))
            try:
                op, _, proof = _recv_request(conn, 0, 64)
            except (OSError, ConnectionError, _Malformed):
                # A client checks my proof first: with another secret it leaves without its own.
                self._note_refused(f"a process at {_peer_text(conn)} saying it is rank {rank} left during "
                                   "authentication (its NVRAR_SESSION_SECRET differs from rank 0's?)")
                raise
            if op != _OP_PROOF or not hmac.compare_digest(proof, _mac(self._key, b"client", session, rank, nonce_c,
                                                                      nonce_s)):
                # Rank 0 names it too, should it time out waiting for this rank.
                self._note_refused(f"a process at {_peer_text(conn)} saying it is rank {rank} failed authentication "
                                   "(its NVRAR_SESSION_SECRET differs from rank 0's)")
                raise _Malformed("authentication failed: this rank's NVRAR_SESSION_SECRET differs from rank 0's")
            _reply(conn, _OK)
        with self._cond:
            if rank in self._connected:
                raise _Malformed(f"rank {rank} is already connected (two processes started with RANK={rank}?)")
            self._connected.add(rank)
            self._gone.discard(rank)
        return rank

    def _note_refused(self, why: str) -> None:
        with self._cond:
            if len(self.refused) < 4:
                self.refused.append(why)

    def _disconnected(self, rank: Optional[int]) -> None:
        with self._cond:
            if rank is not None and rank not in self._done:
                self._connected.discard(rank)
                self._gone.add(rank)
                self._cond.notify_all()

    def _serve(self, conn: socket.socket, same_user: bool) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rank = None
        try:
            conn.settimeout(_HANDSHAKE_S)
            try:
                rank = self._handshake(conn, same_user)
            finally:
                with self._cond:
                    self._pending -= 1
            if rank is None:
                return
            conn.settimeout(max(0.1, self._deadline - time.monotonic()))
            while True:
                op, key, value = _recv_request(conn, MAX_KEY_BYTES, MAX_VALUE_BYTES)
                if op == _OP_SET:
                    with self._cond:
                        if key in self._data:
                            raise _Malformed(f"key {key[:80]!r} is already set (keys are written once)")
                        if len(self._data) >= MAX_KEYS or self._bytes + len(key) + len(value) > MAX_STORE_BYTES:
                            raise _Malformed(f"the store is full ({len(self._data)} keys, {self._bytes} bytes; limits "
                                             f"{MAX_KEYS} keys, {MAX_STORE_BYTES} bytes)")
                        self._data[key] = value
                        self._bytes += len(key) + len(value)
                        self._cond.notify_all()
                    _reply(conn, _OK)
                elif op == _OP_GET:
                    if len(value) != 8:
                        raise _Malformed(f"get: the wait is 8 bytes, got {len(value)}")
                    (wait_s,) = struct.unpack("!d", value)
                    if not wait_s >= 0.0:  # NaN too
                        raise _Malformed(f"get: bad wait {wait_s}")
                    deadline = min(time.monotonic() + wait_s, self._deadline)
                    with self._cond:
                        while key not in self._data and time.monotonic() < deadline:
                            self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
                        got = self._data.get(key)
                    if got is None:
                        _reply(conn, _MISSING)
                    else:
                        _reply(conn, _OK, got)
                elif op == _OP_DONE:
                    with self._cond:
                        self._done.add(rank)
                        self._cond.notify_all()
                    _reply(conn, _OK)
                    return
                else:
                    raise _Malformed(f"unexpected {_OP_NAMES[op]} after the handshake")
        except _Malformed as exc:
            self._disconnected(rank)  # before the reply: the rank may reconnect as soon as it reads it
            try:
                conn.settimeout(1.0)
                _reply(conn, _ERROR, str(exc).encode())
            except OSError:
                pass
        except (OSError, ConnectionError, struct.error):
            return
        finally:
            self._disconnected(rank)
            conn.close()

    def wait_closed(self, timeout: float) -> None:
        """Wait (bounded) until every client said done or is gone (its connection closed without a
        done: a rank that died after the last exchange does not hold rank 0 to the deadline), then
        stop listening."""
        end = time.monotonic() + timeout
        with self._cond:
            while len(self._done | self._gone) < self._expected and time.monotonic() < min(end, self._deadline):
                self._cond.wait(0.05)
            self._expected = 0  # stop the acceptor even on timeout
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the acceptor now, not at its next poll
        except OSError:
            pass
        self._acceptor.join(timeout=1.0)


def resolve(host: str, port: int, who: str, passive: bool = False) -> List[tuple]:
    """getaddrinfo of MASTER_ADDR:MASTER_PORT, or an NvrarError naming them."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE if passive else 0)
    except (socket.gaierror, UnicodeError) as exc:
        raise NvrarError(f"bootstrap: {who}: MASTER_ADDR={host!r} does not resolve to an address ({exc})") from None
    if not infos:
        raise NvrarError(f"bootstrap: {who}: MASTER_ADDR={host!r} does not resolve to an address")
    return infos


class StoreClient:
    """One rank's connection to the store; ``timeout`` bounds every operation."""

    def __init__(self, host: str, port: int, timeout: float, rank: int, session: bytes = b"",
                 secret: Optional[bytes] = None) -> None:
        self._rank = rank
        self._timeout = timeout
        self._where = f"{host}:{port}"
        family, _, _, _, sockaddr = resolve(host, port, f"rank {rank}")[0]
        deadline = time.monotonic() + timeout
        delay = 0.002  # rank 0 may not listen yet: poll briskly (a local connect costs microseconds)
        last: Optional[Exception] = None
        while True:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(max(0.1, min(_HANDSHAKE_S, deadline - time.monotonic())))
                sock.connect(sockaddr)
                self._sock = sock
                if self._handshake(session, secret):
                    break
                last = ConnectionError("the store serves another rendezvous")
                sock.close()
            except (OSError, ConnectionError) as exc:  # the server may not be up yet
                sock.close()
                last = exc
            if time.monotonic() + delay > deadline:
                raise NvrarTimeoutError(
                    f"bootstrap: rank {rank} could not reach the rendezvous store at {self._where} within "
                    f"{timeout:.0f} s ({last}); is rank 0 running, and are MASTER_ADDR/MASTER_PORT right?",
                    rank=rank, peer=0, phase="bootstrap", kind="timeout",
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        self._sock.settimeout(timeout + 5.0)

    def _fail(self, what: str) -> NvrarError:
        self._sock.close()
        return NvrarError(f"bootstrap: rank {self._rank}: the rendezvous store at {self._where} {what}",
                          rank=self._rank, peer=0, phase="bootstrap")

    def _handshake(self, session: bytes, secret: Optional[bytes]) -> bool:
        """Authenticate both ways; False if the server serves another rendezvous (retry)."""
        nonce_c = os.urandom(_NONCE)
        status, payload = self._call(_OP_HELLO, session, _HELLO.pack(self._rank, nonce_c), "hello")
        if status == _OTHER:
            return False
        if status != _OK or not payload:
            raise self._fail(f"answered the hello with status {status!r}")
        mode = payload[:1]
        if mode == _MODE_UID:
            if secret is not None:
                raise self._fail("runs without NVRAR_SESSION_SECRET, but this rank has one; set the same "
                                 "NVRAR_SESSION_SECRET on every rank, or on none")
            me = os.geteuid()
            try:
                owner = socket_owner(self._sock.getpeername(), self._sock.getsockname())
            except (OSError, ValueError):
                owner = None
            if owner is None:
                raise self._fail(
                    "is not a process of this host (or /proc/net/tcp is unreadable), so its owner cannot be "
                    "checked; across hosts, set the same NVRAR_SESSION_SECRET on every rank")
            if owner != me:
                raise self._fail(f"is served by uid {owner}, not by this user (uid {me}): another user's "
                                 "process holds MASTER_PORT; pick another port")
            return True
        if mode == _MODE_SECRET:
            if secret is None:
                raise self._fail("requires NVRAR_SESSION_SECRET (rank 0 has one), but this rank has none; set the "
                                 "same NVRAR_SESSION_SECRET on every rank")
            nonce_s, proof = payload[1:1 + _NONCE], payload[1 + _NONCE:]
            if len(nonce_s) != _NONCE or not hmac.compare_digest(
                    proof, _mac(secret, b"server", session, self._rank, nonce_c, nonce_s)):
                raise self._fail("failed authentication: rank 0's NVRAR_SESSION_SECRET differs from this rank's "
                                 "(or another process holds MASTER_PORT)")
            status, _ = self._call(_OP_PROOF, b"", _mac(secret, b"client", session, self._rank, nonce_c, nonce_s),
                                   "proof")
            if status != _OK:
                raise self._fail(f"answered the authentication with status {status!r}")
            return True
        raise self._fail(f"answered the hello with an unknown mode {mode!r}")

    def _lost(self, exc: Exception) -> NvrarError:
        return NvrarTimeoutError(
            f"bootstrap: rank {self._rank} lost the rendezvous store at {self._where} ({exc}); rank 0, which serves "
            "it, probably exited",
            rank=self._rank, peer=0, phase="bootstrap", kind="timeout",
        )

    def _call(self, op: bytes, key: bytes, value: bytes, what: str) -> Tuple[bytes, bytes]:
        """One request (one send) and its reply; the store's refusals raise NvrarError."""
        self._sock.sendall(_REQ.pack(op, len(key), len(value)) + key + value)
        status, n = _REP.unpack(_recv_exact(self._sock, _REP.size))
        if n > MAX_VALUE_BYTES:
            raise self._fail(f"sent a reply of {n} bytes to a {what} (limit {MAX_VALUE_BYTES})")
        payload = _recv_exact(self._sock, n)
        if status == _ERROR:
            raise self._fail(f"refused rank {self._rank}'s {what}: {payload.decode(errors='replace')}")
        if status not in (_OK, _MISSING, _OTHER):
            raise self._fail(f"sent a malformed reply (status {status!r}) to a {what}")
        return status, payload

    def _checked(self, key: bytes, value: bytes, what: str) -> None:
        if len(key) > MAX_KEY_BYTES or len(value) > MAX_VALUE_BYTES:
            raise NvrarError(f"bootstrap: rank {self._rank}: {what} of a {len(key)}-byte key and a {len(value)}-byte "
                             f"value exceeds the store's limits ({MAX_KEY_BYTES}, {MAX_VALUE_BYTES} bytes)",
                             rank=self._rank, phase="bootstrap")

    def set(self, key: bytes, value: bytes) -> None:
        self._checked(key, value, "set")
        try:
            self._call(_OP_SET, key, value, f"set of {key.decode(errors='replace')!r}")
        except (OSError, ConnectionError, struct.error) as exc:
            raise self._lost(exc) from None

    def get(self, key: bytes, timeout: Optional[float] = None) -> Optional[bytes]:
        """The value of ``key``, waiting for it up to ``timeout``; None if it never came."""
        self._checked(key, b"", "get")
        wait = struct.pack("!d", self._timeout if timeout is None else max(0.0, timeout))
        try:
            status, payload = self._call(_OP_GET, key, wait, f"get of {key.decode(errors='replace')!r}")
        except (OSError, ConnectionError, struct.error) as exc:
            raise self._lost(exc) from None
        return None if status == _MISSING else payload

    def close(self) -> None:
        try:
            self._call(_OP_DONE, b"", b"", "done")
        except (OSError, ConnectionError, struct.error, NvrarError):
            pass
        finally:
            self._sock.close()
