"""ServerProcess: start a server in its own session, notice readiness fast, fail fast, stop the whole tree.

The contract (mirakuru's executor contract, tightened for minute-long GPU startups):

* ``start()`` refuses to start when something already answers on the health port (:class:`PortInUse`),
  then spawns ``argv`` (never via a shell) with ``start_new_session=True``, stdin from /dev/null and
  stdout+stderr appended to a log file. A pipe would block a chatty server once nobody reads it.
* ``wait_ready()`` / :func:`wait_all_ready` poll every 5 ms (sooner right after a server logs: log_wakeup.py)
  against a ``time.monotonic()`` deadline:
  process alive (any exit, even 0, raises :class:`ServerExitedEarly` at once with the log tail), then
  ``GET /health`` is 200, then ``GET /v1/models`` lists ``model_id``. On timeout the process group is
  killed *first*, then :class:`ServerStartupTimeout` is raised.
* ``stop(grace)`` SIGTERMs the process group, waits, SIGKILLs, then sweeps descendants that left the
  group (vLLM's EngineCore and workers can outlive a killed API server). They are found by env token
  and by ppid chain, never by name. Idempotent; every step best effort and logged. Only the process that made
  the ``ServerProcess`` stops it: in a forked child (``common/owner.py``) ``stop`` and the atexit net do nothing,
  and the exit status is not guessed (``returncode`` is None: only the parent can wait for it).
* ``pause()`` / ``resume()`` SIGSTOP / SIGCONT the same tree (a fault a test causes on purpose); ``stop()`` resumes a
  paused server first, so its SIGTERM is acted on. ``respawned()`` is a fresh, unstarted copy for a restart.

The env of every server carries ``PDSERVE_RUN_TOKEN=<run_token>`` (what the watchdog sweeps if pytest
dies) and a per-server ``PDSERVE_SERVER_TOKEN`` (what ``stop()`` sweeps, so stopping the prefill server
never touches the decode server's processes).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

import httpx

from pytest_pdserve.common.child_env import start_dir
from pytest_pdserve.common.logfile import log_size, open_append, tail_lines
from pytest_pdserve.common.owner import Owner
from pytest_pdserve.common.redaction import redact_argv, register, secrets_in
from pytest_pdserve.errors import AuthRefused, PortInUse, ServerExitedEarly, ServerStartupError, ServerStartupTimeout
from pytest_pdserve.running.hints import AUTH_HINT, hint_for, lead_with_root_cause
from pytest_pdserve.running.log_wakeup import LogWakeup
from pytest_pdserve.running.proctree import (
    RUN_TOKEN_ENV,
    SERVER_TOKEN_ENV,
    descendants,
    proc_table,
    read_stat,
    signal_server,
    terminate,
)
from pytest_pdserve.running.readiness import ReadinessCheck, readiness_client
from pytest_pdserve.running.rpc_dirs import RPC_BASE_ENV, make_rpc_dir, remove_rpc_dir

__all__ = [
    "DEFAULT_STOP_GRACE",
    "ProgressCallback",
    "ServerProcess",
    "StopReport",
    "new_run_token",
    "wait_all_ready",
]

log = logging.getLogger(__name__)

ProgressCallback = Callable[[str, float, str], None]
"""``on_progress(name, seconds_since_start, last_log_line)``, called about once per second while waiting."""

DEFAULT_STOP_GRACE = 30.0
"""SIGTERM-to-SIGKILL grace used by the context manager and the atexit safety net's callers."""

#: The readiness poll's sleep at first: a server is noticed about 3 ms plus one probe after it starts serving (issue
#: 28's target is 5 ms beyond the P/D round trip).
POLL_INTERVAL_S = 0.005
#: Later the sleep grows with the wait (1/500 of it, at most MAX_POLL_INTERVAL_S): a refused probe costs about
#: 0.1 ms of CPU, which every 5 ms over a 40-120 s real-vLLM start on 2 cores is a few percent of a core taken
#: from the start itself; a notice within 0.2 % of the start's time costs nothing anyone can see.
POLL_INTERVAL_SHARE = 1 / 500
MAX_POLL_INTERVAL_S = 0.05


