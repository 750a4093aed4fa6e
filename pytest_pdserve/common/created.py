"""What pdserve may remove: only what it can prove it created. [pytest-free, stdlib only: the keeper, the watchdog
and the guard import it under ``python -I -S``]

The rule, for every removal, rename over and truncation the plugin, the keeper and ``pdserve ls|stop`` make:
**an entry is pdserve's only when pdserve can prove that it created it, and a name is no proof.**

* A **directory** is pdserve's when it holds :data:`MARKER`, which pdserve writes only into a directory it has just
  created itself (an ``mkdir`` of its own that succeeded: :func:`make_dir`, :func:`make_unique_dir`,
  ``paths.ensure_dir(mark=...)``) or taken over empty (:func:`adopt_dir`). The marker's first line binds it to
  that directory: its kind, its inode number and owner (our uid), and a random token. A marker copied or moved into
  another directory proves nothing, nor does one that is a link, has other hard links or is not ours.
* A **file** is pdserve's when the marker of the directory holding it lists its name with its inode number:
  :func:`record` appends that line when pdserve has created the file (``O_EXCL``; ``logfile.open_append`` and
  ``logfile.write_replace`` call it), :func:`remove_file` a tombstone when it removes it. A process that created
  a file itself may prove it by the inode it got (``expect_ino``).
* **Everything else is left alone**: an unknown entry in a directory pdserve owns (a user's ``package.json``, an
  old ``logs/2024-*``, a link someone planted) is never removed, renamed over or truncated; the callers name what
  they left, once per call.

Removal goes by file descriptor (:func:`remove_tree`): the directory is opened without following a link, its
marker checked against the open directory, and every entry removed relative to it, so a directory swapped for
another one (or for a link) between the check and the removal is not the one emptied. Only the owner of a
directory (for pdserve's own, private ones: our uid) can swap an entry inside it between its check and its unlink.

The machine-wide lease directory is the one place where others create what pdserve removes (a lock file is
created by whichever run first needs it), so its entries are proven by identity and content instead, with
:func:`remove_if`: a lock file only while we hold its lock through that very inode and it is empty (pdserve never
writes into one), a holder file only when it holds a holder record (``machine/lockfiles.py``). Two files the
user names are proven by content beside their writers: the ``--pd-export-env`` file by its first line
(``glue/export_env.foreign_file``, asked again right before the write), a tiny model's directory by its build marker
(``engines/tiny_model.py``, a script that imports nothing of this package: a directory without it is never removed).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "MARKER",
    "RPC",
    "RUN_LOGS",
    "REUSE",
    "Manifest",
    "adopt_dir",
    "make_dir",
    "make_unique_dir",
    "marker_problem",
    "manifest",
    "record",
    "remove_file",
    "remove_if",
    "remove_tree",
    "replace_file",
    "run_stem",
]

#: The marker file of a directory pdserve created (its first line binds it to that directory; then the manifest).
MARKER = ".pdserve-created"
#: Kinds of directory (a marker proves its directory only for the kind asked).
REUSE = "reuse"  # --pd-reuse's directory: kept clusters' state files, the keeper's logs
RUN_LOGS = "run-logs"  # one run's server logs (under --pd-log-dir, or <reuse dir>/logs)
RPC = "rpc"  # one vLLM server's IPC sockets (running/rpc_dirs.py)

_MAX_MARKER = 4 << 20  # a manifest grows by a line or two per file pdserve creates; read no more than this
_MAX_DEPTH = 8  # remove_tree: pdserve nests its directories at most two deep
_NOTE = "pytest-pdserve made this directory; it removes only the entries listed here, which it created"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@dataclass(frozen=True)
class Manifest:
    """What a valid marker says: the directory's kind and the files pdserve created in it (name -> inode)."""

    kind: str
    token: str
    files: dict[str, int] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ the marker


def _open_dir(path: Path, *, follow: bool) -> int:
    """An fd of the directory ``path``; ``follow=False``: the last component must not be a link (ELOOP/ENOTDIR)."""
    return os.open(path, _DIR_FLAGS | (0 if follow else os.O_NOFOLLOW))


