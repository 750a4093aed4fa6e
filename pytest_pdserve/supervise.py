"""Every server gets a guard process, so that no single death breaks supervision.

Who can stop a server: ``ServerProcess.stop`` (pytest), the watchdog (when pytest dies), and the server's
guard (when pytest *and* the watchdog are gone). The guard exists because either of the first two can be
SIGKILLed, in any order: SIGKILL the watchdog, then pytest, and before the guard nobody was left.

* **The lifeline.** One pipe per pytest process (:func:`lifeline`). pytest holds the write end, and so does
  the watchdog (inherited at its start); nobody ever writes to it. Its read end reaches EOF exactly when
  every holder of a write end is dead. Forked children of pytest close their copy (``register_at_fork``),
  so a forked test helper cannot keep it open.
* **Leases.** The server is spawned with the lease fds of its cluster (``ServerProcess.start(inherit_fds=)``),
  and so is its guard: **a lease is free only when the server (and its guard) are gone**, whoever dies first.
* **The guard** (``python -I -S``, stdlib only, ~10 MB) is started right after its server, in its own
  session, without the run/server tokens in its environment (sweeps do not target it; it ends with its
  server). It waits, on a pidfd of the server and on the lifeline, for one of two things:

  - the server exited: the guard exits, after sweeping the server's escaped descendants
    (``PDSERVE_SERVER_TOKEN``) if the lifeline is dead too;
  - EOF on the lifeline (pytest and the watchdog are both dead): it SIGTERMs the server and every process
    carrying the server's token, waits the grace (``min(--pd-shutdown-timeout, 10 s)``), SIGKILLs what is
    left, then exits.

The server is spawned directly by pytest, as before (the guard starts beside it, off the start-up's
critical path), so it stays a direct child of pytest with its own session and process group.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Sequence

from pytest_pdserve.proctree import (
    SERVER_TOKEN_ENV,
    isolated_argv,
    read_stat,
    terminate,
)

__all__ = ["guard_argv", "lifeline", "main"]

_LIFELINE: tuple[int, int] | None = None


def _forget_lifeline_in_child() -> None:
    global _LIFELINE
    if _LIFELINE is not None:
        with contextlib.suppress(OSError):
            os.close(_LIFELINE[1])  # a forked child must not keep the servers' supervisors "alive"
        _LIFELINE = None


def lifeline() -> tuple[int, int]:
    """``(read_fd, write_fd)`` of this process's lifeline pipe, created on first use (both close-on-exec)."""
    global _LIFELINE
    if _LIFELINE is None:
        _LIFELINE = os.pipe()
        os.register_at_fork(after_in_child=_forget_lifeline_in_child)
    return _LIFELINE


def guard_argv(server_pid: int, starttime: int, lifeline_fd: int, grace: float, server_token: str) -> list[str]:
    """argv of the guard of one server (pass ``lifeline_fd`` and the lease fds in ``pass_fds``)."""
    return [
        *isolated_argv("pytest_pdserve.supervise"),
        str(server_pid), str(starttime), str(lifeline_fd), repr(float(grace)), server_token,
    ]  # fmt: skip


def _say(msg: str) -> None:
    with contextlib.suppress(OSError):
        sys.stderr.write(f"{time.strftime('%H:%M:%S')} pdserve-guard[{os.getpid()}] {msg}\n")
        sys.stderr.flush()


def _dead(fd: int) -> bool:
    """Whether ``fd`` (a pidfd or the lifeline, both only ever readable at the end) is readable now."""
    readable, _, _ = select.select([fd], [], [], 0)
    return bool(readable)


def _same_process(pid: int, starttime: int) -> bool:
    info = read_stat(pid)
    return info is not None and info.live and info.starttime == starttime


def _sweep(server_pid: int, starttime: int, token: str, grace: float, why: str) -> None:
    extra = {server_pid: starttime} if _same_process(server_pid, starttime) else {}
    _say(f"{why}: stopping server pid {server_pid} and every process with its token (grace {grace:.1f}s)")
    res = terminate([], env=[(SERVER_TOKEN_ENV, token)], extra=extra, grace=grace, kill_wait=10.0)
    _say(f"done in {res.total_seconds:.2f}s: killed={res.killed} swept={list(res.swept)} left={list(res.remaining)}")


def _guard(server_pid: int, starttime: int, lifeline_fd: int, grace: float, token: str) -> int:
    for sig in (signal.SIGINT, signal.SIGHUP):  # a terminal's signals are not for us
        signal.signal(sig, signal.SIG_IGN)
    try:
        server_fd = os.pidfd_open(server_pid)  # readable once the server has exited (Linux >= 5.3)
    except (OSError, AttributeError):
        server_fd = None
    if not _same_process(server_pid, starttime):  # gone before we looked: the pidfd may name a newcomer
        server_fd = None
        if _dead(lifeline_fd):
            _sweep(server_pid, starttime, token, 0.0, "server gone and nobody supervises it")
        return 0
    for _ in range(100_000_000):  # ends on one of the events below; the count only bounds a logic error
        watched = [lifeline_fd] if server_fd is None else [lifeline_fd, server_fd]
        readable, _, _ = select.select(watched, [], [], 0.2)
        if lifeline_fd in readable:
            _sweep(server_pid, starttime, token, grace, "pytest and the watchdog are gone")
            return 0
        if (server_fd is not None and server_fd in readable) or not _same_process(server_pid, starttime):
            if _dead(lifeline_fd):
                _sweep(server_pid, starttime, token, 0.0, "server gone and nobody supervises it")
            return 0
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Guard entry point: ``SERVER_PID STARTTIME LIFELINE_FD GRACE SERVER_TOKEN`` (no argparse: it is slow to
    import, and the guard starts next to every server)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        pid, starttime, fd, grace, token = args
        return _guard(int(pid), int(starttime), int(fd), float(grace), token)
    except ValueError as exc:
        _say(f"usage: SERVER_PID STARTTIME LIFELINE_FD GRACE SERVER_TOKEN; got {args!r} ({exc})")
        return 2
