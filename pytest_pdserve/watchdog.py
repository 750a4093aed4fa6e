"""Watchdog process: nothing we started outlives pytest, even when pytest dies without cleanup.

pytest can die without running a single finaliser: SIGKILL, the OOM killer, pytest-timeout's thread
method (``os._exit``), an xdist worker crash. Our servers run in their own sessions (so Ctrl-C to
pytest's process group does not kill them mid-teardown), which means nobody else will kill them
either, and a leaked ``vllm serve`` keeps its GPU memory for the next run.

So pytest starts one small stdlib-only process per pytest process (``Watchdog.start``), in its own
session, connected by a ``SOCK_SEQPACKET`` socket pair. pytest tells it which process groups and run
tokens to watch. When pytest dies the kernel closes pytest's end, the watchdog reads EOF and:

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
exits, which is not parent death when the watchdog was started from a helper thread. For the same
reason PDEATHSIG is not put on the servers themselves.

This module imports only the standard library, so it can run as a script with ``python -I`` even when
``pytest_pdserve`` is not importable in the child's environment. The ``/proc`` helpers here are also
used by :mod:`pytest_pdserve.process` to stop a single server.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "RUN_TOKEN_ENV",
    "SERVER_TOKEN_ENV",
    "ProcInfo",
    "TerminateResult",
    "Watchdog",
    "descendants",
    "pids_with_env",
    "proc_table",
    "terminate",
]

log = logging.getLogger(__name__)

RUN_TOKEN_ENV = "PDSERVE_RUN_TOKEN"
"""Env var carried by every process we start (and inherited by its descendants); the watchdog sweeps it."""

SERVER_TOKEN_ENV = "PDSERVE_SERVER_TOKEN"
"""Env var unique to one server; ``ServerProcess.stop`` sweeps only its own server's escapees by it."""

_PR_SET_PDEATHSIG = 1
_POLL = 0.02  # seconds between liveness checks while waiting for processes to exit
_READY_TIMEOUT = 10.0  # how long Watchdog.start waits for the child's hello


# --------------------------------------------------------------------------------------------------
# /proc helpers (Linux). Every helper is best effort: processes vanish between listdir and open.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcInfo:
    """One row of ``/proc/<pid>/stat``: what we need to walk trees and to guard against PID reuse."""

    pid: int
    ppid: int
    pgid: int
    state: str
    starttime: int

    @property
    def live(self) -> bool:
        """False for zombies (exited, not yet reaped) and dead entries."""
        return self.state not in ("Z", "X", "x")


def _read_stat(pid: int) -> ProcInfo | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses, so split after the last ')'.
    rest = data[data.rindex(b")") + 2 :].split()
    try:
        return ProcInfo(pid, int(rest[1]), int(rest[2]), rest[0].decode(), int(rest[19]))
    except (IndexError, ValueError):
        return None


def proc_table() -> dict[int, ProcInfo]:
    """Snapshot every process visible in ``/proc``."""
    table: dict[int, ProcInfo] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _read_stat(int(entry))
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


def _signal_all(groups: Iterable[int], pids: Mapping[int, int], sig: int) -> None:
    groups = {g for g in groups if _safe_group(g)}
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    table = proc_table()
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


def _still_alive(groups: Iterable[int], pids: Mapping[int, int]) -> dict[int, int]:
    groups = set(groups)
    table = proc_table()
    alive: dict[int, int] = {}
    for info in table.values():
        if not info.live:
            continue
        if info.pgid in groups or pids.get(info.pid) == info.starttime:
            alive[info.pid] = info.starttime
    return alive


