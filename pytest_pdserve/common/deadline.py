"""A request with a total deadline and a bounded body: the one way the plugin's own checks talk HTTP. [pytest-free]

**Time.** httpx's timeouts are per operation: a read timeout of 2 s is met by a server that sends one byte every
second, so an attach target that sends its headers and then trickles its body held the attach check forever.
:func:`get_within` gives a GET a deadline for the whole exchange (connecting, headers, body): at the deadline the
request's socket is shut down, which ends a read blocked in any phase, and the call raises ``httpx.ReadTimeout``
saying so.

**Size.** Every answer read through a client the plugin builds is bounded too: more than :data:`MAX_BODY_BYTES` of
one body raises :class:`~pytest_pdserve.errors.ResponseTooLarge` (``<url> sent more than N bytes``), whether the
body is read whole (a check) or as a stream (a test's own ``client.stream``), and a ``content-length`` above it is
refused before a byte is read. The rule: time is bounded by a deadline, size by this bound, so an attached server
that streams an endless ``/metrics`` fails the check with that message instead of ending in ``MemoryError``. The
plugin asks for ``accept-encoding: identity`` and refuses an answer encoded anyway: a compressed body's decoded
size cannot be bounded by the bytes read. ``ResponseTooLarge`` is no ``httpx.HTTPError``, so no caller that retries
a failed request (the readiness poll) or treats one as "not there" (a best-effort check) reads the stream again.
The built-in proxy (``proxy/app.py``) applies the same bound to what it buffers (the prefill answer, a JSON decode
answer, the model list), not to a stream it passes through.

It works through :class:`DeadlineTransport`, which :func:`http_transport` returns, so every
client the plugin builds (readiness, health probes, each server's ``client``) honours a request that carries the
:data:`TOTAL` extension; a request without it (a test's own, a long stream) keeps httpx's own timeouts.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any

import httpx

from pytest_pdserve.common.client_options import KEEPALIVE_EXPIRY_S
from pytest_pdserve.common.tls import ssl_context
from pytest_pdserve.errors import ResponseTooLarge

__all__ = [
    "MAX_BODY",
    "MAX_BODY_BYTES",
    "TOTAL",
    "DeadlineTransport",
    "bound_async",
    "connection_limits",
    "get_within",
    "http_transport",
    "refuse_unbounded",
    "within",
]


log = logging.getLogger(__name__)

#: The request extension naming the whole exchange's deadline, in seconds.
TOTAL = "pdserve.total_timeout"

#: The most bytes the plugin reads of one answer (the plugin's clients and the built-in proxy's buffers). Why 64 MiB:
#: a real vLLM's ``/metrics`` is about 100 KB (a few MB with many LoRA adapters or label values), its model list and
#: health answers are bytes, and a completion that large would need tens of thousands of prompt logprobs; far
#: below, on any test machine, the memory whose exhaustion (``MemoryError``) a hostile server could otherwise cause.
MAX_BODY_BYTES = 64 << 20
#: The request extension that sets one request's bound in bytes, when it must differ from :data:`MAX_BODY_BYTES`.
MAX_BODY = "pdserve.max_body_bytes"

_IDENTITY = ("", "identity")


def within(seconds: float) -> dict[str, Any]:
    """The ``extensions=`` of a request that must be answered entirely within ``seconds``."""
    return {TOTAL: float(seconds)}


def get_within(
    client: httpx.Client | None, url: str, total: float, headers: Mapping[str, str] | None = None
) -> httpx.Response:
    """``GET url``, answered in full within ``total`` seconds, or ``httpx.ReadTimeout`` (an ``httpx.HTTPError``).

    :param client: a client built on :func:`http_transport` (each server's ``client``, the readiness client), or
        None for a one-off client (no proxy from the environment).
    """
    if client is None:
        with httpx.Client(trust_env=False, transport=http_transport()) as one_off:
            return get_within(one_off, url, total, headers)
    return client.get(url, headers=headers, timeout=total, extensions=within(total))


class _Cutter:
    """The sockets of one request, shut down when its deadline passes (from a timer thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self.fired = False
        self._done = False

    def add(self, stream: Any) -> None:
        sock = stream.get_extra_info("socket") if stream is not None else None
        if not isinstance(sock, socket.socket):
            return
        with self._lock:
            self._socks.append(sock)
            if self.fired:
                self._cut(sock)

    def done(self) -> None:
        """The answer is complete: a timer firing now must not cut a connection the pool may hand out again."""
        with self._lock:
            self._done = True
            self._socks.clear()  # it may wait on the alarm heap until its deadline: hold no sockets meanwhile

    def is_done(self) -> bool:
        return self._done

    def fire(self) -> None:
        with self._lock:
            if self._done:
                return
            self.fired = True
            for sock in self._socks:
                self._cut(sock)

    @staticmethod
    def _cut(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # a blocked recv returns at once; the pool drops the connection

    def trace(self, outer: Callable[[str, dict[str, Any]], None] | None) -> Callable[[str, dict[str, Any]], None]:
        def trace(event: str, info: dict[str, Any]) -> None:
            if event == "connection.connect_tcp.complete":
                self.add(info.get("return_value"))
            if outer is not None:
                outer(event, info)

        return trace


class _Alarms:
    """One thread per process that fires every pending request's cutter at its deadline.

    A ``threading.Timer`` per request cost a thread start and its join, about 0.35 ms a request (measured: 0.54 ms
    per keep-alive GET without a deadline, 0.91 ms with), which the readiness poll and every scrape paid. Here a
    request only pushes its deadline on a heap; the thread sleeps until the earliest one. Fork-safe: a forked child
    starts with no thread and no alarms (the parent's requests are not its own).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, _Cutter]] = []
        self._count = 0
        self._thread: threading.Thread | None = None

    def set(self, seconds: float, cutter: _Cutter) -> None:
        """Fire ``cutter`` in ``seconds`` unless it is done by then (a done cutter's fire does nothing)."""
        with self._cond:
            self._count += 1
            if len(self._heap) > _COMPACT_AT:  # answered requests wait for their deadline to be popped: drop them
                self._heap = [entry for entry in self._heap if not entry[2].is_done()]
                heapq.heapify(self._heap)
            earliest = not self._heap or time.monotonic() + seconds < self._heap[0][0]
            heapq.heappush(self._heap, (time.monotonic() + seconds, self._count, cutter))
            if self._thread is None or not self._thread.is_alive():  # first use, or (never seen) the thread died
                self._thread = threading.Thread(target=self._run, name="pdserve-deadlines", daemon=True)
                self._thread.start()
            elif earliest:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0][2].is_done():  # answered in time: nothing to cut
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                cutter = heapq.heappop(self._heap)[2]
            try:  # outside the lock: shutting a socket down must not hold up the next request's set()
                cutter.fire()
            except Exception:  # the thread serves every later deadline: one failed cut must not end it
                log.exception("cutting a request at its deadline failed")

    def reset_in_child(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap = []
        self._thread = None


_COMPACT_AT = 256
_ALARMS = _Alarms()
os.register_at_fork(after_in_child=_ALARMS.reset_in_child)


class DeadlineTransport(httpx.BaseTransport):
    """Passes requests to ``inner``; one carrying :data:`TOTAL` is answered in full within it, or raises
    ``httpx.ReadTimeout`` (the body is read here, so the caller gets a complete response or none)."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self._inner = inner

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        limit = int(request.extensions.get(MAX_BODY, MAX_BODY_BYTES))
        request.headers["accept-encoding"] = "identity"  # a compressed body's decoded size is not the bytes read
        total = request.extensions.get(TOTAL)
        if total is None:
            response = self._inner.handle_request(request)
            _refuse_before_reading(response, request, limit)
            response.stream = _BoundedStream(response.stream, limit, str(request.url))  # type: ignore[arg-type]
            return response
        deadline = time.monotonic() + float(total)
        # A pooled connection makes no connect event, so the cutter has no socket to shut down until the headers
        # come: httpcore's own per-operation timeouts, capped at the deadline, end a wait for headers that never
        # come (a paused server) on such a connection too.
        timeouts = dict(request.extensions.get("timeout") or {})
        for phase in ("connect", "read", "write", "pool"):
            given = timeouts.get(phase)
            timeouts[phase] = float(total) if given is None else min(float(given), float(total))
        request.extensions["timeout"] = timeouts
        cutter = _Cutter()
        request.extensions["trace"] = cutter.trace(request.extensions.get("trace"))
        _ALARMS.set(float(total), cutter)

        def late() -> httpx.ReadTimeout:
            return httpx.ReadTimeout(f"no complete answer within {float(total):g}s", request=request)

        try:
            response = self._inner.handle_request(request)
            cutter.add(response.extensions.get("network_stream"))  # a pooled connection made no connect event
            try:
                _refuse_before_reading(response, request, limit)
                chunks = []
                for chunk in _BoundedStream(response.stream, limit, str(request.url)):  # type: ignore[arg-type]
                    chunks.append(chunk)
                    if time.monotonic() > deadline:
                        raise late()
            finally:
                cutter.done()  # before the connection goes back to the pool
                response.close()
        except httpx.TransportError:
            if cutter.fired or time.monotonic() > deadline:
                raise late() from None
            raise
        finally:
            cutter.done()
        return httpx.Response(
            response.status_code, headers=response.headers, content=b"".join(chunks), request=request,
            extensions={k: v for k, v in response.extensions.items() if k != "network_stream"},
        )  # fmt: skip

    def close(self) -> None:
        self._inner.close()


def refuse_unbounded(headers: httpx.Headers, url: str, limit: int = MAX_BODY_BYTES) -> None:
    """Raise `ResponseTooLarge` for a body that says it is over ``limit``, or is encoded (its decoded size is not the
    bytes read), before a byte of it is read. The built-in proxy calls it too."""
    why = None
    declared = headers.get("content-length", "").strip()
    if declared.isdigit() and int(declared) > limit:
        why = f"its content-length says {declared}"
    elif (encoding := headers.get("content-encoding", "").strip().lower()) not in _IDENTITY:
        why = f"an answer encoded {encoding!r}, which pdserve did not ask for (accept-encoding: identity)"
    if why is not None:
        raise ResponseTooLarge(url, limit, why)


def _refuse_before_reading(response: httpx.Response, request: httpx.Request, limit: int) -> None:
    try:
        refuse_unbounded(response.headers, str(request.url), limit)
    except ResponseTooLarge:
        response.close()
        raise


class _BoundedStream(httpx.SyncByteStream):
    """A response body that raises `ResponseTooLarge` once more than ``limit`` bytes came."""

    def __init__(self, inner: httpx.SyncByteStream, limit: int, url: str) -> None:
        self._inner = inner
        self._limit = limit
        self._url = url

    def __iter__(self) -> Iterator[bytes]:
        seen = 0
        for chunk in self._inner:
            seen += len(chunk)
            if seen > self._limit:
                raise ResponseTooLarge(self._url, self._limit)
            yield chunk

    def close(self) -> None:
        self._inner.close()


async def bound_async(
    request: httpx.Request, send: Callable[[httpx.Request], Awaitable[httpx.Response]]
) -> httpx.Response:
    """The same bound for the async clients the plugin hands out (``clients.make_async_client``): ``send(request)``
    asking for no encoding, its answer refused unread or counted as it is read."""
    limit = int(request.extensions.get(MAX_BODY, MAX_BODY_BYTES))
    request.headers["accept-encoding"] = "identity"
    response = await send(request)
    try:
        refuse_unbounded(response.headers, str(request.url), limit)
    except ResponseTooLarge:
        await response.aclose()
        raise
    response.stream = _AsyncBoundedStream(response.stream, limit, str(request.url))  # type: ignore[arg-type]
    return response


class _AsyncBoundedStream(httpx.AsyncByteStream):
    """The async twin of :class:`_BoundedStream`."""

    def __init__(self, inner: httpx.AsyncByteStream, limit: int, url: str) -> None:
        self._inner = inner
        self._limit = limit
        self._url = url

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in self._inner:
            seen += len(chunk)
            if seen > self._limit:
                raise ResponseTooLarge(self._url, self._limit)
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


def connection_limits() -> httpx.Limits:
    """httpx's default pool limits, with idle connections dropped after :data:`KEEPALIVE_EXPIRY_S`."""
    return httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_EXPIRY_S)


def http_transport() -> httpx.BaseTransport:
    """The plugin's plain transport: shares :func:`ssl_context`, drops idle connections before a server would
    (``common/client_options.py``: ``KEEPALIVE_EXPIRY_S``) and honours a total deadline (:func:`within`)."""
    return DeadlineTransport(httpx.HTTPTransport(verify=ssl_context(), limits=connection_limits()))
