"""Our process trees: find them by run token and ppid chain, and kill them (SIGTERM, grace, SIGKILL, sweep).

One home for the rules every killer follows (``ServerProcess.stop``, the watchdog, the per-server guard):

* processes are found by an env token (``PDSERVE_RUN_TOKEN`` for a whole pytest process,
  ``PDSERVE_SERVER_TOKEN`` for one server) and by a ppid-tree snapshot, **never by name** (that would kill
  other users' and other runs' servers); ``setsid`` does not change the environment, so descendants that
  left the process group are still found;
* a pid is only signalled while its start time is the one recorded (PID reuse);
* our own process group, init's and our own pid are never signalled.

Standard library only (Linux ``/proc``), so the watchdog and the guard can import it under ``python -I``.
Every helper is best effort: processes vanish between ``listdir`` and ``open``.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pytest_pdserve.common.procstat import ProcInfo, read_stat

__all__ = [
    "RUN_TOKEN_ENV",
    "SERVER_TOKEN_ENV",
    "ProcInfo",
    "TerminateResult",
    "descendants",
    "listens_on",
    "pids_with_env",
    "proc_table",
    "read_stat",
    "terminate",
    "token_pids",
    "tree_pids",
]

RUN_TOKEN_ENV = "PDSERVE_RUN_TOKEN"
"""Env var carried by every process we start (and inherited by its descendants); the watchdog sweeps it."""

SERVER_TOKEN_ENV = "PDSERVE_SERVER_TOKEN"
"""Env var unique to one server; ``ServerProcess.stop`` and the server's guard sweep only its escapees by it."""

_POLL = 0.02  # seconds between liveness checks while waiting for processes to exit
# A scan of /proc costs CPU, more with more processes: polling it while a server stops cost a good share of a
# simulator test's inner session (docs/architecture.md, "Process").
# The waits therefore sleep on pidfds of the processes already known and scan only to find the rest.


_TCP_LISTEN = "0A"  # the state column of /proc/net/tcp{,6}


def listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` itself holds a listening TCP socket on ``port`` (IPv4 or IPv6): the socket's inode,
    from /proc/net/tcp and /proc/net/tcp6, is among the ``socket:[inode]`` links of /proc/PID/fd. False when
    anything cannot be read (another user's process, a vanished one): unproven is not ours."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    wanted = f"{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii", errors="replace") as fh:
                lines = fh.read().splitlines()[1:]
        except OSError:
            continue  # no IPv6 in this kernel
        for line in lines:
            fields = line.split()  # sl local_address rem_address st ... uid timeout inode
            if (
                len(fields) > 9
                and fields[3] == _TCP_LISTEN
                and fields[1].endswith(f":{wanted}")
                and fields[9] in inodes
            ):
                return True
    return False


def unread_bytes(port: int) -> int:
    """Bytes received on connections to local TCP ``port`` (IPv4 or IPv6) that nobody has read yet: the receive
    queues of /proc/net/tcp{,6}. A paused server (SIGSTOP) holding a request shows it here; 0 where unreadable."""
    wanted = f":{port:04X}"
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii", errors="replace") as fh:
                lines = fh.read().splitlines()[1:]
        except OSError:
            continue  # no IPv6 in this kernel
        for line in lines:
            fields = line.split()  # sl local_address rem_address st tx_queue:rx_queue ...
            if len(fields) > 4 and fields[3] != _TCP_LISTEN and fields[1].endswith(wanted):
                with contextlib.suppress(ValueError):
                    total += int(fields[4].partition(":")[2], 16)
    return total


def pid_namespace() -> str | None:
    """This process's PID namespace (``pid:[4026531836]``), or None where it cannot be read. A pid means something
    only in its namespace: two containers sharing a directory see each other's pids as nobody, or as someone else."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def alive_as(pid: int, starttime: int) -> bool:
    """Whether ``pid`` still runs *and* is the process that had ``starttime`` (not a zombie, not a reused pid)."""
    info = read_stat(pid)
    return info is not None and info.live and info.starttime == starttime


def proc_table() -> dict[int, ProcInfo]:
    """Snapshot every process visible in ``/proc``."""
    table: dict[int, ProcInfo] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = read_stat(int(entry))
            if info is not None:
                table[info.pid] = info
    return table


def pids_with_env(name: str, value: str, table: Mapping[int, ProcInfo] | None = None) -> list[int]:
    """Live pids whose initial environment has ``name=value`` (only our own uid's are readable).

    This is how descendants that left the process group are found: ``setsid`` does not change the
    environment. Never match by process name: that kills other users' and other runs' servers.
    """
    needle = b"\0" + f"{name}={value}".encode() + b"\0"
    me = os.getpid()
    found = []
    for pid, info in (table if table is not None else proc_table()).items():
        if pid == me or not info.live:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                environ = fh.read()
        except OSError:
            continue
        if needle in b"\0" + environ + b"\0":
            found.append(pid)
    return found


def descendants(pid: int, table: Mapping[int, ProcInfo]) -> dict[int, int]:
    """All live descendants of ``pid`` by ppid chain, as ``{pid: starttime}`` (for reuse checks)."""
    children: dict[int, list[int]] = {}
    for info in table.values():
        children.setdefault(info.ppid, []).append(info.pid)
    out: dict[int, int] = {}
    stack = list(children.get(pid, ()))
    while stack and len(out) < 100_000:  # bounded even if /proc is inconsistent
        child = stack.pop()
        if child in out:
            continue
        row = table.get(child)
        if row is not None and row.live:
            out[child] = row.starttime
        stack.extend(children.get(child, ()))
    return out


def _safe_group(pgid: int) -> bool:
    # Never signal our own group (that is pytest's) or init's; a server that somehow shares
    # our group must not take pytest down with it.
    return pgid > 1 and pgid != os.getpgrp()


def _signal_all(
    groups: Iterable[int], pids: Mapping[int, int], sig: int, table: Mapping[int, ProcInfo] | None = None
) -> None:
    groups = {g for g in groups if _safe_group(g)}
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    table = table if table is not None else proc_table()
    for pid, starttime in pids.items():
        info = table.get(pid)
        # Same pid *and* same start time, or it is somebody else's process that reused the pid.
        # Group members already got the signal: a second SIGTERM can turn a graceful shutdown
        # into a forced one (uvicorn and vLLM's engine core treat repeats differently).
        if (
            info is not None
            and info.live
            and info.starttime == starttime
            and info.pgid not in groups
            and pid != os.getpid()
        ):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def signal_server(pid: int, server_token: str, sig: int) -> None:
    """Send ``sig`` to one server's whole tree: its process group (``pid`` leads it), its descendants by ppid chain and
    the processes carrying its ``PDSERVE_SERVER_TOKEN`` that left the group (``ServerProcess.pause``/``resume``)."""
    table = proc_table()
    pids = {**descendants(pid, table), **token_pids([(SERVER_TOKEN_ENV, server_token)], table)}
    _signal_all([pid], pids, sig, table)


def _still_alive(
    groups: Iterable[int], pids: Mapping[int, int], table: Mapping[int, ProcInfo] | None = None
) -> dict[int, int]:
    groups = set(groups)
    table = table if table is not None else proc_table()
    alive: dict[int, int] = {}
    for info in table.values():
        if not info.live:
            continue
        if info.pgid in groups or pids.get(info.pid) == info.starttime:
            alive[info.pid] = info.starttime
    return alive


def token_pids(env: Sequence[tuple[str, str]], table: Mapping[int, ProcInfo] | None = None) -> dict[int, int]:
    """``{pid: starttime}`` of live processes carrying any of the ``(name, value)`` env markers (in ``table``,
    a :func:`proc_table` snapshot, else a fresh one)."""
    if not env:
        return {}
    table = table if table is not None else proc_table()
    out: dict[int, int] = {}
    for name, value in env:
        for pid in pids_with_env(name, value, table):
            out[pid] = table[pid].starttime
    return out


def _await_exit(procs: Mapping[int, int], deadline: float) -> None:
    """Sleep until every process of ``procs`` (``{pid: starttime}``) has exited, or until ``deadline``.

    Each is watched through a pidfd (readable once the process has exited, zombie or reaped), opened and then
    checked against its start time, so a pid reused meanwhile is not waited on. Returns at once where pidfds
    are not available (not Linux 5.3+, or too many open files): the caller's polling scan does the waiting.
    """
    if not procs or not hasattr(os, "pidfd_open"):
        return
    poller = select.poll()
    opened: list[int] = []
    waiting: set[int] = set()
    try:
        for pid, starttime in procs.items():
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue  # gone already (ESRCH), or no pidfds here: the caller's scan decides
            opened.append(fd)
            info = read_stat(pid)  # after the open: the pidfd names this process whatever its pid does later
            if info is not None and info.live and info.starttime == starttime:
                poller.register(fd, select.POLLIN)
                waiting.add(fd)
        for _ in range(len(waiting) + 1000):  # each round ends a wait, or the deadline has come
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                break
            for fd, _event in poller.poll(max(1, int(left * 1000) + 1)):
                poller.unregister(fd)
                waiting.discard(fd)
    finally:
        for fd in opened:
            os.close(fd)


@dataclass(frozen=True)
class TerminateResult:
    """What :func:`terminate` did.

    :param term_seconds: SIGTERM until everything was gone, or until the grace ran out.
    :param killed: whether SIGKILL was needed.
    :param swept: pids signalled that were outside the watched groups (escaped descendants).
    :param remaining: pids still alive at the end (should be empty; non-empty means a D-state process
        or one owned by another user).
    :param total_seconds: the whole operation.
    """

    term_seconds: float
    killed: bool
    swept: tuple[int, ...]
    remaining: tuple[int, ...]
    total_seconds: float


def terminate(
    groups: Iterable[int],
    *,
    env: Sequence[tuple[str, str]] = (),
    extra: Mapping[int, int] | None = None,
    grace: float,
    kill_wait: float = 5.0,
) -> TerminateResult:
    """SIGTERM process groups plus escaped descendants, wait ``grace``, SIGKILL the rest, wait until gone.

    :param groups: process group ids to signal with ``killpg``.
    :param env: ``(name, value)`` env markers; live processes carrying one are signalled too.
    :param extra: more processes as ``{pid: starttime}`` (e.g. a ppid-tree snapshot taken earlier).
    :param grace: seconds between SIGTERM and SIGKILL; 0 means SIGKILL at once.
    :param kill_wait: how long to wait for processes to vanish after SIGKILL.
    """
    t0 = time.monotonic()
    groups = [g for g in set(groups) if _safe_group(g)]
    targets = dict(extra or {})
    table = proc_table()  # one snapshot for finding, signalling and the first wait
    targets.update(token_pids(env, table))
    swept: set[int] = set()
    for pid in targets:
        info = table.get(pid)
        if info is not None and info.pgid not in groups:
            swept.add(pid)

    killed = False
    if grace > 0:
        _signal_all(groups, targets, signal.SIGTERM, table)
        deadline = t0 + grace
        # Sleep on what is known to be alive, then scan for what it may have started meanwhile.
        _await_exit(_still_alive(groups, targets, table), deadline)
        while _still_alive(groups, targets) and time.monotonic() < deadline:
            time.sleep(_POLL)
    term_seconds = time.monotonic() - t0

    alive: dict[int, int] = {}
    deadline = time.monotonic() + kill_wait
    # Each round rescans the env token: a dying process can still spawn (or setsid) a child.
    for _ in range(1000):
        now = proc_table()
        more = token_pids(env, now)
        for pid in more:
            if pid not in targets:
                info = table.get(pid) or now.get(pid)
                if info is not None and info.pgid not in groups:
                    swept.add(pid)
        targets.update(more)
        alive = _still_alive(groups, targets, now)
        if not alive or time.monotonic() >= deadline:
            break
        killed = True
        _signal_all(groups, alive, signal.SIGKILL, now)
        _await_exit(alive, min(deadline, time.monotonic() + 1.0))
    return TerminateResult(
        term_seconds=term_seconds,
        killed=killed,
        swept=tuple(sorted(swept)),
        remaining=tuple(sorted(alive)),
        total_seconds=time.monotonic() - t0,
    )


_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int) -> str | None:
    """Ask the kernel to send ``sig`` when our parent *thread* exits (``PR_SET_PDEATHSIG``).

    Use it only to wake up and look (``os.getppid()``): it fires when the thread that forked us exits,
    which is not the parent's death when that was a helper thread. Returns why it failed, or None.
    """
    import ctypes  # lazy: slow to import; only the watchdog and guards call this

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            return f"prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}"
    except (OSError, AttributeError) as exc:  # not Linux / no libc symbol: the caller still polls
        return f"prctl unavailable: {exc}"
    return None


def isolated_argv(module: str) -> list[str]:
    """argv that runs ``module.main(sys.argv[1:])`` with ``python -I -S`` (no PYTHONPATH, no site-packages).

    For our stdlib-only helper processes (the watchdog, the guards). The package is registered as a bare
    module object pointing at this directory, so it imports even where ``pytest_pdserve`` is importable only
    through the running interpreter's path tweaks, and without running the package ``__init__`` (it imports
    ``typing``: time that a guard starting beside every server should not spend). Append the arguments.
    """
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # pytest_pdserve/, above running/
    boot = (
        "import sys, types; p = types.ModuleType('pytest_pdserve'); p.__path__ = [" + repr(pkg) + "]; "
        f"sys.modules['pytest_pdserve'] = p; from {module} import main; sys.exit(main(sys.argv[1:]))"
    )
    return [sys.executable, "-I", "-S", "-c", boot]


def tree_pids(run_token: str, pids: Iterable[int | None]) -> set[int]:
    """Every pid we started (servers and their descendants), read before stopping them."""
    found = {pid for pid in pids if pid is not None}
    with contextlib.suppress(OSError):
        found.update(pids_with_env(RUN_TOKEN_ENV, run_token))
    return found
