"""Directories the plugin writes to (the lease dir, the log dir): one rule for checking and creating them.

The rule: **never change the mode of a file or directory the plugin did not create.** A directory that
exists is used as it is (or refused); only the components the plugin creates itself get its mode
(``0700`` for logs, ``1777`` for the machine-wide lease dir). ``pdserve_lease_dir = .leases`` must never
make the project root world-writable, and ``--pd-log-dir=$HOME/ci-logs`` must never change ``$HOME``.

:func:`check_dir` runs at configure time (``settings.resolve``) for paths the user gave, so a file where a
directory is expected, or a directory nobody can create files in, is a usage error before any test runs.
:func:`ensure_dir` creates what is missing when a cluster needs the directory. Both raise :class:`PathError`
with a message that says what is wrong with which path; the caller adds where the path came from.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

from pytest_pdserve.common import created
from pytest_pdserve.errors import NoRoom, PathError

__all__ = [
    "DEFAULT_LEASE_DIR",
    "LEASE_DIR_MODE",
    "LOG_DIR_MODE",
    "check_dir",
    "ensure_dir",
    "ensure_private_dir",
    "fs_error_words",
    "private_dir_problem",
]

DEFAULT_LEASE_DIR = Path("/tmp/pytest-pdserve/leases")
"""Machine-wide so concurrent runs of different users see each other. Keep it on a local file system:
flock on NFS is not reliable. (Here, not in leases.py: the settings table loads it without the lease machinery.)"""

LOG_DIR_MODE = 0o700
"""Logs carry prompts and the servers' own start-up lines: private to the user."""

LEASE_DIR_MODE = 0o1777
"""Like /tmp: every user can create lock files, nobody can remove another user's."""


def _missing_components(path: Path) -> tuple[Path, list[Path]]:
    """(nearest existing ancestor, the missing components below it, outermost first).

    :raises PathError: an existing component is not a directory (a file, a fifo, a dangling symlink).
    """
    missing: list[Path] = []
    current = path
    for _ in range(len(path.parts) + 1):  # bounded by the depth of the path
        try:
            st = os.stat(current)  # follows symlinks: a symlink to a directory is a directory
        except (FileNotFoundError, NotADirectoryError) as exc:
            # ENOTDIR: some ancestor is not a directory; walking up finds and names it.
            if isinstance(exc, FileNotFoundError) and os.path.lexists(current):
                # Another process may have created it since our stat (concurrent sessions make the lease dir):
                # look again; only a link whose target is still missing is dangling.
                if os.path.islink(current) and not os.path.exists(current):
                    raise PathError(f"{current} is a dangling symbolic link") from None
                continue
            missing.append(current)
            current = current.parent
            continue
        except OSError as exc:
            raise PathError(f"cannot use {current}: {exc.strerror or exc}") from None
        if not stat.S_ISDIR(st.st_mode):
            what = "a regular file" if stat.S_ISREG(st.st_mode) else "a device, FIFO or socket"
            raise PathError(f"{current} is {what}, not a directory")
        return current, missing[::-1]
    raise PathError(f"{path} has no existing ancestor")  # pragma: no cover - "/" always exists


#: Errors that say why nothing can be created in a directory when it is not a question of permission: the file
#: system's or this process's state, named as such (a full disk is no "not writable by uid 1000"). The lease
#: directory's lock files use the same words (``lockfiles.py``).
FS_ERRORS = {
    errno.ENOSPC: "the file system is out of space or of inodes (`df -h {dir}` and `df -i {dir}` show which)",
    errno.EDQUOT: "your disk quota on that file system is used up (`quota`)",
    errno.EROFS: "the file system is read-only",
    errno.EIO: "the file system reports an I/O error",
    errno.EMFILE: "this process has too many open files (`ulimit -n`)",
    errno.ENFILE: "the system has too many open files",
    errno.ENOMEM: "the kernel is out of memory",
}


def fs_error_words(exc: OSError, directory: Path) -> str | None:
    """``strerror (ENOSPC: what it means here)`` for an error of :data:`FS_ERRORS`, else None."""
    if exc.errno not in FS_ERRORS:
        return None
    return f"{exc.strerror} ({errno.errorcode.get(exc.errno, exc.errno)}: {FS_ERRORS[exc.errno].format(dir=directory)})"