def _read_marker(dir_fd: int) -> tuple[Manifest, int] | None:
    """The directory's manifest and the marker's inode, or None when the marker is missing or proves nothing."""
    try:
        fd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st, here = os.fstat(fd), os.fstat(dir_fd)
        me = os.geteuid()
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != me or here.st_uid != me:
            return None
        raw = b""
        while len(raw) <= _MAX_MARKER and (chunk := os.read(fd, 1 << 16)):
            raw += chunk
    except OSError:
        return None
    finally:
        os.close(fd)
    lines = raw[:_MAX_MARKER].split(b"\n")
    try:
        head = json.loads(lines[0])
        if head.get("ino") != here.st_ino or head.get("uid") != me or not isinstance(head.get("kind"), str):
            return None  # copied or moved here from another directory: proves nothing
        found = Manifest(head["kind"], str(head.get("token", "")))
    except (ValueError, AttributeError):
        return None
    for line in lines[1:]:  # the manifest; a torn last line (a full disk) is skipped
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            entry = json.loads(line)
            name, ino = entry.get("+", entry.get("-")), int(entry["ino"])
            if not isinstance(name, str):
                continue
            if "+" in entry:
                found.files[name] = ino
            elif found.files.get(name) == ino:
                del found.files[name]
    return found, st.st_ino


def _write_marker(dir_fd: int, kind: str) -> None:
    """Write a new marker bound to the open directory (``O_EXCL``: :raises FileExistsError: it has one)."""
    here = os.fstat(dir_fd)
    head = {"note": _NOTE, "kind": kind, "ino": here.st_ino, "uid": os.geteuid(), "token": os.urandom(8).hex()}
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(MARKER, flags, 0o600, dir_fd=dir_fd)
    try:
        os.write(fd, json.dumps(head).encode() + b"\n")
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(MARKER, dir_fd=dir_fd)
        raise
    finally:
        os.close(fd)


