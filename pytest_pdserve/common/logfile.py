"""Files the plugin writes, and reading a server's log (its size, its last lines, what it gained since an offset).

Every file the plugin writes goes through one of two functions here: :func:`open_append` (logs) and
:func:`write_replace` (whole files). Neither follows a symbolic link, writes into a hard-linked file or blocks on
a FIFO; such an entry is refused with an ``OSError`` whose text says what it is. Lock files are the lease
directory's own rule (:mod:`pytest_pdserve.machine.lockfiles`: a foreign entry there counts as busy).
[pytest-free, stdlib]

Logs of minute-long GPU startups reach many MB, so every reader here seeks from the end and reads a bounded
amount. A log that cannot be read (not created yet, removed) reads as empty: these feed error messages and
report sections, which must not fail themselves.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["check_writable", "log_size", "open_append", "read_since", "tail_lines", "write_replace"]


def _what(st: os.stat_result) -> str:
    """What a directory entry is, said plainly (lstat result), for the refusal of a file we would write."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link; pdserve never writes through a link"
    if stat.S_ISFIFO(st.st_mode):
        return "a FIFO"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    if stat.S_ISREG(st.st_mode):
        return f"a file with {st.st_nlink} hard links; writing it would write another file too"
    return "a device or a socket"


def _refuse(path: Path, st: os.stat_result) -> OSError:
    # ELOOP for a link, as O_NOFOLLOW says it; the text (exc.strerror) is what callers show after the path.
    code = errno.ELOOP if stat.S_ISLNK(st.st_mode) else errno.EINVAL
    return OSError(code, f"not a regular file ({_what(st)})", str(path))


def check_writable(path: Path) -> None:
    """Refuse (by name) an existing ``path`` that is no plain regular file of one name: a link, a FIFO, a device...

    What :func:`open_append` and :func:`write_replace` check before they write; callers that validate a path
    ahead of time (the export file at configure) use it too, so the two checks cannot disagree."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        raise _refuse(path, st)


def open_append(path: Path, mode: int = 0o600) -> int:
    """A file descriptor appending to the regular file ``path`` (created with ``mode`` if missing).

    The one way the plugin opens a file to append (server and proxy logs, pdserve.log, watchdog, guard and keeper
    logs): never through a symbolic link (a link planted in a shared directory would make us write its target),
    never into a file with other hard links, and never blocking: opening a FIFO for writing waits until someone
    reads it, forever if nobody does (a FIFO named ``keeper.log`` hung pytest at its end).

    :raises OSError: ``path`` is a FIFO, a device, a directory, a symbolic link or a hard-linked file; the
        ``strerror`` says which (``not a regular file (...)``), the caller names the path.
    """
    check_writable(path)  # said plainly: opening a FIFO nobody reads fails with ENXIO, "No such device"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            raise _refuse(path, st)  # swapped in between our lstat and our open
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_safety_net_log(path: Path | None, who: str) -> int:
    """Where a safety-net process (the watchdog, the guard) writes: ``path`` opened by :func:`open_append`, or
    ``subprocess.DEVNULL`` when there is none or it is unusable (a link or a FIFO planted there). A safety net
    must start whatever its log path holds, so the refusal is said on stderr and the process logs nowhere.
    The caller closes a returned fd (not DEVNULL) once the child has it.
    """
    if path is None:
        return subprocess.DEVNULL
    try:
        return open_append(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            sys.stderr.write(f"pdserve: {who} log {path} unusable ({exc.strerror or exc}); it logs nowhere\n")
        return subprocess.DEVNULL


def write_replace(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path``'s content with ``data`` atomically: a new file (``O_EXCL``, a fresh name next to it), then
    ``rename`` over ``path``. The one way the plugin writes a whole file (the ``--pd-export-env`` file, kept-cluster
    state files, the reuse directory's marker).

    A rename replaces the name, never what a link points to, and a reader never sees half a file; an existing
    ``path`` that is a link (or a FIFO, a directory, a hard-linked file) is refused by name, not replaced: in a
    shared directory someone else planted it.

    :raises OSError: as :func:`open_append`, or the directory refused the new file or the rename (another user's
        file in a sticky directory).
    """
    check_writable(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # O_EXCL, mode 0600
    try:
        with os.fdopen(fd, "wb") as fh:
            if mode != 0o600:
                os.fchmod(fh.fileno(), mode)
            fh.write(data)
        check_writable(path)  # planted while we wrote: still refused, never replaced
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
            data = fh.read(max(0, size - start))  # what was there: bounded even if the log grows meanwhile
    except OSError:
        return ""
    text = data.decode("utf-8", "replace")
    return text if start == since else "[...]\n" + text.split("\n", 1)[-1]
