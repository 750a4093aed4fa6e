"""The keeper's protocol, defined once: `keeper.py` answers it, `client.py` and `handover.py` speak it. [stdlib-only]

Two channels:

* **Start.** pytest writes one JSON :class:`order <KeeperOrder>` on the keeper's stdin; the keeper answers one line,
  ``ready <pid> <socket>`` once it owns the clusters (``error ...`` when it cannot), on its stdout.
* **Socket.** The keeper listens on an abstract Unix socket named ``pytest-pdserve-keeper-<uid>-<random>`` (no path
  to plant, only our uid served: ``SO_PEERCRED``). One request line, one reply line:

  - ``claim ID [TTL]`` -> ``ok`` | ``busy`` | ``unknown``. The connection left open *is* the claim (the kernel
    ends it if the run dies); the keeper writes ``stopped ID: WHY`` on it if it stops the cluster meanwhile.
  - ``stop ID`` or ``stop *`` -> ``{"stopped": [ID...], "left": N}`` (``left`` 0: the keeper exits now).
  - ``info`` -> ``{ID: {"claimed": bool, "idle_seconds": float, "ttl": float}}``.
  - anything else -> ``error unknown command``.
"""

from __future__ import annotations

import json
import math
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BUSY",
    "CLAIM",
    "INFO",
    "MAX_LINE",
    "OK",
    "READY",
    "STOP",
    "STOP_ALL",
    "UNKNOWN",
    "KeeperOrder",
    "OrderedCluster",
    "claim_line",
    "parse_claim",
    "peer_uid_pid",
    "recv_line",
    "socket_name",
    "stopped_line",
]

CLAIM, STOP, INFO = "claim", "stop", "info"
OK, BUSY, UNKNOWN = "ok", "busy", "unknown"
STOP_ALL = "*"
READY = "ready"
ERROR_UNKNOWN = "error unknown command"
#: The longest request line the keeper reads (replies may be longer: ``info`` of many clusters).
MAX_LINE = 4096


def socket_name(uid: int, nonce: str) -> str:
    """The keeper's abstract socket name (without the leading NUL)."""
    return f"pytest-pdserve-keeper-{uid}-{nonce}"


def peer_uid_pid(sock: socket.socket) -> tuple[int, int]:
    """``(uid, pid)`` of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return uid, pid


def claim_line(cluster_id: str, ttl: float | None) -> str:
    """``claim ID [TTL]``: the claiming run's --pd-reuse-ttl applies once it lets go."""
    return f"{CLAIM} {cluster_id}{f' {ttl!r}' if ttl is not None else ''}"


def parse_claim(arg: str) -> tuple[str, float | None]:
    """``ID [TTL]`` -> ``(ID, TTL)``; a TTL that is not a positive finite number is None (the kept one stays)."""
    cid, _, ttl_text = arg.partition(" ")
    try:
        ttl = float(ttl_text)
    except ValueError:
        return cid, None
    return cid, ttl if math.isfinite(ttl) and ttl > 0 else None


def stopped_line(cluster_id: str, why: str) -> str:
    """What the keeper tells the run holding a cluster it stops."""
    return f"stopped {cluster_id}: {why}"


def stop_reply(stopped: Sequence[str], left: int) -> str:
    return json.dumps({"stopped": list(stopped), "left": left})


def info_reply(info: Mapping[str, Mapping[str, Any]]) -> str:
    return json.dumps(info)


def ready_line(pid: int, name: str) -> str:
    return f"{READY} {pid} {name}"


def parse_ready(line: str) -> int | None:
    """The keeper's pid from its ``ready`` line, else None."""
    word, _, rest = line.partition(" ")
    try:
        return int(rest.split()[0]) if word == READY else None
    except (IndexError, ValueError):
        return None


def recv_line(sock: socket.socket) -> str:
    """One reply line (bounded: at most 64 chunks)."""
    buf = b""
    for _ in range(64):
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
        if b"\n" in buf:
            break
    return buf.partition(b"\n")[0].decode(errors="replace")


@dataclass(frozen=True)
class OrderedCluster:
    """One cluster in a keeper's order: its state (`state.KeptState.as_dict`), the ``(lease fd, lock file)`` pairs
    it inherits, and the want files that say another run waits for those leases."""

    state: Mapping[str, Any]
    locks: tuple[tuple[int, str], ...]
    want: tuple[str, ...]


@dataclass(frozen=True)
class KeeperOrder:
    """What pytest writes on a new keeper's stdin."""

    reuse_dir: str
    ttl: float
    grace: float
    run_token: str
    clusters: tuple[OrderedCluster, ...]

    def encode(self) -> bytes:
        return json.dumps({
            "reuse_dir": self.reuse_dir, "ttl": self.ttl, "grace": self.grace, "run_token": self.run_token,
            "clusters": [{"state": dict(c.state), "locks": [list(x) for x in c.locks], "want": list(c.want)}
                         for c in self.clusters],
        }).encode()  # fmt: skip

    @classmethod
    def decode(cls, raw: bytes) -> KeeperOrder:
        """:raises ValueError, KeyError, TypeError: not an order."""
        order = json.loads(raw)
        clusters = tuple(
            OrderedCluster(
                dict(c["state"]),
                tuple((int(fd), str(lock)) for fd, lock in c.get("locks", ())),
                tuple(str(w) for w in c.get("want", ())),
            )
            for c in order["clusters"]
        )
        return cls(str(order["reuse_dir"]), float(order["ttl"]), float(order["grace"]), str(order["run_token"]),
                   clusters)  # fmt: skip