def _append(dir_fd: int, marker_ino: int, line: dict[str, object]) -> bool:
    """Append one manifest line to the marker we validated (same inode), never through a link."""
    try:
        fd = os.open(MARKER, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_ino != marker_ino:
            return False
        # One write of a short line with O_APPEND: concurrent writers (runs, the keeper) never interleave it.
        os.write(fd, json.dumps(line).encode(errors="surrogateescape") + b"\n")
        return True
    except (OSError, UnicodeError):
        return False
    finally:
        os.close(fd)


@contextlib.contextmanager
def _opened(path: Path, *, follow: bool = True) -> Iterator[int | None]:
    try:
        fd = _open_dir(path, follow=follow)
    except OSError:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def manifest(path: Path, kind: str | None = None) -> Manifest | None:
    """The manifest of the directory ``path`` (a link to a directory is followed: the user named it) when
    its marker proves that pdserve created it (for ``kind``, when given), else None."""
    with _opened(Path(path)) as fd:
        got = _read_marker(fd) if fd is not None else None
    if got is None or (kind is not None and got[0].kind != kind):
        return None
    return got[0]


def marker_problem(path: Path, kind: str) -> str | None:
    """Why the :data:`MARKER` in ``path`` proves nothing, in words (None: there is none, or it proves ``kind``)."""
    marker = Path(path) / MARKER
    try:
        st = os.lstat(marker)
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"{marker} is a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return f"{marker} is not a regular file"
    if st.st_uid != os.geteuid():
        return f"{marker} belongs to uid {st.st_uid}"
    if st.st_nlink != 1:
        return f"{marker} has {st.st_nlink} hard links"
    got = manifest(path)
    if got is None:
        return f"{marker} was written for another directory (copied or restored from elsewhere?)"
    if got.kind != kind:
        return f"{marker} marks a pdserve directory of another kind ({got.kind})"
    return None


# ------------------------------------------------------------------------------------ making directories


def make_dir(path: Path, mode: int, kind: str) -> Path:
    """Create the directory ``path`` (its parent must exist) and mark it as pdserve's ``kind``.

    :param mode: its mode (applied with ``chmod``: the umask does not apply).
    :raises FileExistsError: something is there already: not ours, whatever it is.
    :raises OSError: it could not be made or marked (then nothing is left behind).
    """
    path = Path(path)
    os.mkdir(path, 0o700)  # tight until marked and chmodded
    try:
        fd = _open_dir(path, follow=False)
        try:
            _write_marker(fd, kind)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.rmdir(path)  # ours, and empty (a failed marker write removes itself)
        raise
    return path


def run_stem() -> str:
    """``<date>-<time>-<pid>``: how a run's own directory starts, for people to read (:func:`make_unique_dir` adds
    what makes it unique)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def make_unique_dir(parent: Path, stem: str, mode: int, kind: str, attempts: int = 32) -> Path:
    """A new directory ``<parent>/<stem>-<8 random hex digits>`` of this process's own (:func:`make_dir`).

    Unique by creation, not by its name's parts: a pid and a time are the same in two containers (pytest as PID 1
    in two PID namespaces, one second), so the name carries a random part and ``mkdir`` decides; a name someone
    else holds is never used, another one is drawn.

    :raises OSError: the parent refused it, or ``attempts`` names were all taken.
    """
    for _ in range(attempts):
        try:
            return make_dir(Path(parent) / f"{stem}-{os.urandom(4).hex()}", mode, kind)
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, f"no free name {stem}-XXXXXXXX after {attempts} tries", str(parent))


#: Entries that do not make a directory someone else's: paths.check_dir's probe file, removed at once.
_TRANSIENT = (".pdserve-probe-",)


def adopt_dir(path: Path, kind: str, *, empty_only: bool = True) -> bool:
    """Mark the existing directory ``path`` (a link to one is followed: the user named it) as pdserve's ``kind``,
    when it is empty (``empty_only=False``: whatever it holds, for a directory pdserve marked under an older rule);
    True when it is pdserve's ``kind`` afterwards (marked now, or already).

    The caller decides which directories may be taken over at all (``reuse/dirs.py``: never ``.``, ``$HOME``,
    a repository root...). Taking one over makes nothing in it pdserve's, then or later: only what pdserve records
    creating (the manifest) ever is.
    """
    with _opened(Path(path)) as fd:
        if fd is None:
            return False
        got = _read_marker(fd)
        if got is not None:
            return got[0].kind == kind
        try:
            with os.scandir(fd) as entries:
                if empty_only and any(not e.name.startswith(_TRANSIENT) for e in entries if e.name != MARKER):
                    return False
            _write_marker(fd, kind)
        except FileExistsError:  # a concurrent run marked it first
            pass
        except OSError:
            return False
        got = _read_marker(fd)
        return got is not None and got[0].kind == kind


# ---------------------------------------------------------------------------------------------- files


def record(path: Path, ino: int) -> bool:
    """Note in the manifest of ``path``'s directory that pdserve created the file ``path`` (inode ``ino``).

    Called right after an ``O_EXCL`` creation or an atomic rename of a new file into place. A directory that is not
    pdserve's has no manifest: nothing is noted (False), and nothing there will ever be removed by pdserve.
    """
    path = Path(path)
    with _opened(path.parent) as fd:
        if fd is None:
            return False
        got = _read_marker(fd)
        return got is not None and _append(fd, got[1], {"+": path.name, "ino": ino})


def remove_if(path: Path, proof: Callable[[int, os.stat_result], bool]) -> bool:
    """Remove the regular file ``path`` (never a link, a FIFO, a directory) when ``proof(fd, stat)`` holds for
    what is there now (opened read-only, not followed). True when it was removed.

    For entries proven by identity and content rather than by a manifest (the lease directory's)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or not proof(fd, st):
            return False
        if os.stat(path, follow_symlinks=False).st_ino != st.st_ino:
            return False  # swapped since we opened it
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_file(path: Path, expect_ino: int | None = None) -> bool:
    """Remove the file ``path`` if pdserve created it: its directory's manifest lists it with the inode it has now
    (or this process created it itself and knows its inode: ``expect_ino``). True when it was removed, False when it
    is not proven pdserve's (unknown, replaced, a link, a directory), or gone: then it is left alone.

    :raises OSError: it is pdserve's, and the file system refused to remove it (read-only...): said as it is.
    """
    path = Path(path)
    with _opened(path.parent) as fd:
        if fd is None:
            return False
        got = _read_marker(fd)
        try:
            st = os.stat(path.name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return False
        listed = got is not None and got[0].files.get(path.name) == st.st_ino
        if not stat.S_ISREG(st.st_mode) or not (listed or (expect_ino is not None and st.st_ino == expect_ino)):
            return False
        try:
            os.unlink(path.name, dir_fd=fd)
        except FileNotFoundError:
            return False
        if listed and got is not None:
            _append(fd, got[1], {"-": path.name, "ino": st.st_ino})
        return True


def replace_file(src: Path, dst: Path) -> bool:
    """Rename ``src`` over ``dst`` in one directory pdserve owns (a log's rotation) when pdserve created ``src``
    and ``dst`` is missing or pdserve created it too; False (nothing done) otherwise."""
    src, dst = Path(src), Path(dst)
    if src.parent != dst.parent:
        raise ValueError("replace_file renames within one directory")
    with _opened(src.parent) as fd:
        got = _read_marker(fd) if fd is not None else None
        if fd is None or got is None:
            return False
        files = got[0].files
        try:
            st = os.stat(src.name, dir_fd=fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or files.get(src.name) != st.st_ino:
                return False
            try:
                old = os.stat(dst.name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                old = None
            if old is not None and (not stat.S_ISREG(old.st_mode) or files.get(dst.name) != old.st_ino):
                return False
            os.replace(src.name, dst.name, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError:
            return False
        _append(fd, got[1], {"-": src.name, "ino": st.st_ino})
        _append(fd, got[1], {"+": dst.name, "ino": st.st_ino})
        return True


# ------------------------------------------------------------------------------------------- directories


def remove_tree(path: Path, kind: str, *, sockets: bool = False) -> list[str]:
    """Remove the directory ``path`` when pdserve created it (its marker, for ``kind``), and in it only what pdserve
    created: the files its manifest lists (with the inode they have now), its own marked subdirectories, and with
    ``sockets`` Unix sockets (a server's IPC endpoints: they hold no data). Returns what was left, each as
    ``"path (why)"``; empty when the directory is gone. A directory it cannot prove is left whole.

    The last component of ``path`` is not followed (a link where pdserve's directory was is left alone).
    """
    path = Path(path)
    with _opened(path.parent) as parent:
        if parent is None:
            return [f"{path} (its parent cannot be opened)"]
        return _remove_at(parent, path.name, path, kind, sockets, 0)


def _remove_at(parent_fd: int, name: str, where: Path, kind: str, sockets: bool, depth: int) -> list[str]:
    try:
        fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
    except FileNotFoundError:
        return []
    except OSError as exc:
        return [f"{where} ({'a symbolic link' if exc.errno == errno.ELOOP else exc.strerror or exc})"]
    left: list[str] = []
    try:
        got = _read_marker(fd)
        if got is None or got[0].kind != kind or depth > _MAX_DEPTH:
            return [f"{where} (pdserve did not create it)"]
        files = got[0].files
        with os.scandir(fd) as entries:
            names = [e.name for e in entries if e.name != MARKER]
        for entry in names:
            try:
                st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                left += _remove_at(fd, entry, where / entry, kind, sockets, depth + 1)
            elif (stat.S_ISREG(st.st_mode) and files.get(entry) == st.st_ino) or (
                sockets and stat.S_ISSOCK(st.st_mode)
            ):
                try:
                    os.unlink(entry, dir_fd=fd)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    left.append(f"{where / entry} ({exc.strerror or exc})")
            else:
                left.append(f"{where / entry} (pdserve did not create it)")
        if left:
            return left
        try:
            os.unlink(MARKER, dir_fd=fd)
        except OSError as exc:
            return [f"{where} ({exc.strerror or exc})"]
    except OSError as exc:
        return [*left, f"{where} ({exc.strerror or exc})"]
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=parent_fd)  # fails if anything appeared meanwhile: then it stays
    except FileNotFoundError:
        pass
    except OSError as exc:
        return [f"{where} ({exc.strerror or exc})"]
    return []
