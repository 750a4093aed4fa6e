"""The guard: a second supervisor, so that no single death (nor pytest's *and* the watchdog's) breaks supervision.

Who can stop a server: ``ServerProcess.stop`` (pytest), the watchdog (when pytest dies) and the guard (when
pytest *and* the watchdog are gone). The guard exists because either of the first two can be SIGKILLed, in
any order: SIGKILL the watchdog, then pytest, and before the guard nobody was left to stop the servers.

* **The lifeline.** One pipe per pytest process (:func:`lifeline`). pytest holds the write end, and so does
  the watchdog (inherited at its start); nobody ever writes to it. Its read end reaches EOF exactly when
  every holder of a write end is dead. Forked children of pytest close their copy (``register_at_fork``),
  so a forked test helper cannot keep it open.
* **The guard** (one per pytest process, ``python -I -S``, stdlib only, niced) holds only the read end. It
  sleeps in ``select`` until EOF, then SIGTERMs every process carrying the run token (``PDSERVE_RUN_TOKEN``:
  every server and every descendant, ``setsid`` or not), waits the grace (``min(--pd-shutdown-timeout, 3 s)``),
  SIGKILLs what is left and exits. pytest stops it at the end of a normal session.
* **Leases** do not depend on any supervisor: the servers inherit their cluster's lease fds
  (``ServerProcess.start(inherit_fds=)``), so a lease is free only once the servers holding it are gone.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pytest_pdserve.common.child_env import child_environ
from pytest_pdserve.common.logfile import open_safety_net_log
from pytest_pdserve.running.proctree import RUN_TOKEN_ENV, SERVER_TOKEN_ENV, isolated_argv, terminate

__all__ = ["lifeline", "main", "start_guard"]

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


def _say(msg: str) -> None:
    with contextlib.suppress(OSError):
        sys.stderr.write(f"{time.strftime('%H:%M:%S')} pdserve-guard[{os.getpid()}] {msg}\n")
        sys.stderr.flush()


def start_guard(run_token: str, grace: float, log_path: Path | None) -> subprocess.Popen[bytes]:
    """Start the guard of this pytest process: it sweeps ``PDSERVE_RUN_TOKEN=run_token`` once the lifeline dies.

    Own session (a Ctrl-C to pytest's group is not for it); niced (its start-up must not slow the servers';
    it waits idle and acts rarely); without our tokens in its environment (no sweep targets it).
    """
    read_fd = lifeline()[0]
    env = child_environ(drop=(RUN_TOKEN_ENV, SERVER_TOKEN_ENV))
    out = open_safety_net_log(log_path, "guard")
    try:
        proc = subprocess.Popen(
            [*isolated_argv("pytest_pdserve.running.supervise"), run_token, str(read_fd), repr(float(grace))],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True, close_fds=True, pass_fds=(read_fd,),
        )  # fmt: skip
    finally:
        if out != subprocess.DEVNULL:
            os.close(out)
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, proc.pid, 10)
    return proc


def _guard(token: str, lifeline_fd: int, grace: float) -> int:
    for sig in (signal.SIGINT, signal.SIGHUP):  # a terminal's signals are not for us
        signal.signal(sig, signal.SIG_IGN)
    # Nobody ever writes to the lifeline: it becomes readable only at EOF, when every write end is closed.
    for _ in range(100_000_000):  # bounded only against a logic error
        readable, _, _ = select.select([lifeline_fd], [], [], 3600)
        if readable:
            break
    res = terminate([], env=[(RUN_TOKEN_ENV, token)], grace=grace, kill_wait=10.0)
    if res.swept:  # after a normal session there is nothing to do, and nothing to say
        _say(
            f"pytest and the watchdog are gone: stopped {list(res.swept)} in {res.total_seconds:.2f}s "
            f"(grace {grace:.1f}s, killed={res.killed}, left={list(res.remaining)})"
        )
    return 0 if not res.remaining else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Guard entry point: ``RUN_TOKEN LIFELINE_FD GRACE`` (no argparse: it is slow to import)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        token, fd, grace = args
        return _guard(token, int(fd), float(grace))
    except ValueError as exc:
        _say(f"usage: RUN_TOKEN LIFELINE_FD GRACE; got {args!r} ({exc})")
        return 2
