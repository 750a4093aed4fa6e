"""Where ``--pd-reuse`` keeps its state, and whether a run reuses at all. [pytest-free]

The reuse directory (:func:`ensure_reuse_dir`): ours, mode 0700, not writable by others, and pdserve's own
(marked by pdserve, :mod:`pytest_pdserve.common.created`; else new, or empty and not a place where a user keeps files:
never ``.``, ``$HOME``, ``/``, a repository root), since pdserve removes stale state files and old run logs in it,
and there only what it created. A reuse run without --pd-log-dir logs under ``<reuse dir>/logs`` (:func:`run_log_dir`),
pruned like pytest's basetemps (:func:`prune_run_logs`). :func:`reuse_decision` is the CI rule.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pytest_pdserve.common import created
from pytest_pdserve.engines.tiny_model import cache_base
from pytest_pdserve.errors import PathError, PDServeError, ReuseError
from pytest_pdserve.machine.lockfiles import want
from pytest_pdserve.machine.paths import ensure_dir, private_dir_problem
from pytest_pdserve.reuse.keeper import is_wanted
from pytest_pdserve.reuse.state import STATE_SUFFIX, read_state

__all__ = [
    "CI_ENV_VARS",
    "KEEP_RUN_LOGS",
    "REUSE_DIR_MARKER",
    "ReuseOptions",
    "check_reuse_dir",
    "default_reuse_dir",
    "ensure_reuse_dir",
    "prune_run_logs",
    "reuse_decision",
    "run_log_dir",
]

#: Run log directories kept in ``<reuse dir>/logs`` besides those of kept clusters (like pytest's basetemps).
KEEP_RUN_LOGS = 5


@dataclass(frozen=True)
class ReuseOptions:
    """How a reuse run keeps clusters: where their state lives and how long they may stay idle."""

    directory: Path
    ttl: float


#: pytest's own rule for "running on CI" (``_pytest.compat.running_on_ci``): ``CI`` (GitHub Actions, GitLab,
#: Buildkite) or ``BUILD_NUMBER`` (Jenkins, which sets no ``CI``), non-empty. Unlike pytest, ``CI=false`` is not CI.
CI_ENV_VARS = ("CI", "BUILD_NUMBER")


def reuse_decision(reuse: bool, mode: str, environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether this run keeps and reuses clusters, and why, in words (for the report header).

    *reuse* asked for, mode ``local`` is refused on CI (:data:`CI_ENV_VARS`: a CI job must start from fresh
    servers, and nobody would stop what it kept); mode ``force`` keeps anyway.
    """
    if not reuse:
        return False, "off"
    ci = next(
        (f"{var}={value}" for var in CI_ENV_VARS
         if (value := environ.get(var, "").strip()).lower() not in ("", "0", "false", "no")),
        None,
    )  # fmt: skip
    if ci is None:
        return True, "on" if mode != "force" else "force"
    if mode != "force":
        return False, f"off: refused because {ci} (a CI job starts fresh servers; --pd-reuse-mode=force keeps them)"
    return True, f"force ({ci} is set)"


def default_reuse_dir() -> Path:
    """``${PDSERVE_CACHE_DIR:-~/.cache/pytest-pdserve}/reuse``."""
    return cache_base() / "reuse"


#: The marker of the reuse directory before pdserve's ownership rule (:mod:`pytest_pdserve.common.created`): a
#: directory that carries it with this text was pdserve's reuse dir, and is taken over (marked) as it is, unless
#: it is one of the directories that are never a reuse dir (:func:`_never_a_reuse_dir`). Nothing in it becomes
#: pdserve's by that: what pdserve did not record creating is never removed.
REUSE_DIR_MARKER = ".pytest-pdserve-reuse"
_LEGACY_MARKER_TEXT = b"pytest-pdserve --pd-reuse directory: kept clusters' state and logs (see `pdserve ls`).\n"
#: Entries that do not make a directory "someone else's": check_dir's writable probe (created, removed at once).
_TRANSIENT = (".pdserve-probe-",)
#: What a repository root holds: such a directory is a project's, never a reuse dir.
_REPOSITORY_MARKS = (".git", ".hg", ".svn", ".bzr", ".jj", "_darcs", ".pijul", ".fslckout")


