"""Log files: reading a server's (its size, its last lines, what it gained since an offset), and opening a
supervision log to append to (:func:`open_append`). [pytest-free, stdlib]

Logs of minute-long GPU startups reach many MB, so every reader here seeks from the end and reads a bounded
amount. A log that cannot be read (not created yet, removed) reads as empty: these feed error messages and
report sections, which must not fail themselves.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["log_size", "open_append", "read_since", "tail_lines"]


def open_append(path: Path, mode: int = 0o600) -> int:
    """A file descriptor appending to the regular file ``path`` (created with ``mode`` if missing).

    Never blocks: opening a FIFO for writing waits until someone reads it, forever if nobody does (a FIFO named
    ``keeper.log`` hung pytest at its end, one named ``guard.log`` left a keeper blocked holding leases).

    :raises OSError: ``path`` is a FIFO, a device, a directory or a symbolic link.
    """
    not_a_file = OSError(errno.EINVAL, "not a regular file (a FIFO, a device, a directory or a link)", str(path))
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise not_a_file  # said plainly: opening a FIFO nobody reads fails with ENXIO, "No such device"
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise not_a_file
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def log_size(path: Path | None) -> int:
    """Current size in bytes (0 when there is no log); remember it to read only what came after."""
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def tail_lines(path: Path, lines: int) -> str:
    """Last ``lines`` lines of a file, reading backwards in chunks (never more than 4 MB)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            end = fh.tell()
            chunk = 8192
            data = b""
            while True:
                start = max(0, end - chunk)
                fh.seek(start)
                data = fh.read(end - start)
                if start == 0 or data.count(b"\n") > lines or chunk >= 4 << 20:
                    break
                chunk *= 4
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:]) + ("\n" if text.endswith("\n") else "")


def read_since(path: Path | None, since: int = 0, max_bytes: int = 256 * 1024) -> str:
    """Text written after byte offset ``since`` (the last ``max_bytes`` of it, after a ``[...]`` line)."""
    if path is None:
        return ""
    try:
        with path.open("rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            start = max(since, size - max_bytes)
            fh.seek(start)
            data = fh.read()
    except OSError:
        return ""
    text = data.decode("utf-8", "replace")
    return text if start == since else "[...]\n" + text.split("\n", 1)[-1]