#: After a server wrote to its log (log_wakeup.py), the poll probes every FAST_POLL_S for FAST_WINDOW_S: uvicorn logs
#: "Application startup complete." just before it listens, so the server is noticed within about a millisecond after it
#: serves. A chatty log costs at most one probe (about 0.02 ms of CPU when refused) per FAST_POLL_S.
FAST_POLL_S = 0.0005
FAST_WINDOW_S = 0.02


def poll_interval(waited: float) -> float:
    """The readiness poll's sleep after ``waited`` seconds of a start."""
    return min(MAX_POLL_INTERVAL_S, max(POLL_INTERVAL_S, waited * POLL_INTERVAL_SHARE))


_PROGRESS_EVERY = 1.0
_TAIL_LINES = 50
#: Lines read back to find vLLM's root cause in a dead server's log (its traceback sits above the shutdown noise).
_CAUSE_LINES = 600

_live: weakref.WeakSet[ServerProcess] = weakref.WeakSet()
os.register_at_fork(after_in_child=_live.clear)  # a forked child's atexit net has nothing of its own to stop


def new_run_token() -> str:
    """A fresh, unguessable run token (one per pytest process or cluster)."""
    return f"pdserve-{os.getpid()}-{uuid.uuid4().hex[:16]}"


@dataclass(frozen=True)
class StopReport:
    """What :meth:`ServerProcess.stop` did.

    :param name: the server.
    :param pid: its pid (None if it was never started).
    :param returncode: its exit status after the stop (negative = signal), None if never started.
    :param exited_before_stop: it had already exited when stop() was called (a crash, or killed earlier).
    :param term_seconds: SIGTERM until the tree was gone (or the grace ran out).
    :param sigkill_needed: SIGKILL had to be sent.
    :param swept_pids: processes outside the group that were signalled (escaped descendants).
    :param remaining_pids: processes still alive afterwards (should be empty).
    :param total_seconds: the whole stop.
    :param errors: best-effort steps that failed (logged too).
    """

    name: str
    pid: int | None
    returncode: int | None
    exited_before_stop: bool
    term_seconds: float
    sigkill_needed: bool
    swept_pids: tuple[int, ...]
    remaining_pids: tuple[int, ...]
    total_seconds: float
    errors: tuple[str, ...] = ()