def _token_pids(env: Sequence[tuple[str, str]]) -> dict[int, int]:
    table = proc_table()
    out: dict[int, int] = {}
    for name, value in env:
        for pid in pids_with_env(name, value, table):
            out[pid] = table[pid].starttime
    return out


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
    targets.update(_token_pids(env))
    swept: set[int] = set()
    table = proc_table()
    for pid in targets:
        info = table.get(pid)
        if info is not None and info.pgid not in groups:
            swept.add(pid)

    killed = False
    if grace > 0:
        _signal_all(groups, targets, signal.SIGTERM)
        deadline = t0 + grace
        while _still_alive(groups, targets) and time.monotonic() < deadline:
            time.sleep(_POLL)
    term_seconds = time.monotonic() - t0

    alive = _still_alive(groups, targets)
    deadline = time.monotonic() + kill_wait
    # Each round rescans the env token: a dying process can still spawn (or setsid) a child.
    for _ in range(1000):
        more = _token_pids(env)
        for pid in more:
            if pid not in targets:
                info = table.get(pid) or _read_stat(pid)
                if info is not None and info.pgid not in groups:
                    swept.add(pid)
        targets.update(more)
        alive = _still_alive(groups, targets)
        if not alive or time.monotonic() >= deadline:
            break
        killed = True
        _signal_all(groups, alive, signal.SIGKILL)
        time.sleep(_POLL)
    return TerminateResult(
        term_seconds=term_seconds,
        killed=killed,
        swept=tuple(sorted(swept)),
        remaining=tuple(sorted(alive)),
        total_seconds=time.monotonic() - t0,
    )


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

    @classmethod
    def start(cls, run_token: str, grace: float = 5.0, *, log_path: Path | None = None, wait: bool = True) -> Watchdog:
        """Start a watchdog that sweeps ``PDSERVE_RUN_TOKEN=<run_token>`` when this process dies.

        :param run_token: the token put in every server's env (see ``ServerProcess``).
        :param grace: seconds between SIGTERM and SIGKILL when cleaning up after a dead parent.
        :param log_path: where the watchdog writes what it did (appended); None discards it.
        :raises OSError: if the watchdog could not be started or did not say hello within 10 s.
        """
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [
            sys.executable,
            "-I",  # stdlib only: ignore PYTHONPATH/site tweaks that could break or slow the child
            os.path.abspath(__file__),
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
        out = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=(child_sock.fileno(),),
                # Own session: a Ctrl-C to pytest's process group must not kill the watchdog before
                # pytest's own teardown had a chance; and it must survive pytest's death.
                start_new_session=True,
            )
        finally:
            child_sock.close()
            if not isinstance(out, int):
                out.close()
        wd = cls(proc, parent_sock, log_path)
        if wait:
            wd._await_hello()
        # With wait=False the hello is checked before the first command. The process is already running
        # and knows the token, so servers started meanwhile are swept even if this process dies first.
        return wd

    def _await_hello(self) -> None:
        if not self._hello_pending:
            return
        ready, _, _ = select.select([self._sock], [], [], _READY_TIMEOUT)
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
        if self._closed:
            return
        try:
            self._await_hello()
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

    def add_token(self, run_token: str) -> None:
        """Also sweep processes whose env has ``PDSERVE_RUN_TOKEN=<run_token>``."""
        self._send(f"token {run_token}")

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
        """Normal shutdown, after everything was stopped by us: the watchdog exits without killing."""
        if self._closed:
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


def _set_pdeathsig(sig: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            _say(f"prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}")
    except (OSError, AttributeError) as exc:  # not Linux / no libc symbol: EOF still works
        _say(f"prctl unavailable: {exc}")


def _serve(sock: socket.socket, ppid: int, tokens: set[str]) -> tuple[str, dict[int, int]]:
    """Handle commands until the parent goes away (returns why) or says exit ("exit")."""
    groups: dict[int, int] = {}
    held: dict[str, list[int]] = {}
    woken = [False]

    def on_usr1(signum: int, frame: object) -> None:
        woken[0] = True

    signal.signal(signal.SIGUSR1, on_usr1)
    _set_pdeathsig(signal.SIGUSR1)
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
            elif cmd == "token":
                tokens.add(rest)
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
    """Entry point of the watchdog process (``python -m pytest_pdserve.watchdog`` or the file path)."""
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
    reason, groups = _serve(sock, args.ppid, tokens)
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
