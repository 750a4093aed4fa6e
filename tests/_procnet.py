"""What a process listens on, read from ``/proc`` (no psutil), for the inner sessions that check binds.

The outer test copies this file into its pytester directory (:func:`install`), so the inner test imports the one
copy of the rule: ``from procnet import listening``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

LISTEN = "0A"  # the TCP state column of /proc/net/tcp{,6}
LOOPBACK_V4 = "0100007F"  # 127.0.0.1 as /proc/net/tcp spells it (little-endian hex)


def socket_inodes(pid: int) -> set[str]:
    """The inode of every socket among ``pid``'s open fds."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def listening(pid: int) -> list[tuple[str, int]]:
    """``(ip_hex, port)`` of every listening TCP socket of process ``pid``, IPv4 and IPv6."""
    inodes = socket_inodes(pid)
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                ip, port = fields[1].split(":")
                out.append((ip, int(port, 16)))
    return out


def install(pytester: Any) -> None:
    """Copy this module into ``pytester``'s directory as ``procnet.py`` (importable by its inner tests)."""
    pytester.makepyfile(procnet=Path(__file__).read_text())
