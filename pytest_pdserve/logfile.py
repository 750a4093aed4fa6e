"""Reading a server's log file: its size, its last lines, what it gained since an offset. [pytest-free, stdlib]

Logs of minute-long GPU startups reach many MB, so every reader here seeks from the end and reads a bounded
amount. A log that cannot be read (not created yet, removed) reads as empty: these feed error messages and
report sections, which must not fail themselves.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["log_size", "read_since", "tail_lines"]


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