class ServerProcess:
    """One server process (vLLM, the simulator or the proxy) with its log file.

    :param name: display name used in errors and progress (``prefill-0``, ``decode-0``, ``proxy``).
    :param argv: the command; element 0 is the executable. Never run through a shell.
    :param env: the complete environment of the child (not merged with ``os.environ``; the caller
        decides). The run/server tokens are added.
    :param log_path: stdout+stderr are appended here; the parent directory must exist.
    :param health_url: ``http://127.0.0.1:PORT/health``; must answer 200 when ready. None = the
        process counts as ready as soon as it is alive (no HTTP check, no port pre-check).
    :param models_url: ``.../v1/models``; if given it must answer 200 (and list ``model_id`` if given).
    :param model_id: the served model name that ``models_url`` must list.
    :param api_key: sent as ``Authorization: Bearer`` on readiness requests (vLLM ``--api-key``).
    :param run_token: the session/cluster token the watchdog sweeps (:func:`new_run_token`).
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        *,
        health_url: str | None,
        models_url: str | None = None,
        model_id: str | None = None,
        api_key: str | None = None,
        run_token: str,
        rpc_dir: Path | None = None,
    ) -> None:
        if isinstance(argv, str) or not argv:
            raise ValueError(f"{name}: argv must be a non-empty list of strings, got {argv!r}")
        if model_id is not None and models_url is None:
            raise ValueError(f"{name}: model_id={model_id!r} needs models_url to check it")
        self.name = name
        #: The server's own VLLM_RPC_BASE_PATH (rpc_dirs.py), removed once it is stopped; None: not ours to remove.
        self.rpc_dir = rpc_dir
        self.argv: tuple[str, ...] = tuple(argv)
        self.log_path = Path(log_path)
        self.health_url = health_url
        self.models_url = models_url
        self.model_id = model_id
        self.run_token = run_token
        self.server_token = f"{run_token}.{name}.{uuid.uuid4().hex[:8]}"
        self.env: dict[str, str] = dict(env)
        # What the server is given it may print (vLLM logs its non-default args): a spec's --hf-token or HF_TOKEN
        # is hidden in its log excerpts and in every message quoting them, like the session's secrets.
        register(api_key, *secrets_in(self.argv, self.env))
        self.env[RUN_TOKEN_ENV] = run_token
        self.env[SERVER_TOKEN_ENV] = self.server_token
        # Without a health_url it is never asked: an alive process counts as ready.
        self._readiness = ReadinessCheck(health_url or "", models_url, model_id, api_key)
        self._api_key = api_key
        self._inherit_fds: tuple[int, ...] = ()
        self._paused = False
        self._popen: subprocess.Popen[bytes] | None = None
        self._started_at = 0.0
        self._ready_at: float | None = None
        self._stop_report: StopReport | None = None
        #: Who may stop it (and wait for its exit status): the process that made it, never a forked child.
        self.owner = Owner()

    # ---------------------------------------------------------------- state

    @property
    def pid(self) -> int | None:
        """The server's pid, None before start()."""
        return self._popen.pid if self._popen is not None else None

    @property
    def pgid(self) -> int | None:
        """Its process group id (== pid, since it leads its own session)."""
        return self.pid

    @property
    def returncode(self) -> int | None:
        """Exit status once it exited (negative = killed by that signal), else None; None in a forked child, which
        cannot wait for it (``Popen.poll`` there says 0 for a server that runs)."""
        if self._popen is None or not self.owner.here:
            return None
        return self._popen.poll()

    @property
    def alive(self) -> bool:
        """Started and not exited (in a forked child: its process is there and not a zombie)."""
        if self._popen is None:
            return False
        if not self.owner.here:
            stat = read_stat(self._popen.pid)
            return stat is not None and stat.live
        return self._popen.poll() is None

    @property
    def started_at(self) -> float:
        """``time.monotonic()`` when the process was spawned (0.0 before start)."""
        return self._started_at

    # ---------------------------------------------------------------- logs

    def log_offset(self) -> int:
        """Current size of the log in bytes; remember it to read only what a test produced."""
        return log_size(self.log_path)

    def log_tail(self, lines: int = _TAIL_LINES) -> str:
        """The last ``lines`` lines of the log (reads at most a few MB from the end)."""
        return tail_lines(self.log_path, lines)

    def failure_tail(self) -> tuple[str, str | None]:
        """The log's last lines led by vLLM's root cause (hints.root_cause, from the last few hundred lines), and
        the hint for what they show: what a start error quotes."""
        text = tail_lines(self.log_path, _CAUSE_LINES)
        return lead_with_root_cause(text, self.log_tail()), hint_for(text)

    # ---------------------------------------------------------------- lifecycle

    def start(self, inherit_fds: Sequence[int] = ()) -> ServerProcess:
        """Spawn the server. Returns self.

        :param inherit_fds: fds the server itself keeps open (lease locks: a lease held by the server is
            free only once the server is gone, whoever else dies first).
        :raises PortInUse: the health port already answers (a leftover server or another service).
        :raises RuntimeError: start() was already called.
        :raises OSError: the executable could not be run (e.g. not found).
        """
        if self._popen is not None:
            raise RuntimeError(f"{self.name}: start() called twice")
        self._inherit_fds = tuple(inherit_fds) or self._inherit_fds  # a respawned() copy keeps its original's
        if self.health_url is not None:
            host, port = _host_port(self.health_url)
            if _answers(host, port):
                raise PortInUse(port, self.name)
        # Never blocks on a FIFO planted where the log goes, and refuses anything but a regular file (logfile.py).
        with os.fdopen(open_append(self.log_path), "ab") as log_fh:
            # Secrets stay out of the log: its tail ends up in error messages and progress lines.
            shown = " ".join(redact_argv(self.argv))
            log_fh.write(f"pdserve: starting {self.name}: {shown}\n".encode(errors="backslashreplace"))
            log_fh.flush()
            self._popen = subprocess.Popen(
                list(self.argv),
                stdin=subprocess.DEVNULL,
                stdout=log_fh,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=start_dir(),  # where pytest started, not where a test chdir'ed to (common/child_env.py)
                start_new_session=True,
                close_fds=True,
                pass_fds=self._inherit_fds,
            )
        # The child has its own copy of the log fd; ours is closed by the with-block.
        self._started_at = time.monotonic()
        _live.add(self)
        log.info("started %s pid=%s log=%s", self.name, self._popen.pid, self.log_path)
        return self

    def poll_ready(self, client: httpx.Client | None = None) -> bool:
        """One readiness check: alive, ``/health`` 200, ``/v1/models`` lists the model.

        Returns True when ready. Takes at most about one request timeout (0.5 s per request).

        :raises ServerExitedEarly: the process exited (any exit code); its group is killed.
        """
        if self._popen is None:
            raise RuntimeError(f"{self.name}: poll_ready() before start()")
        if self._ready_at is not None:
            return True
        if self._popen.poll() is not None:
            self._kill_now()
            tail, hint = self.failure_tail()
            raise ServerExitedEarly(self.name, self._popen.returncode, tail, hint, str(self.log_path))
        if self.health_url is not None:
            own = client is None
            client = client or readiness_client()
            try:
                if not self._readiness.check(client):
                    return False
            except AuthRefused as exc:  # will not go away by waiting: kill the server, fail the start now
                self._kill_now()
                tail = self.log_tail()
                raise ServerStartupError(self.name, f"readiness check refused ({exc})", tail, AUTH_HINT,
                                         str(self.log_path)) from None  # fmt: skip
            finally:
                if own:
                    client.close()
        self._ready_at = time.monotonic()
        return True

    def wait_ready(self, deadline: float, on_progress: ProgressCallback | None = None) -> float:
        """Block until ready; return seconds from start() to ready.

        :param deadline: a ``time.monotonic()`` timestamp.
        :param on_progress: called about once per second with (name, elapsed, last log line).
        :raises ServerExitedEarly: the process exited first (raised within one poll interval).
        :raises ServerStartupTimeout: the deadline passed; the process group was killed before raising.
        """
        wait_all_ready([self], deadline, on_progress)
        return self.ready_seconds()

    @property
    def models_answer(self) -> object:
        """The ``/v1/models`` body of the readiness check that found this server ready (None before, or without a
        models check). One process serves one model list for its life, so the start's read-back takes it from here
        instead of asking again while the P/D-ready round trip runs beside it."""
        return self._readiness.models_answer if self._ready_at is not None else None

    def ready_seconds(self) -> float:
        """Seconds from start() to the moment readiness was noticed (raises if not ready yet)."""
        if self._ready_at is None:
            raise RuntimeError(f"{self.name} is not ready")
        return self._ready_at - self._started_at

    def disown(self) -> None:
        """Hand the running process over (to the reuse keeper, `reuse/handover.py`): this object never stops it again,
        nor does the atexit safety net."""
        _live.discard(self)
        if self._popen is not None and self._popen.returncode is None:
            # Popen warns (ResourceWarning) when collected while its child runs; the child is not ours to wait for.
            self._popen.returncode = 0
        self._popen = None

    @property
    def paused(self) -> bool:
        """Stopped by :meth:`pause` and not resumed."""
        return self._paused

    def pause(self) -> None:
        """SIGSTOP the server's whole tree: it keeps its ports and connections and answers nothing until
        :meth:`resume` (a hung server, on purpose). :raises RuntimeError: it is not running."""
        self._signal_tree("pause", signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT the tree :meth:`pause` stopped."""
        self._signal_tree("resume", signal.SIGCONT)
        self._paused = False

    def _signal_tree(self, what: str, sig: int) -> None:
        if self._popen is None or self._popen.poll() is not None:
            raise RuntimeError(f"{self.name}: cannot {what} it: it is not running")
        signal_server(self._popen.pid, self.server_token, sig)

    def respawned(self) -> ServerProcess:
        """A fresh, unstarted copy of this server to start in its place (``ServerHandle.restart``): the same argv,
        environment, log file, readiness check and lease fds (:meth:`start` with no fds gives it these); a new server
        token, and a new RPC directory where this one had its own (the old one goes when this one stops)."""
        env = {k: v for k, v in self.env.items() if k not in (RUN_TOKEN_ENV, SERVER_TOKEN_ENV)}
        rpc_dir = None
        if self.rpc_dir is not None:
            rpc_dir = make_rpc_dir()
            env[RPC_BASE_ENV] = str(rpc_dir)
        fresh = ServerProcess(
            self.name, self.argv, env, self.log_path, health_url=self.health_url, models_url=self.models_url,
            model_id=self.model_id, api_key=self._api_key, run_token=self.run_token, rpc_dir=rpc_dir,
        )  # fmt: skip
        fresh._inherit_fds = self._inherit_fds
        return fresh

    def stop(self, grace: float = DEFAULT_STOP_GRACE) -> StopReport:
        """Stop the server and everything it started; idempotent (later calls return the first report).

        SIGTERM to the process group and to escaped descendants (found by ``PDSERVE_SERVER_TOKEN`` and
        by a ppid-tree snapshot), wait up to ``grace`` seconds, SIGKILL what is left, rescan, reap.

        :param grace: seconds between SIGTERM and SIGKILL; 0 kills at once.
        """
        if self._stop_report is not None:
            return self._stop_report
        if not self.owner.here:  # a forked child's copy: the server is its parent's to stop (common/owner.py)
            why = f"not stopped: pid {os.getpid()} did not start it (pid {self.owner.pid} did)"
            return StopReport(self.name, self.pid, None, False, 0.0, False, (), (), 0.0, (why,))
        t0 = time.monotonic()
        if self._popen is None:
            remove_rpc_dir(self.rpc_dir)  # made for a server that never started
            self._stop_report = StopReport(self.name, None, None, False, 0.0, False, (), (), 0.0)
            return self._stop_report
        popen = self._popen
        exited_before = popen.poll() is not None
        errors: list[str] = []
        # Snapshot the tree *before* signalling: once the leader dies its children are reparented
        # and the ppid chain to them is lost.
        tree: dict[int, int] = {}
        try:
            tree = descendants(popen.pid, proc_table())
        except OSError as exc:
            errors.append(f"snapshot of the process tree failed: {exc}")
        result = None
        if self._paused and not exited_before:
            # A stopped process acts on SIGTERM only once continued: without this the grace would run out.
            with contextlib.suppress(Exception):
                self.resume()
        try:
            result = terminate([popen.pid], env=[(SERVER_TOKEN_ENV, self.server_token)], extra=tree, grace=grace)
        except Exception as exc:  # best effort: still try to reap below
            errors.append(f"terminate failed: {exc!r}")
            log.exception("%s: terminating the process tree failed", self.name)
            with contextlib.suppress(OSError):
                os.killpg(popen.pid, 9)
        try:
            popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            errors.append(f"pid {popen.pid} not reaped within 10 s of SIGKILL (D state?)")
        for msg in errors:
            log.warning("%s: %s", self.name, msg)
        remove_rpc_dir(self.rpc_dir)  # its sockets: the processes that bound them are gone
        self._stop_report = StopReport(
            name=self.name,
            pid=popen.pid,
            returncode=popen.poll(),
            exited_before_stop=exited_before,
            term_seconds=result.term_seconds if result else 0.0,
            sigkill_needed=result.killed if result else True,
            swept_pids=result.swept if result else (),
            remaining_pids=result.remaining if result else (),
            total_seconds=time.monotonic() - t0,
            errors=tuple(errors),
        )
        _live.discard(self)
        log.info("stopped %s: %s", self.name, self._stop_report)
        return self._stop_report

    def _kill_now(self) -> None:
        """Failed start: kill the tree at once (no grace); a later stop() returns this report."""
        self.stop(grace=0)

    def __enter__(self) -> ServerProcess:
        """Start (not wait): ``with ServerProcess(...).start() as srv`` is also fine."""
        if self._popen is None:
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Stop with :data:`DEFAULT_STOP_GRACE`."""
        self.stop()

    def __repr__(self) -> str:
        return f"<ServerProcess {self.name} pid={self.pid} alive={self.alive}>"


def wait_all_ready(
    processes: Iterable[ServerProcess],
    deadline: float,
    on_progress: ProgressCallback | None = None,
) -> dict[str, float]:
    """Wait for several started servers at once; return ``{name: seconds from start to ready}``.

    All are polled in one loop, so a server that exits fails the wait at once (with that server's log
    tail) instead of after the others' timeouts. The *other* servers are left running: the caller
    stops them (``stop()`` is idempotent). On timeout every server that is not ready is killed first.

    :param deadline: ``time.monotonic()`` timestamp.
    :param on_progress: called about once per second per waiting server.
    :raises ServerExitedEarly: the first server found exited.
    :raises ServerStartupTimeout: the deadline passed (for the first server not ready).
    """
    procs = list(processes)
    last_progress = {p.name: time.monotonic() for p in procs}
    fast_until = 0.0
    with readiness_client() as client, LogWakeup(p.log_path for p in procs) as wakeup:
        for _ in range(100_000_000):  # bounded by the deadline; the count only guards the loop
            pending = [p for p in procs if not p.poll_ready(client)]
            if not pending:
                break
            now = time.monotonic()
            if now >= deadline:
                _timeout(pending, now)
            if on_progress is not None:
                for p in pending:
                    if now - last_progress[p.name] >= _PROGRESS_EVERY:
                        last_progress[p.name] = now
                        on_progress(p.name, now - p.started_at, p.log_tail(1).strip())
            waited = now - min(p.started_at for p in pending)
            interval = FAST_POLL_S if now < fast_until else poll_interval(waited)
            if wakeup.sleep(min(interval, max(0.0, deadline - now))):
                # A log line: probe soon and often for a while; at least FAST_POLL_S apart, whatever the log does.
                fast_until = time.monotonic() + FAST_WINDOW_S
                time.sleep(FAST_POLL_S)
    return {p.name: p.ready_seconds() for p in procs}


def _timeout(pending: list[ServerProcess], now: float) -> None:
    for p in pending:
        p._kill_now()  # kill first, then raise: a failed start must not leave an orphan
    first = pending[0]
    tail, hint = first.failure_tail()
    raise ServerStartupTimeout(
        first.name,
        now - first.started_at,
        first._readiness.waiting_for,
        tail,
        hint,
        str(first.log_path),
    )


# ---------------------------------------------------------------------------------------- helpers


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.hostname is None:
        raise ValueError(f"health_url {url!r} has no host; expected http://HOST:PORT/health")
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def _answers(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on host:port right now."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@atexit.register
def _atexit_stop() -> None:
    """Safety net for an interpreter that exits normally with servers still running (not the primary
    mechanism: fixtures stop their servers; the watchdog covers hard deaths)."""
    for proc in list(_live):
        with contextlib.suppress(Exception):
            proc.stop(grace=2.0)