def _legacy_marked(path: Path) -> bool:
    try:
        fd = os.open(path / REUSE_DIR_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and os.read(fd, 4096) == _LEGACY_MARKER_TEXT
    except OSError:
        return False
    finally:
        os.close(fd)


def _never_a_reuse_dir(path: Path) -> str | None:
    """Why ``path`` can never be a reuse directory, whatever it holds now, or None: the file system root, the home
    directory or a parent of it, the current directory or a parent of it, a repository root. Such a directory is
    a place where a user keeps files (an empty one today is a full one tomorrow)."""
    real = os.path.realpath(path)
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:
        cwd = None
    home = os.path.realpath(os.path.expanduser("~"))
    if real == os.path.sep:
        return "is the root directory"
    if real == home:
        return "is your home directory"
    if cwd is not None and real == cwd:
        return "is the current directory"
    if cwd is not None and cwd.startswith(real.rstrip(os.path.sep) + os.path.sep):
        return f"is a parent of the current directory ({cwd})"
    if home.startswith(real.rstrip(os.path.sep) + os.path.sep):
        return f"is a parent of your home directory ({home})"
    mark = next((m for m in _REPOSITORY_MARKS if os.path.lexists(os.path.join(real, m))), None)
    if mark is not None:
        return f"is a repository root (it holds {mark})"
    return None


def check_reuse_dir(path: Path) -> None:
    """Refuse a reuse directory that is not a directory of ours, that others may write, or that is not pdserve's
    own. Changes nothing (``pdserve ls`` uses it too).

    pdserve's own: marked by pdserve (:mod:`pytest_pdserve.common.created`: it created it, or took it over empty), or
    else empty (or marked before that rule, :data:`REUSE_DIR_MARKER`) and not a place where a user keeps files
    (:func:`_never_a_reuse_dir`: ``.``, ``$HOME``, ``/``, a repository root...).

    :raises ReuseError: naming the path and what is wrong with it.
    """
    problem = private_dir_problem(path)
    if problem is not None and problem.startswith("is writable by others"):
        problem += ": anyone could plant a kept cluster there; `chmod go-w` it or choose another with --pd-reuse-dir"
    if problem is not None:
        raise ReuseError(f"reuse directory {path} {problem}")
    if created.manifest(path, created.REUSE) is not None:
        return
    never = _never_a_reuse_dir(path)
    if never is not None:
        raise ReuseError(
            f"reuse directory {path} {never}: a reuse directory is pdserve's own, never a directory where you keep "
            f"files; name a new one, e.g. {default_reuse_dir()} (the default)"
        )
    if _legacy_marked(path):
        return
    try:
        with os.scandir(path) as entries:
            foreign = [e.name for e in entries if not e.name.startswith(_TRANSIENT)][:3]
    except OSError as exc:
        raise ReuseError(f"reuse directory {path}: {exc.strerror or exc}") from None
    if (
        foreign and created.manifest(path, created.REUSE) is None
    ):  # looked again: a concurrent run may have just made it ours
        bad_marker = created.marker_problem(path, created.REUSE)
        if bad_marker is not None:
            raise ReuseError(f"reuse directory {path} is not pdserve's: {bad_marker}; name a new directory")
        raise ReuseError(
            f"reuse directory {path} holds files pdserve did not put there ({', '.join(sorted(foreign))}, ...): "
            "pdserve removes stale state files and old logs in it, so it must be a directory of its own (a new or "
            f"empty one, e.g. {path / 'pdserve-reuse'})"
        )


def ensure_reuse_dir(path: Path) -> Path:
    """Create the reuse directory (0700, marked as pdserve's) if missing, check it (:func:`check_reuse_dir`) and
    mark an empty (or formerly marked) one as pdserve's. Returns it absolute: the run keeps it, and a test that
    changes the working directory (``os.chdir``, ``monkeypatch.chdir``) must not move a relative one
    (``PDSERVE_CACHE_DIR=.cache``) to an unchecked place where ``pdserve ls`` never finds what was kept.

    :raises ReuseError: naming the path and what is wrong with it.
    """
    path = Path(os.path.abspath(path))
    try:
        ensure_dir(path, 0o700, mark=created.REUSE)
    except PDServeError as exc:
        raise ReuseError(f"reuse directory {path}: {exc}") from None
    check_reuse_dir(path)
    if created.manifest(path, created.REUSE) is None and not created.adopt_dir(
        path, created.REUSE, empty_only=not _legacy_marked(path)
    ):
        raise ReuseError(
            f"reuse directory {path}: cannot mark it as pdserve's ({created.MARKER}): it changed meanwhile, or the "
            "file system refused the file"
        )
    return path


#: In a run's log directory: the run holds a shared flock on it while it lives (`lockfiles.want`), so that
#: another run's :func:`prune_run_logs` leaves it alone however old it is (a long suite in another terminal).
_RUN_ALIVE = ".pdserve-run"
_held_run_dirs: list[int] = []  # those fds, open until this process exits (the kernel then drops the locks)


def run_log_dir(reuse_dir: Path) -> Path:
    """Create this run's log directory under ``<reuse_dir>/logs`` (a reuse run without --pd-log-dir), a new one of
    its own (:func:`pytest_pdserve.common.created.make_unique_dir`), and mark it as in use while this process lives."""
    logs = ensure_dir(reuse_dir / "logs", 0o700)
    try:
        path = created.make_unique_dir(logs, created.run_stem(), 0o700, created.RUN_LOGS)
    except OSError as exc:
        raise PathError(f"cannot create a run log directory in {logs}: {exc.strerror or exc}") from None
    fd = want(path / _RUN_ALIVE)
    if fd is not None:
        _held_run_dirs.append(fd)
        created.record(path / _RUN_ALIVE, os.fstat(fd).st_ino)  # created just now, by us: removed with the directory
    return path


def prune_run_logs(reuse_dir: Path, keep: int = KEEP_RUN_LOGS, min_age: float = 600.0) -> tuple[list[Path], list[str]]:
    """Remove old run log directories under ``<reuse_dir>/logs``: of those pdserve made (their marker,
    :mod:`pytest_pdserve.common.created`), all but the newest ``keep``, never one a kept cluster still writes to, nor
    one younger than ``min_age`` seconds or whose run still goes (a concurrent run's, :data:`_RUN_ALIVE`), and in
    them only what pdserve created. Returns what went, and what was left alone (entries pdserve did not create)."""
    logs = reuse_dir / "logs"
    try:
        with os.scandir(logs) as entries:
            found = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
    except OSError:
        return [], []
    runs, unknown = [], []
    for name, is_dir in sorted(found):
        if is_dir and created.manifest(logs / name, created.RUN_LOGS) is not None:
            runs.append(logs / name)
        else:
            unknown.append(f"{logs / name} (pdserve did not create it)")
    used = set()
    for state_path in reuse_dir.glob(f"*{STATE_SUFFIX}"):
        with contextlib.suppress(OSError, ValueError):
            for server in read_state(state_path).servers:
                if server.log_path is not None:
                    used.add(Path(server.log_path).resolve())
    removed, left = [], []
    now = time.time()
    for run in runs[: max(0, len(runs) - keep)]:
        with contextlib.suppress(OSError):
            if now - run.stat().st_mtime < min_age or any(run.resolve() in u.parents for u in used):
                continue
            if is_wanted(str(run / _RUN_ALIVE)):  # its run still goes
                continue
            gone = created.remove_tree(run, created.RUN_LOGS)
            if gone:
                left += gone
            else:
                removed.append(run)
    return removed, unknown + left