def _not_writable(directory: Path) -> tuple[str, type[PathError]] | None:
    """Why we cannot create a file in ``directory`` (a real probe: ``os.access`` lies for root, ACLs and read-only
    mounts), in words that follow the path, with the error to raise (:class:`NoRoom`: the file system's or this
    process's state, not a permission); None when we can."""
    try:
        fd, name = tempfile.mkstemp(prefix=".pdserve-probe-", dir=directory)
    except OSError as exc:
        words = fs_error_words(exc, directory)
        if words is not None:
            return f"cannot take a new file: {words}", NoRoom
        return f"is not writable by uid {os.geteuid()}", PathError
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return None


def check_dir(path: Path) -> None:
    """Configure-time check: ``path`` is a usable directory, or one we can create. Changes nothing on disk
    except a probe file, created and removed at once, in the nearest existing directory.

    :raises PathError: a component is a file (or not a directory), or nobody lets us create files there
        (:class:`NoRoom`: its file system is full or read-only...).
    """
    existing, missing = _missing_components(Path(path))
    problem = _not_writable(existing)
    if problem is not None:
        words, error = problem
        if missing:
            raise error(f"cannot create {path}: its parent {existing} exists but {words}")
        raise error(f"{path} {words}")


def ensure_dir(path: Path, mode: int, mark: str | None = None) -> Path:
    """Create ``path`` and its missing parents with ``mode`` (only those: existing ones are not touched).

    :param mode: applied (with ``chmod``, the umask does not apply) to each directory created here.
    :param mark: when ``path`` itself is created here, it is marked as pdserve's directory of that kind
        (:mod:`pytest_pdserve.common.created`: what pdserve creates in it may be removed later, nothing else).
    :raises PathError: as :func:`check_dir`, or creating a component failed.
    """
    path = Path(path)
    _, missing = _missing_components(path)
    for component in missing:
        try:
            if mark is not None and component == path:
                created.make_dir(component, mode, mark)
                continue
            component.mkdir(mode=0o700)  # tight until chmod: nobody else gets in meanwhile
        except FileExistsError:
            # Someone else (a concurrent run) created it meanwhile: theirs, so not ours to chmod.
            _missing_components(component)
            continue
        except OSError as exc:
            if (words := fs_error_words(exc, component.parent)) is not None:
                raise NoRoom(f"cannot create directory {component}: {words}") from None
            raise PathError(f"cannot create directory {component}: {exc.strerror or exc}") from None
        try:
            os.chmod(component, mode)
        except OSError as exc:
            raise PathError(f"cannot set mode {mode:o} on {component}, which pdserve just created: {exc}") from None
    problem = _not_writable(path)
    if problem is not None:
        words, error = problem
        raise error(f"{path} {words}")
    return path


def private_dir_problem(path: Path) -> str | None:
    """What makes ``path`` unfit to hold what pdserve trusts (state it acts on, code vLLM loads), in words that
    follow the path in a message, or None: it must be a directory (a symlink to one is fine), belong to us and
    be writable by nobody else. The one home of that rule (the reuse dir, vLLM's cache root)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to us (uid {os.geteuid()})"
    if stat.S_IMODE(st.st_mode) & 0o022:
        return f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def ensure_private_dir(path: Path, what: str) -> Path:
    """Create ``path`` (0700) if missing, then refuse it unless :func:`private_dir_problem` finds nothing, in it
    and in its parent: whoever may write the parent may swap ``path`` for their own directory (a sticky parent,
    like /tmp, lets nobody rename our entry, so it passes).

    :param what: what the directory is, to open the message ("vLLM's cache directory").
    :raises PathError: naming the path, what is wrong with it and what to do.
    """
    path = Path(path)
    advice = "`chmod go-w` it or set PDSERVE_CACHE_DIR to a directory of your own"
    try:
        ensure_dir(path, 0o700)
    except NoRoom as exc:  # full, read-only...: no chmod helps
        raise NoRoom(f"{what} {path}: {exc}; free some, or set PDSERVE_CACHE_DIR to another directory") from None
    except PathError as exc:
        raise PathError(f"{what} {path}: {exc}; {advice}") from None
    problem = private_dir_problem(path)
    if problem is None:
        parent = path.parent
        with contextlib.suppress(OSError):
            mode = os.stat(parent).st_mode
            if stat.S_IMODE(mode) & 0o022 and not mode & stat.S_ISVTX:
                problem = f"is in {parent}, which is writable by others (mode {stat.S_IMODE(mode):04o})"
    if problem is not None:
        raise PathError(
            f"{what} {path} {problem}: another user could put files there that pdserve or vLLM would trust; {advice}"
        )
    return path
