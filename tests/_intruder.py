"""A hostile client of nvrar's TCP store: `python _intruder.py PORT SECONDS [--setuid UID]`.

Imports everything it needs, optionally drops to another user (the tests run as root: the
interpreter's files may be unreadable afterwards), then for SECONDS attacks 127.0.0.1:PORT over
and over, one connection per attempt: the store's hello in the framing of the version the issue
attacked (then a set of a rank's segment-name key and two "done"), the current hello (then a
forged proof, or a set and two "done" if served), garbage bytes, a 16 MiB value. Prints a JSON
summary: attempts, connections made, what the store answered."""

from __future__ import annotations

import encodings.idna  # noqa: F401  (socket needs it; unreadable after setuid)
import json
import os
import socket
import struct
import sys
import time

SESSION = b"nvrar/./1"          # the first rendezvous of a fresh process (predictable, not secret)
EVIL = b"/nvrar-intruder"


def _field(data: bytes) -> bytes:
    return struct.pack("!I", len(data)) + data


def _req(op: bytes, key: bytes, value: bytes) -> bytes:
    return struct.pack("!cII", op, len(key), len(value)) + key + value


def _read(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except socket.timeout:
        return b"<silent>"
    except OSError:
        return b""


def attack(port: int, kind: int) -> dict:
    sock = socket.socket()
    sock.settimeout(1.0)
    try:
        sock.connect(("127.0.0.1", port))
    except OSError:
        sock.close()
        return {"connected": False}
    out = {"connected": True, "kind": kind, "accepted": False, "reply": b""}
    try:
        if kind == 0:  # the attack of issue 13, in that version's framing
            sock.sendall(b"H" + _field(SESSION))
            out["reply"] = r = _read(sock)
            if r[:1] == b"\x00":
                out["accepted"] = True
                key = SESSION + b"/2/1"
                sock.sendall(b"S" + _field(key) + _field(EVIL) + b"D" + _field(b"") + b"D" + _field(b""))
        elif kind == 1:  # current framing
            sock.sendall(_req(b"H", SESSION, struct.pack("!i16s", 1, os.urandom(16))))
            out["reply"] = r = _read(sock)
            if r[:1] == b"\x00" and r[5:6] == b"U":
                out["accepted"] = True
            elif r[:1] == b"\x00" and r[5:6] == b"S":
                sock.sendall(_req(b"P", b"", os.urandom(32)))
                r2 = _read(sock)
                out["reply"] = r2  # the first reply carries random nonces
                out["accepted"] = r2[:1] == b"\x00"
            if out["accepted"]:
                sock.sendall(_req(b"S", SESSION + b"/2/1", EVIL) + _req(b"D", b"", b"") + _req(b"D", b"", b""))
        elif kind == 2:
            sock.sendall(b"\xff" + os.urandom(63))  # garbage whose operation byte is none of the store's
            out["reply"] = _read(sock)
        else:
            sock.sendall(struct.pack("!cII", b"S", 8, 16 << 20) + b"x" * 8 + b"\0" * 65536)  # a 16 MiB value
            out["reply"] = _read(sock)
    except OSError as exc:
        out["error"] = str(exc)
    finally:
        sock.close()
    out["reply"] = out["reply"][:200].decode("latin-1")
    return out


def main() -> int:
    port, seconds = int(sys.argv[1]), float(sys.argv[2])
    if "--setuid" in sys.argv:
        uid = int(sys.argv[sys.argv.index("--setuid") + 1])
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    print(json.dumps({"ready": True, "uid": os.geteuid()}), flush=True)
    end = time.monotonic() + seconds
    results = []
    kind = 0
    while time.monotonic() < end:
        results.append(attack(port, kind % 4))
        kind += 1
        time.sleep(0.002)
    made = [r for r in results if r["connected"]]
    print(json.dumps({"attempts": len(results), "connected": len(made),
                      "accepted": [r for r in made if r["accepted"]],
                      "replies": [rep for k in range(4) for rep in sorted({r["reply"] for r in made
                                                                           if r["kind"] == k})[:5]]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
