"""One lock file in a shared, sticky lease directory: open it safely, flock it, record and describe its holder.

:mod:`pytest_pdserve.machine.leases` (GPUs) and :mod:`pytest_pdserve.machine.port_leases` build on these primitives, on
:class:`Lease` (lock files held and released together) and on :func:`ensure_lease_dir`. The directory is shared
by every user of the machine, so an entry named like a lock file may be anything: a directory, a symlink (to
``/etc/passwd``, or ``/dev/zero``), a fifo, a hard link to someone's file, another user's file we may not
write. Such an entry is never followed, written, truncated or read without bound: it counts as *busy* (that GPU
or port is skipped, or waited for), and its path and what it is are logged once and named in waiting messages.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from pytest_pdserve.common import created
from pytest_pdserve.common.owner import Owner
from pytest_pdserve.common.procstat import read_stat
from pytest_pdserve.errors import LeaseDirUnusable, NoRoom, NotALockFile, PathError
from pytest_pdserve.machine.paths import LEASE_DIR_MODE, ensure_dir, fs_error_words

if TYPE_CHECKING:  # typing.Self is Python 3.11+; annotations are strings here (PEP 563)
    from typing import Self

__all__ = [
    "KEPT_FOR_REUSE", "KEPT_RELEASE_WAIT", "Lease", "describe_holder", "ensure_lease_dir",
    "foreign", "lock_from_keeper", "try_lock", "unlock", "want", "want_file", "write_holder",
]  # fmt: skip

log = logging.getLogger(__name__)


#: The holder purpose a reuse keeper (`reuse/keeper.py`) writes for the leases it holds: such a GPU is kept, not used.
KEPT_FOR_REUSE = "kept for reuse"
#: How long a run waits for a lease only a kept cluster holds (the keeper's 0.5 s tick, then its servers' shutdown).
KEPT_RELEASE_WAIT = 15.0

#: Foreign entries seen by this process: path -> why. Such a GPU or port counts as busy, named in messages.
_FOREIGN: dict[Path, str] = {}


def _unusable(path: Path, words: str) -> str:
    return (
        f"lease directory {path.parent}: cannot create or open the lock file {path.name}: {words}; free some, or "
        "choose another lease directory with --pd-lease-dir / $PDSERVE_LEASE_DIR / pdserve_lease_dir"
    )


def _not_ours(path: Path, why: str) -> NotALockFile:
    """Log (once per path and reason) and return the error for an entry that is not one of our lock files."""
    if _FOREIGN.get(path) != why:
        log.warning("pdserve: %s is not a pdserve lock file (%s); treating that GPU/port as busy", path, why)
        _FOREIGN[path] = why
    return NotALockFile(why)


def _open_regular(path: Path, *, create: bool) -> int:
    """Open ``path`` read-write without following a symlink or blocking on a fifo; it must be a regular file.

    :raises FileNotFoundError: it does not exist (and ``create`` is False).
    :raises FileExistsError: ``create`` is True and it exists.
    :raises NotALockFile: it exists but is not a regular file we may lock (the reason names what it is).
    :raises LeaseDirUnusable: the file system or this process cannot open any lock file now (full, read-only...).
    """
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    if create:
        flags |= os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(path, flags, 0o666)
    except (FileNotFoundError, FileExistsError):
        raise
    except OSError as exc:
        # The file system (full, out of inodes, read-only) or this process (out of fds), not this entry: every other
        # port or GPU would fail alike, so it is the run's answer, said once as it is, never "busy" a thousand times.
        if (words := fs_error_words(exc, path.parent)) is not None:
            raise LeaseDirUnusable(_unusable(path, words)) from None
        if exc.errno == errno.ELOOP:
            raise _not_ours(path, "a symbolic link") from None
        if exc.errno == errno.EISDIR:
            raise _not_ours(path, "a directory") from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise _not_ours(path, f"not writable by uid {os.geteuid()}") from None
        raise _not_ours(path, f"cannot be opened: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _not_ours(path, "a fifo" if stat.S_ISFIFO(st.st_mode) else "not a regular file")
    why = ""
    if st.st_nlink > 1:
        why = f"a file with {st.st_nlink} hard links"  # writing to it would write to some other file
    elif st.st_uid != os.geteuid() and stat.S_IMODE(st.st_mode) & 0o666 != 0o666:
        # Ours are 0666 so every user can lock them; root could open this one anyway, but nobody else could.
        why = f"owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o} (pdserve's lock files are 0666)"
    if why:
        os.close(fd)
        raise _not_ours(path, why)
    return fd


def _open_shared(path: Path) -> int:
    """Open (creating if needed) a lock file in a sticky shared dir; mode 0666 so other users can lock it.

    :raises NotALockFile: the entry is not a regular file we can lock.
    """
    for _ in range(10):
        try:
            return _open_regular(path, create=False)
        except FileNotFoundError:
            pass
        try:
            fd = _open_regular(path, create=True)
        except FileExistsError:
            continue  # lost a creation race: open the winner's file
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o666)  # the umask stripped group/other write (our own new file)
        return fd
    raise _not_ours(path, "it keeps appearing and disappearing")


def try_lock(path: Path) -> int | None:
    """Non-blocking exclusive flock; returns the fd holding it, or None if it is busy (held by someone
    else, or not a lock file of ours at all)."""
    for _ in range(10):
        try:
            fd = _open_shared(path)
        except NotALockFile:
            return None
        _FOREIGN.pop(path, None)  # a lock file of ours now (held or not): no longer "not a pdserve lock file"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            raise
        # The previous holder unlinks the file on release; if that happened between our open and our
        # flock we locked an orphaned inode that nobody else will ever look at: retry on the new file.
        try:
            same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            _FOREIGN.pop(path, None)
            return fd
        os.close(fd)
    return None


#: The keys of a holder file (what :func:`write_holder` writes): its content is its proof (`common/created.py`).
_HOLDER_KEYS = frozenset({"pid", "pgid", "starttime", "uid", "purpose", "since"})


def _holder_record(fd: int) -> bool:
    """Whether the open file holds nothing, or a holder record as :func:`write_holder` writes it (bounded read)."""
    try:
        raw = os.pread(fd, 4097, 0)
    except OSError:
        return False
    if not raw:
        return True
    try:
        info = json.loads(raw)
    except ValueError:
        return False
    return isinstance(info, dict) and set(info) == _HOLDER_KEYS


def unlock(fd: int, path: Path) -> None:
    """Release a lock taken by :func:`try_lock` and remove its files (they would pile up otherwise).

    Removed only when proven ours (:func:`pytest_pdserve.common.created.remove_if`): the lock file while we hold its
    lock through that very inode and it is empty (pdserve never writes into one), the holder file when it holds a
    holder record. A lease directory the user pointed at their own files (``--pd-lease-dir=.``) loses none of them.
    """
    # Unlink *while still locked* so a waiter that opened the old inode notices (see try_lock).
    # Another user's file in the sticky dir cannot be unlinked (EPERM): it simply stays.
    try:
        held = os.fstat(fd).st_ino
    except OSError:
        held = -1
    created.remove_if(path.with_suffix(".json"), lambda f, st: _holder_record(f))
    created.remove_if(path, lambda f, st: st.st_ino == held and st.st_size == 0)
    # LOCK_UN (not just close) so the lease frees at once even if the watchdog holds a duplicate fd.
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    with contextlib.suppress(OSError):
        os.close(fd)


def write_holder(lock_path: Path, purpose: str) -> None:
    info = {
        "pid": os.getpid(),
        "pgid": os.getpgrp(),
        "starttime": me.starttime if (me := read_stat(os.getpid())) is not None else 0,
        "uid": os.geteuid(),
        "purpose": purpose,
        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        fd = _open_shared(lock_path.with_suffix(".json"))
        try:
            if not _holder_record(fd):  # someone's own file of that name: never truncated (common/created.py)
                raise NotALockFile("it holds something else than a holder record")
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(info).encode())
        finally:
            os.close(fd)
    except (OSError, NotALockFile, LeaseDirUnusable) as exc:  # diagnostics only
        log.debug("could not write lease holder info for %s: %s", lock_path, exc)


def foreign(lock_path: Path) -> str | None:
    """What the entry at ``lock_path`` is when it is no lock file of ours (as the last :func:`try_lock` saw it)."""
    return _FOREIGN.get(lock_path)


def describe_holder(lock_path: Path) -> str:
    foreign = _FOREIGN.get(lock_path)
    if foreign is not None:
        return f"not a pdserve lock file: {lock_path} is {foreign}"
    try:
        fd = _open_regular(lock_path.with_suffix(".json"), create=False)
    except (OSError, NotALockFile, LeaseDirUnusable):
        return "an unknown holder"
    try:
        info = json.loads(os.read(fd, 4096))  # bounded: a planted file could be huge
        desc = f"pid {info['pid']}"
        if info.get("purpose"):
            desc += f" ({info['purpose']})"
        return desc + f" since {info.get('since', '?')}"
    except (OSError, ValueError, KeyError, TypeError):
        return "an unknown holder"
    finally:
        os.close(fd)


def want_file(lock_path: Path) -> Path:
    """Where a run says it waits for the lock at ``lock_path`` (``gpu-X.lock`` -> ``gpu-X.want``): the one rule."""
    return lock_path.with_suffix(".want")


def want(path: Path) -> int | None:
    """Say "a run waits for this" on the want file next to a lock (a shared flock, held until the fd is closed).

    A reuse keeper whose kept cluster holds that GPU sees it (:func:`pytest_pdserve.reuse.keeper.is_wanted`) and stops
    the cluster. Returns the fd to close when done waiting, or None (an entry that is not ours: nobody is told).
    """
    try:
        fd = _open_shared(path)
    except (NotALockFile, OSError, LeaseDirUnusable):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)  # the keeper is looking right now (it holds LOCK_EX for a moment): try again next poll
        return None
    return fd


def lock_from_keeper(path: Path, timeout: float) -> int | None:
    """The lock at ``path`` when only a reuse keeper holds it: say it is wanted (:func:`want`) and wait up to
    ``timeout`` seconds for the keeper to stop its kept cluster. None when someone else holds it, or on timeout."""
    if KEPT_FOR_REUSE not in describe_holder(path):
        return None
    deadline = time.monotonic() + timeout
    wanted: int | None = None
    try:
        while time.monotonic() < deadline:
            if wanted is None:
                wanted = want(want_file(path))
            fd = try_lock(path)
            if fd is not None:
                return fd
            time.sleep(0.2)
    finally:
        if wanted is not None:
            os.close(wanted)
    return None


# ------------------------------------------------------------------- the lease directory and held leases


def ensure_lease_dir(lease_dir: Path) -> Path:
    """Create ``lease_dir`` (and missing parents) world-writable and sticky (mode 1777, like /tmp).

    Only directories created here get that mode (:mod:`pytest_pdserve.machine.paths`): an existing directory is
    used as it is, never chmodded.

    :raises PathError: a component is not a directory, or we cannot create files in it.
    """
    try:
        return ensure_dir(Path(lease_dir), LEASE_DIR_MODE)
    except NoRoom as exc:  # full, read-only...: no owner's chmod helps
        raise LeaseDirUnusable(
            f"lease directory: {exc}; free some, or choose another one with --pd-lease-dir / $PDSERVE_LEASE_DIR / "
            "pdserve_lease_dir"
        ) from None
    except PathError as exc:
        raise PathError(
            f"lease directory: {exc}; ask its owner to `chmod 1777` it, or choose another one with "
            "--pd-lease-dir / $PDSERVE_LEASE_DIR / pdserve_lease_dir"
        ) from None


class Lease:
    """Lock files held together (one GPU or port each), released together; the base of GPU and port leases."""

    def __init__(self, paths: list[Path], fds: list[int]) -> None:
        self._paths = paths
        self._fds = fds
        #: Only the process that took the lease releases it; a forked child closes its copies (common/owner.py).
        self.owner = Owner()

    @property
    def fds(self) -> tuple[int, ...]:
        """The lock fds (hand them to ``Watchdog.hold`` so the lease outlives a killed pytest)."""
        return tuple(self._fds)

    @property
    def locks(self) -> tuple[tuple[int, Path], ...]:
        """``(fd, lock file)`` pairs (what a reuse keeper takes over)."""
        return tuple(zip(self._fds, self._paths, strict=True))

    @property
    def held(self) -> bool:
        """Whether the lease is still held."""
        return bool(self._fds)

    def _release_now(self) -> None:
        if not self.owner.here:  # LOCK_UN on a copy would free the parent's lease, unlink would drop its files
            self.disown()
            return
        for path, fd in zip(self._paths, self._fds, strict=True):
            unlock(fd, path)
        self._fds = []

    def disown(self) -> None:
        """Close our fds *without* unlocking or removing the files: the lease stays held by the other holders of
        its fds (the servers, and the reuse keeper they were handed to) and frees when the last of them is gone."""
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []

    def release(self) -> float:
        """Hand the lease back (idempotent); returns seconds spent in a release gate (none here: 0.0)."""
        self._release_now()
        return 0.0

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
