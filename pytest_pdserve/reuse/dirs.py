"""Where ``--pd-reuse`` keeps its state, and whether a run reuses at all. [pytest-free]

The reuse directory (:func:`ensure_reuse_dir`): ours, mode 0700, not writable by others, and pdserve's own
(:data:`REUSE_DIR_MARKER`, or new or empty), since pdserve removes stale state files and old run logs in it. A reuse
run without --pd-log-dir logs under ``<reuse dir>/logs`` (:func:`run_log_dir`), pruned like pytest's basetemps
(:func:`prune_run_logs`). :func:`reuse_decision` is the CI rule.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pytest_pdserve.common.logfile import write_replace
from pytest_pdserve.engines.tiny_model import cache_base
from pytest_pdserve.errors import PDServeError, ReuseError
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


#: The file that makes a directory pdserve's reuse dir. pdserve removes stale state files (``*.json``) and old
#: run logs (``logs/*``) there, so it uses only a directory that is new, empty, or already carries this file:
#: ``--pd-reuse-dir=.`` or ``$HOME`` must never cost a user's ``package.json`` or ``logs/``.
REUSE_DIR_MARKER = ".pytest-pdserve-reuse"
_MARKER_TEXT = b"pytest-pdserve --pd-reuse directory: kept clusters' state and logs (see `pdserve ls`).\n"
#: Entries that do not make a directory "someone else's": the marker itself, and check_dir's writable probe.
_OWN_ENTRIES = (REUSE_DIR_MARKER, ".pdserve-probe-")


def _marked(path: Path) -> bool:
    try:
        st = os.lstat(path / REUSE_DIR_MARKER)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def check_reuse_dir(path: Path) -> None:
    """Refuse a reuse directory that is not a directory of ours, that others may write, or that is not pdserve's
    own (neither marked with :data:`REUSE_DIR_MARKER` nor empty). Changes nothing (``pdserve ls`` uses it too).

    :raises ReuseError: naming the path and what is wrong with it.
    """
    problem = private_dir_problem(path)
    if problem is not None and problem.startswith("is writable by others"):
        problem += ": anyone could plant a kept cluster there; `chmod go-w` it or choose another with --pd-reuse-dir"
    if problem is not None:
        raise ReuseError(f"reuse directory {path} {problem}")
    if _marked(path):
        return
    try:
        with os.scandir(path) as entries:
            foreign = [e.name for e in entries if not e.name.startswith(_OWN_ENTRIES)][:3]
    except OSError as exc:
        raise ReuseError(f"reuse directory {path}: {exc.strerror or exc}") from None
    if foreign and not _marked(path):  # looked again: a concurrent run may have just made it ours
        raise ReuseError(
            f"reuse directory {path} holds files pdserve did not put there ({', '.join(sorted(foreign))}, ...): "
            "pdserve removes stale state files and old logs in it, so it must be a directory of its own (a new or "
            f"empty one, e.g. {path / 'pdserve-reuse'})"
        )


def ensure_reuse_dir(path: Path) -> Path:
    """Create the reuse directory (0700) if missing, check it (:func:`check_reuse_dir`) and mark it as pdserve's.

    :raises ReuseError: naming the path and what is wrong with it.
    """
    try:
        ensure_dir(path, 0o700)
    except PDServeError as exc:
        raise ReuseError(f"reuse directory {path}: {exc}") from None
    check_reuse_dir(path)
    if not _marked(path):
        try:
            write_replace(path / REUSE_DIR_MARKER, _MARKER_TEXT)
        except OSError as exc:
            raise ReuseError(f"reuse directory {path}: cannot create {REUSE_DIR_MARKER}: {exc.strerror}") from None
    return path


#: In a run's log directory: the run holds a shared flock on it while it lives (`lockfiles.want`), so that
#: another run's :func:`prune_run_logs` leaves it alone however old it is (a long suite in another terminal).
_RUN_ALIVE = ".pdserve-run"
_held_run_dirs: list[int] = []  # those fds, open until this process exits (the kernel then drops the locks)


def run_log_dir(reuse_dir: Path) -> Path:
    """Create this run's log directory under ``<reuse_dir>/logs`` (a reuse run without --pd-log-dir), named
    ``<time>-<pid>``, and mark it as in use for as long as this process lives."""
    path = ensure_dir(reuse_dir / "logs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}", 0o700)
    fd = want(path / _RUN_ALIVE)
    if fd is not None:
        _held_run_dirs.append(fd)
    return path


def prune_run_logs(reuse_dir: Path, keep: int = KEEP_RUN_LOGS, min_age: float = 600.0) -> list[Path]:
    """Remove old run log directories under ``<reuse_dir>/logs``: all but the newest ``keep``, never one a kept
    cluster still writes to, nor one younger than ``min_age`` seconds or whose run still goes (a concurrent
    run's, :data:`_RUN_ALIVE`). Returns what went."""
    logs = reuse_dir / "logs"
    try:
        runs = sorted((p for p in logs.iterdir() if p.is_dir() and not p.is_symlink()), key=lambda p: p.name)
    except OSError:
        return []
    used = set()
    for state_path in reuse_dir.glob(f"*{STATE_SUFFIX}"):
        with contextlib.suppress(OSError, ValueError):
            for server in read_state(state_path).servers:
                if server.log_path is not None:
                    used.add(Path(server.log_path).resolve())
    removed = []
    now = time.time()
    for run in runs[: max(0, len(runs) - keep)]:
        with contextlib.suppress(OSError):
            if now - run.stat().st_mtime < min_age or any(run.resolve() in u.parents for u in used):
                continue
            if is_wanted(str(run / _RUN_ALIVE)):  # its run still goes
                continue
            shutil.rmtree(run)
            removed.append(run)
    return removed
