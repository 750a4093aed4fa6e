"""A cluster whose server died mid-session says so: one error naming the server, when it died and its last lines.

Without this, an engine that dies under a test (vLLM's ``Worker proc VllmWorker-0 died unexpectedly``, then
``EngineDeadError``) surfaces as a bare HTTP 500 from decode or a 502 from the proxy, and every later test
waits for its own timeout. Every httpx client the plugin hands out (the cluster's, each server's) goes through
:class:`GuardedTransport`: after a 5xx answer or a transport error it probes the cluster; if a server has
exited or its ``/health`` no longer answers 200, the request raises :class:`ServerDied`, and from then on
every request to that cluster, and every fixture that would hand it out, raises the same error at once.
A 5xx from a cluster whose servers are all healthy (a KV load failure with ``kv_load_failure_policy=fail``)
is passed through unchanged. A server the test paused, killed or is restarting on purpose (``ServerHandle.pause`` /
``kill`` / ``restart`` / ``expect_down``: :attr:`ClusterHealth.expected`) is neither probed nor a death: what the
requests meet then is passed through for the test to assert on. [pytest-free]
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import httpx

from pytest_pdserve import clients
from pytest_pdserve.common.deadline import get_within
from pytest_pdserve.errors import ClusterStopped, ServerDied, describe_returncode
from pytest_pdserve.running.hints import hint_for, lead_with_root_cause

if TYPE_CHECKING:
    from pytest_pdserve.running.process import ServerProcess

__all__ = ["AsyncGuardedTransport", "ClusterHealth", "GuardedTransport", "death_excerpt"]

#: How long a server that stopped answering /health may take to exit, so the error can carry its exit code
#: (vLLM's API server shuts itself down within about a second of EngineDeadError).
EXIT_WAIT_S = 5.0
#: /health probe timeout per server. A live server answers in milliseconds quiet, in seconds on a loaded machine,
#: where a 2 s bound declared a live server dead; only a hung one, which no test survives anyway, waits it out.
PROBE_TIMEOUT_S = 30.0
_TAIL_LINES = 15
#: Lines that say why an engine died, best first; the first line of the best kind found leads the excerpt.
_DEATH_LINES = tuple(
    re.compile(p)
    for p in (
        r"died unexpectedly|Segmentation fault|Illegal instruction|core dumped|out of memory|OutOfMemory",
        r"encountered a fatal error",
        r"EngineDeadError",
    )
)


class _Server(Protocol):
    """What the probe needs of a server handle (cluster.ServerHandle)."""

    @property
    def name(self) -> str: ...

    url: str
    log_path: Path | None
    process: ServerProcess | None

    @property
    def headers(self) -> dict[str, str]: ...


@dataclass
class ClusterHealth:
    """The liveness verdict of one cluster, shared by all of its clients."""

    cluster: str
    #: The cluster's servers now (a callable: attach mode puts its proxy in after the cluster exists).
    servers: Callable[[], Sequence[_Server]]
    died: ServerDied | None = None
    #: Servers down on purpose, name -> why (``ServerHandle.pause``, ``kill``, ``restart``, ``expect_down``).
    expected: dict[str, str] = field(default_factory=dict)
    #: Set when pdserve itself stopped the cluster (to free its GPUs, or asked to): not a death, and no probe.
    stopped: ClusterStopped | None = None

    def raise_if_dead(self) -> None:
        if self.stopped is not None:
            raise self.stopped
        if self.died is not None:
            raise self.died

    def check(self, seen_as: str) -> None:
        """Probe every server after a suspicious answer; raise :class:`ServerDied` if one is dead."""
        if self.stopped is not None:
            raise self.stopped
        if self.died is not None:
            raise self.died
        victim = self._find_dead()
        if victim is None:
            return
        server, what = victim
        log_text = _read_tail(server.log_path)
        # pytest names the running test and phase here ("tests/test_x.py::test_y (call)").
        test = os.environ.get("PYTEST_CURRENT_TEST", "")
        where = f"{test}, {seen_as}" if test else seen_as
        self.died = ServerDied(
            self.cluster, server.name, what, _death_time(server), death_excerpt(log_text), hint_for(log_text),
            server.log_path, where,
        )  # fmt: skip
        raise self.died

    def _find_dead(self) -> tuple[_Server, str] | None:
        unhealthy: list[tuple[_Server, str]] = []
        for server in self.servers():
            if server.name in self.expected:
                continue  # down on purpose: what its requests meet is the test's to see
            proc = server.process
            if proc is not None and proc.returncode is not None:
                return server, f"exited with {describe_returncode(proc.returncode)}"
            status = _probe(server)
            if status is not None:
                unhealthy.append((server, status))
        if not unhealthy:
            return None
        server, status = unhealthy[0]
        proc = server.process
        if proc is not None:
            # Alive but unhealthy: vLLM's API server exits shortly after its engine died; wait for the code.
            deadline = time.monotonic() + EXIT_WAIT_S
            while proc.returncode is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if proc.returncode is not None:
                return server, f"exited with {describe_returncode(proc.returncode)}"
        return server, f"stopped answering ({status})"


def _verdict(
    health: ClusterHealth,
    request: httpx.Request,
    client_of: str,
    response: httpx.Response | None = None,
    error: httpx.TransportError | None = None,
) -> ServerDied | None:
    """The death that explains a request's outcome, or None: the one rule both transports follow.

    Only a transport error or a 5xx makes the cluster's servers be probed; any other answer, and an error of a
    healthy cluster, is the caller's to see.
    """
    if error is not None:
        outcome = type(error).__name__
    elif response is not None and response.status_code >= 500:
        outcome = f"HTTP {response.status_code}"
    else:
        return None
    try:
        health.check(f"{request.method} {request.url.path} via {client_of}: {outcome}")
    except ServerDied as died:
        return died
    return None


class GuardedTransport(httpx.BaseTransport):
    """An httpx transport that turns a dead cluster into :class:`ServerDied` (see the module docstring)."""

    def __init__(self, health: ClusterHealth, client_of: str, inner: httpx.BaseTransport | None = None) -> None:
        self._health = health
        self._client_of = client_of
        self._inner = inner or clients.http_transport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self._health.raise_if_dead()
        try:
            response = self._inner.handle_request(request)
        except httpx.TransportError as exc:
            died = _verdict(self._health, request, self._client_of, error=exc)
            if died is not None:
                raise died from None
            raise
        died = _verdict(self._health, request, self._client_of, response=response)
        if died is not None:
            response.close()
            raise died
        return response

    def close(self) -> None:
        self._inner.close()


class AsyncGuardedTransport(httpx.AsyncBaseTransport):
    """The async twin of :class:`GuardedTransport` (the probe itself is short and synchronous)."""

    def __init__(self, health: ClusterHealth, client_of: str, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self._health = health
        self._client_of = client_of
        self._inner = inner or clients.async_http_transport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self._health.raise_if_dead()
        try:
            response = await self._inner.handle_async_request(request)
        except httpx.TransportError as exc:
            died = _verdict(self._health, request, self._client_of, error=exc)
            if died is not None:
                raise died from None
            raise
        died = _verdict(self._health, request, self._client_of, response=response)
        if died is not None:
            await response.aclose()
            raise died
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def _probe(server: _Server) -> str | None:
    """None when the server's health route answers, else what it did.

    The route is the one its readiness used (a ``--pd-proxy-command`` proxy such as vLLM's toy proxy serves only
    ``/healthcheck``). Only a refused connection, a timeout or a 5xx (vLLM answers 503 once its engine is dead)
    counts: a 404 from a proxy without ``/health`` is no death.
    """
    proc = server.process
    url = proc.health_url if proc is not None and proc.health_url else f"{server.url}/health"
    path = httpx.URL(url).path
    try:
        with httpx.Client(
            timeout=PROBE_TIMEOUT_S, trust_env=False, headers=server.headers, transport=clients.http_transport()
        ) as client:
            status = get_within(client, url, PROBE_TIMEOUT_S).status_code
    except httpx.HTTPError as exc:
        return f"GET {path}: {type(exc).__name__}"
    return f"GET {path}: HTTP {status}" if status >= 500 else None


def _death_time(server: _Server) -> str:
    """The log file's last write: a dying server's last words are written as it dies."""
    stamp = time.time()
    if server.log_path is not None:
        with contextlib.suppress(OSError):
            stamp = server.log_path.stat().st_mtime
    return _dt.datetime.fromtimestamp(stamp, _dt.timezone.utc).strftime("%H:%M:%S UTC")


def _read_tail(path: Path | None, max_bytes: int = 256 * 1024) -> str:
    if path is None:
        return ""
    try:
        with path.open("rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(max(0, size - max_bytes))
            return fh.read(max_bytes).decode("utf-8", "replace")  # bounded even if the log grows meanwhile
    except OSError:
        return ""


def death_excerpt(log_text: str, tail_lines: int = _TAIL_LINES) -> str:
    """vLLM's root cause (hints.root_cause: its last exception lines and the traceback's last frame), then the first
    line that says why the engine died (with the two after it), then the log's last lines."""
    return lead_with_root_cause(log_text, _death_lines(log_text, tail_lines))


def _death_lines(log_text: str, tail_lines: int) -> str:
    lines = log_text.rstrip("\n").splitlines()
    tail_start = max(0, len(lines) - tail_lines)
    first = None
    for pattern in _DEATH_LINES:
        first = next((i for i, line in enumerate(lines) if pattern.search(line)), None)
        if first is not None:
            break
    if first is None or first >= tail_start:
        return "\n".join(lines[tail_start:])
    lead = lines[first : min(first + 3, tail_start)]
    gap = ["[...]"] if first + 3 < tail_start else []
    return "\n".join([*lead, *gap, *lines[tail_start:]])
