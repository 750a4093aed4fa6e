"""Watchdog process: nothing we started outlives pytest, even when pytest dies without cleanup.

pytest can die without running a single finaliser: SIGKILL, the OOM killer, pytest-timeout's thread
method (``os._exit``), an xdist worker crash. Our servers run in their own sessions (so Ctrl-C to
pytest's process group does not kill them mid-teardown), which means nobody else will kill them
either, and a leaked ``vllm serve`` keeps its GPU memory for the next run.

So pytest starts one small stdlib-only process per pytest process (``Watchdog.start``), in its own
session, connected by a ``SOCK_SEQPACKET`` socket pair. It gets the run token at start; pytest tells it
which process groups to watch. When pytest dies the kernel closes pytest's end, the watchdog reads EOF and:

1. SIGTERMs every watched process group and every process whose environment carries a watched
   ``PDSERVE_RUN_TOKEN`` (this finds descendants that called ``setsid`` and left the group);
2. waits up to ``grace`` seconds for them to exit;
3. SIGKILLs whatever is left, rescans the token, and waits until they are really gone;
4. exits, which closes the lease file descriptors pytest handed it (``hold``), so GPU and port
   leases stay held until the servers that used them are dead.

Why one watchdog per pytest process and not one per cluster: all clusters of a pytest process die
with it, so one watchdog sees the same EOF; it costs one interpreter instead of one per cluster, and
lease fds acquired later can still be handed over (SCM_RIGHTS over the socket).

Belt and braces: the watchdog also polls ``getppid()`` (catches a parent whose socket end was inherited
by a forked child) and asks for ``PR_SET_PDEATHSIG`` = SIGUSR1. The signal only *wakes* the loop; the
decision is made on ``getppid()``, because PDEATHSIG fires when the parent *thread* that spawned us
exits, which is not parent death when the watchdog was started from a helper thread.

The watchdog is one of two supervisors: it inherits the write end of pytest's lifeline
(:mod:`pytest_pdserve.running.supervise`), so when it dies *and* pytest dies, each server's guard stops its
server. Killing and finding process trees lives in :mod:`pytest_pdserve.running.proctree`; this module imports
only the standard library and that, so it runs under ``python -I -S``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pytest_pdserve.common.logfile import open_safety_net_log
from pytest_pdserve.common.owner import Owner
from pytest_pdserve.running.proctree import (
    RUN_TOKEN_ENV,
    SERVER_TOKEN_ENV,
    isolated_argv,
    set_parent_death_signal,
    terminate,
)
from pytest_pdserve.running.supervise import lifeline

__all__ = ["Watchdog"]

log = logging.getLogger(__name__)

_READY_TIMEOUT = 10.0  # how long Watchdog.start waits for the child's hello


# --------------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------------


class Watchdog:
    """Handle (in pytest) on a running watchdog process. Create with :meth:`start`.

    Every method is best effort: if the watchdog died, a warning is logged and the call returns
    (the watchdog is a safety net; its loss must not fail a test).
    """

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket, log_path: Path | None = None) -> None:
        """Private: use :meth:`Watchdog.start`."""
        self._proc = proc
        self._sock = sock
        self._closed = False
        self._log_path = log_path
        self._hello_pending = True
        #: Only the pytest process that started it talks to it: a forked child's "unwatch" or "exit" would leave
        #: the parent's servers unguarded (common/owner.py).
        self.owner = Owner()

    @classmethod
    def start(cls, run_token: str, grace: float = 5.0, *, log_path: Path | None = None, wait: bool = True) -> Watchdog:
        """Start a watchdog that sweeps ``PDSERVE_RUN_TOKEN=<run_token>`` when this process dies.

        :param run_token: the token put in every server's env (see ``ServerProcess``).
        :param grace: seconds between SIGTERM and SIGKILL when cleaning up after a dead parent.
        :param log_path: where the watchdog writes what it did (appended); None discards it.
        :raises OSError: if the watchdog could not be started or did not say hello within 10 s.
        """
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        life_fd = lifeline()[1]  # held, never used: the servers' guards act only when this copy is closed too
        argv = [
            *isolated_argv("pytest_pdserve.running.watchdog"),  # stdlib only: PYTHONPATH/site tweaks cannot break it
            "--fd",
            str(child_sock.fileno()),
            "--ppid",
            str(os.getpid()),
            "--grace",
            repr(float(grace)),
            "--token",
            run_token,
        ]
        env = {k: v for k, v in os.environ.items() if k not in (RUN_TOKEN_ENV, SERVER_TOKEN_ENV)}
        out = open_safety_net_log(log_path, "watchdog")
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=(child_sock.fileno(), life_fd),
                # Own session: a Ctrl-C to pytest's process group must not kill the watchdog before
                # pytest's own teardown had a chance; and it must survive pytest's death.
                start_new_session=True,
            )
        finally:
            child_sock.close()
            if out != subprocess.DEVNULL:
                os.close(out)
        wd = cls(proc, parent_sock, log_path)
        if wait:
            wd._await_hello()
        # With wait=False the hello is checked before the first command. The process is already running
        # and knows the token, so servers started meanwhile are swept even if this process dies first.
        return wd

    def _await_hello(self, timeout: float = _READY_TIMEOUT) -> None:
        """Check the child's hello, waiting up to ``timeout``; with 0, return at once if it has not come yet
        (commands sent meanwhile queue up in the socket: the child reads them after its hello)."""
        if not self._hello_pending:
            return
        ready, _, _ = select.select([self._sock], [], [], timeout)
        if not ready and timeout == 0 and self._proc.poll() is None:
            return
        hello = self._sock.recv(64) if ready else b""
        if hello != b"ready":
            with contextlib.suppress(OSError):
                self._proc.kill()
            self._proc.wait(5)
            self._sock.close()
            self._closed = True
            raise OSError(
                f"pdserve watchdog (pid {self._proc.pid}) did not start: got {hello!r}; log: {self._log_path}"
            )
        self._hello_pending = False

    @property
    def pid(self) -> int:
        """The watchdog's pid."""
        return self._proc.pid

    @property
    def alive(self) -> bool:
        """Whether the watchdog process is still running."""
        return self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """Its exit status once exited: 0 after close() or a complete cleanup, 1 if something survived."""
        return self._proc.poll()

    def _send(self, line: str, fds: Sequence[int] = ()) -> None:
        if self._closed or not self.owner.here:
            return
        try:
            # Not blocking on the hello: the servers' readiness loop must not wait for our start-up.
            self._await_hello(timeout=0)
            if fds:
                socket.send_fds(self._sock, [line.encode()], list(fds))
            else:
                self._sock.send(line.encode())
        except OSError as exc:
            log.warning("pdserve watchdog (pid %s) unreachable, %r not delivered: %s", self.pid, line, exc)

    def watch(self, pid: int, pgid: int) -> None:
        """Kill process group ``pgid`` (leader ``pid``) if this process dies."""
        self._send(f"watch {pgid} {pid}")

    def unwatch(self, pgid: int) -> None:
        """Forget ``pgid`` (call after stopping that server yourself)."""
        self._send(f"unwatch {pgid}")

    def hold(self, label: str, fds: Sequence[int]) -> None:
        """Hand the watchdog duplicates of lease fds, so the leases outlive this process until the
        watchdog has finished killing. An explicit ``release()`` of the lease still frees it at once
        (``flock`` ``LOCK_UN`` on any duplicate unlocks); call :meth:`drop` then to close the copies.
        """
        self._send(f"hold {label}", fds)

    def drop(self, label: str) -> None:
        """Close the watchdog's copies of the fds held under ``label``."""
        self._send(f"drop {label}")

    def close(self, timeout: float = 5.0) -> None:
        """Normal shutdown, after everything was stopped by us: the watchdog exits without killing (not from a forked
        child: the watchdog is its parent's)."""
        if self._closed or not self.owner.here:
            return
        self._send("exit")
        self._closed = True
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("pdserve watchdog (pid %s) did not exit; killing it", self.pid)
            self._proc.kill()
            self._proc.wait(timeout)
        finally:
            self._sock.close()


# --------------------------------------------------------------------------------------------------
# Child side
# --------------------------------------------------------------------------------------------------


def _say(msg: str) -> None:
    sys.stderr.write(f"{time.strftime('%H:%M:%S')} pdserve-watchdog[{os.getpid()}] {msg}\n")
    sys.stderr.flush()


def _serve(sock: socket.socket, ppid: int) -> tuple[str, dict[int, int]]:
    """Handle commands until the parent goes away (returns why) or says exit ("exit")."""
    groups: dict[int, int] = {}
    held: dict[str, list[int]] = {}
    woken = [False]

    def on_usr1(signum: int, frame: object) -> None:
        woken[0] = True

    signal.signal(signal.SIGUSR1, on_usr1)
    problem = set_parent_death_signal(signal.SIGUSR1)
    if problem:
        _say(problem)
    try:
        sock.send(b"ready")
    except OSError:
        # The parent died before reading our hello (it does not wait for it): clean up for it anyway.
        return "parent gone before hello", groups
    while True:
        if os.getppid() != ppid:
            return ("parent changed" + (" (PDEATHSIG)" if woken[0] else "")), groups
        ready, _, _ = select.select([sock], [], [], 0.2)
        if not ready:
            continue
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, 4096, 64)
        except OSError as exc:
            return f"socket error {exc}", groups
        if not data:
            return "EOF from parent", groups
        cmd, _, rest = data.decode(errors="replace").partition(" ")
        try:
            if cmd == "watch":
                pgid, pid = (int(x) for x in rest.split())
                groups[pgid] = pid
            elif cmd == "unwatch":
                groups.pop(int(rest), None)
            elif cmd == "hold":
                held.setdefault(rest, []).extend(fds)
                fds = []
            elif cmd == "drop":
                for fd in held.pop(rest, []):
                    with contextlib.suppress(OSError):
                        os.close(fd)
            elif cmd == "exit":
                return "exit", groups
            else:
                _say(f"unknown command {data!r}")
        except ValueError:
            _say(f"bad command {data!r}")
        for fd in fds:  # fds that came with a command that does not take any
            with contextlib.suppress(OSError):
                os.close(fd)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the watchdog process (see :func:`pytest_pdserve.running.proctree.isolated_argv`)."""
    parser = argparse.ArgumentParser(prog="pdserve-watchdog")
    parser.add_argument("--fd", type=int, required=True, help="SOCK_SEQPACKET fd connected to the parent")
    parser.add_argument("--ppid", type=int, required=True, help="pid of the parent we watch")
    parser.add_argument("--grace", type=float, default=5.0, help="SIGTERM-to-SIGKILL grace in seconds")
    parser.add_argument("--token", action="append", default=[], help="PDSERVE_RUN_TOKEN to sweep")
    args = parser.parse_args(argv)
    # Terminal signals go to pytest's session, not ours; ignore SIGINT anyway in case someone
    # signals our group: dying here would leave the servers unguarded.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    tokens = set(args.token)
    reason, groups = _serve(sock, args.ppid)
    if reason == "exit":
        return 0
    t0 = time.monotonic()
    _say(f"{reason}: cleaning up groups {sorted(groups)} and tokens {sorted(tokens)}")
    res = terminate(groups, env=[(RUN_TOKEN_ENV, t) for t in sorted(tokens)], grace=args.grace, kill_wait=10.0)
    _say(
        f"done in {time.monotonic() - t0:.2f}s: killed={res.killed} swept={list(res.swept)} "
        f"remaining={list(res.remaining)}"
    )
    # Exiting closes the held lease fds: leases free only now that the servers are gone.
    return 0 if not res.remaining else 1


if __name__ == "__main__":
    sys.exit(main())
