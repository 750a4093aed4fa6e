"""The P/D proxy as a Starlette app: vLLM's toy proxy request flow, with errors passed through.

Per request to ``/v1/completions`` or ``/v1/chat/completions``:

1. a uuid4 ``X-Request-Id`` is chosen and sent to both servers;
2. a prefill server (round-robin) gets a copy of the body with ``kv_transfer_params``
   asking for a remote decode, ``stream=False``, ``max_tokens=1`` (and ``max_completion_tokens=1``
   if present), without ``stream_options``/``min_tokens``/``min_completion_tokens``;
3. the ``kv_transfer_params`` it returns (if any) go into the original body, which goes to a
   decode server (round-robin, independent of the prefill choice);
4. the decode answer is passed back: SSE streamed as it arrives, JSON as is.

An upstream HTTP error is returned with its own status and body; a connection error gives 502
with a JSON error naming the role and URL. One ``httpx.AsyncClient`` is shared by all requests.

What the proxy buffers (the prefill answer, a JSON decode answer, the model list) is bounded like every answer the
plugin reads (``common/deadline.py``: ``MAX_BODY_BYTES``); more is a 502 naming the server. A stream it passes
through is not: it holds one chunk at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal, TextIO, TypeVar
from urllib.parse import urlsplit

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pytest_pdserve.common.client_options import KEEPALIVE_EXPIRY_S
from pytest_pdserve.common.deadline import MAX_BODY_BYTES, refuse_unbounded
from pytest_pdserve.common.tls import ssl_context
from pytest_pdserve.errors import ResponseTooLarge

__all__ = ["PREFILL_KV_TRANSFER_PARAMS", "ProxyConfig", "create_app", "prefill_body"]

Role = Literal["prefill", "decode"]
#: The warm-up request's bound (a loopback exchange takes about a millisecond).
WARM_UP_TIMEOUT_S = 2.0
T = TypeVar("T")

PREFILL_KV_TRANSFER_PARAMS: Mapping[str, object] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What the prefill request carries (vLLM's toy_proxy_server.py, v0.33.0; byte-identical in v0.34.0)."""

#: Default of ``--upstream-timeout``: generation on a slow CPU can take minutes; ten without an answer is a hang.
UPSTREAM_TIMEOUT = 600.0

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)

# Response headers that describe the upstream connection, not the payload; Starlette sets its own.
_HOP_HEADERS = frozenset(
    {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding", "date", "server"}
)


#: Upstream connections open at once: each client request holds one (prefill, then decode), each a file descriptor
#: beside the client's own; well below a raised RLIMIT_NOFILE, far above what a test suite sends at once.
DEFAULT_MAX_UPSTREAM_CONNECTIONS = 512


@dataclass(frozen=True)
class ProxyConfig:
    """What the proxy routes to.

    :param prefill_urls: base URLs of the prefill servers (``http://127.0.0.1:8100``).
    :param decode_urls: base URLs of the decode servers.
    :param api_key: when set, upstream requests carry ``Authorization: Bearer <api_key>``;
        otherwise the client's own ``Authorization`` header is forwarded.
    :param log: where the one-line-per-request log goes (``None``: no log).
    :param max_upstream_connections: the upstream pool's bound (requests above it wait for a connection).
    :param upstream_timeout: seconds an upstream has for a whole answer (the prefill one, a decode answer's headers
        or its JSON body, the model list) and, in a stream, for each next chunk: a server that accepts and then
        stalls or trickles gets a 502, not a proxy waiting forever (httpx's own timeouts are per read).
    """

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    api_key: str | None = None
    log: TextIO | None = sys.stdout
    max_upstream_connections: int = DEFAULT_MAX_UPSTREAM_CONNECTIONS
    upstream_timeout: float = UPSTREAM_TIMEOUT

    def __post_init__(self) -> None:
        for role, urls in (("prefill", self.prefill_urls), ("decode", self.decode_urls)):
            if not urls:
                raise ValueError(f"the proxy needs at least one {role} URL; got none")
            for url in urls:
                parts = urlsplit(url)
                if parts.scheme not in ("http", "https") or not parts.hostname:
                    raise ValueError(f"{role} URL {url!r} is not valid; expected http://HOST:PORT or https://HOST:PORT")


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill request derived from a client body (a shallow copy; *body* is not modified)."""
    out = dict(body)
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    # The prefill server rejects these for a one-token request.
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(key, None)
    return out


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _error(status: int, message: str, *, kind: str, **extra: object) -> JSONResponse:
    # OpenAI-style error object, so OpenAI clients surface the message.
    return JSONResponse({"error": {"message": message, "type": kind, "code": status, **extra}}, status)


class _Upstreams:
    """Round-robin over one role's servers; safe without locks because it runs on one event loop."""

    def __init__(self, urls: tuple[str, ...]) -> None:
        self.urls = tuple(u.rstrip("/") for u in urls)
        self._next = 0

    def pick(self) -> str:
        url = self.urls[self._next % len(self.urls)]
        self._next += 1
        return url


class _Metrics:
    """The proxy's own counters, in a private registry (several apps may share a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "pdserve_proxy_requests",
            "Client requests handled by the proxy, by route and HTTP status.",
            ["route", "status"],
            registry=self.registry,
        )
        self.upstream_requests = Counter(
            "pdserve_proxy_upstream_requests",
            "Requests sent to upstream servers, by role and URL.",
            ["role", "url"],
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            "pdserve_proxy_upstream_errors",
            "Upstream failures (connection errors and HTTP errors), by role.",
            ["role", "kind"],
            registry=self.registry,
        )
        self.log_write_failures = Counter(
            "pdserve_proxy_log_write_failures",
            "Request log lines dropped because writing them failed (the answers were sent).",
            registry=self.registry,
        )
        self.latency = Histogram(
            "pdserve_proxy_request_duration_seconds",
            "Time from receiving a request to sending its last byte, by route.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )


class _Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefill = _Upstreams(config.prefill_urls)
        self.decode = _Upstreams(config.decode_urls)
        self.metrics = _Metrics()
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("the proxy's HTTP client is not open (the app lifespan did not run)")
        return self._client

    @asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        # keepalive_expiry well below the servers' keep-alive so we never reuse a socket the upstream is closing
        # (config/bounds.py says why); no timeout because generation can legitimately take minutes.
        # A bounded pool: above it requests wait for a connection (no timeout) instead of failing with ConnectError
        # when the process runs out of file descriptors (issue 25 class 6).
        limits = httpx.Limits(
            max_connections=self.config.max_upstream_connections,
            max_keepalive_connections=None,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        )
        async with httpx.AsyncClient(timeout=None, limits=limits, trust_env=False, verify=ssl_context()) as client:
            await _warm_up()
            self._client = client
            try:
                yield
            finally:
                self._client = None

    def _headers(self, request: Request, request_id: str) -> dict[str, str]:
        # identity: what is read is what is counted (common/deadline.py)
        headers = {"content-type": "application/json", "x-request-id": request_id, "accept-encoding": "identity"}
        if self.config.api_key is not None:
            headers["authorization"] = f"Bearer {self.config.api_key}"
        elif "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        return headers

    def _log(self, line: str) -> None:
        """Write one log line; a failed write (a full disk, ``ulimit -f``: EFBIG) drops it, never the answer."""
        if self.config.log is not None:
            try:
                self.config.log.write(line + "\n")
                self.config.log.flush()
            except (OSError, ValueError):
                self.metrics.log_write_failures.inc()

    def _finish(self, route: str, status: int, started: float, detail: str) -> None:
        elapsed = time.perf_counter() - started
        self.metrics.requests.labels(route, str(status)).inc()
        self.metrics.latency.labels(route).observe(elapsed)
        self._log(f"proxy {route} status={status} {detail} total_ms={elapsed * 1000:.1f}")

    async def _within(self, request: Awaitable[T]) -> T:
        """``await request`` within ``upstream_timeout`` (a total deadline); past it an ``httpx.ReadTimeout``, which
        every caller already answers as an upstream failure (502)."""
        try:
            return await asyncio.wait_for(request, self.config.upstream_timeout)
        except asyncio.TimeoutError:
            raise httpx.ReadTimeout(f"no complete answer within {self.config.upstream_timeout:g}s") from None

    async def _fetch(
        self, method: str, url: str, content: bytes | None, headers: Mapping[str, str]
    ) -> tuple[int, str, bytes]:
        """``(status, content type, body)`` of one upstream request, the body bounded (:func:`_read_bounded`)."""
        request = self.client.build_request(method, url, content=content, headers=headers)
        response = await self.client.send(request, stream=True)
        try:
            return response.status_code, response.headers.get("content-type", ""), await _read_bounded(response, url)
        finally:
            await response.aclose()

    def _upstream_failed(self, role: Role, url: str, exc: httpx.HTTPError | ResponseTooLarge) -> JSONResponse:
        too_large = isinstance(exc, ResponseTooLarge)
        self.metrics.upstream_errors.labels(role, "too_large" if too_large else "connection").inc()
        return _error(
            502,
            f"{role} server {url} failed: {type(exc).__name__}: {exc}",
            kind="upstream_too_large" if too_large else "upstream_connection_error",
            role=role,
            url=url,
        )

    async def handle(self, request: Request) -> Response:
        started = time.perf_counter()
        route = request.url.path
        request_id = str(uuid.uuid4())
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            response: Response = _error(400, f"request body is not valid JSON: {exc}", kind="invalid_request")
            self._finish(route, 400, started, f"id={request_id} bad-json")
            return response
        if not isinstance(body, dict):
            response = _error(400, "request body must be a JSON object", kind="invalid_request")
            self._finish(route, 400, started, f"id={request_id} bad-body")
            return response

        headers = self._headers(request, request_id)
        client = self.client

        # --- prefill ---
        p_url = self.prefill.pick()
        self.metrics.upstream_requests.labels("prefill", p_url).inc()
        p_started = time.perf_counter()
        try:
            p_status, p_type, p_body = await self._within(
                self._fetch("POST", p_url + route, _dumps(prefill_body(body)), headers)
            )
        except (httpx.HTTPError, ResponseTooLarge) as exc:
            response = self._upstream_failed("prefill", p_url, exc)
            self._finish(route, 502, started, f"id={request_id} prefill={p_url} error={type(exc).__name__}")
            return response
        p_ms = (time.perf_counter() - p_started) * 1000
        if p_status >= 400:
            self.metrics.upstream_errors.labels("prefill", "http").inc()
            self._finish(
                route,
                p_status,
                started,
                f"id={request_id} prefill={p_url} prefill_status={p_status} prefill_ms={p_ms:.1f}",
            )
            return Response(p_body, p_status, media_type=p_type or None)
        try:
            kv_params = json.loads(p_body).get("kv_transfer_params")
        except (ValueError, AttributeError):
            self.metrics.upstream_errors.labels("prefill", "bad_response").inc()
            response = _error(
                502,
                f"prefill server {p_url} returned a body that is not a JSON object: "
                f"{p_body[:200].decode(errors='replace')!r}",
                kind="upstream_bad_response",
                role="prefill",
                url=p_url,
            )
            self._finish(route, 502, started, f"id={request_id} prefill={p_url} bad-response")
            return response
        if kv_params:
            body["kv_transfer_params"] = kv_params
            d_content = _dumps(body)
        else:
            d_content = raw  # nothing to add: forward the client's bytes untouched

        # --- decode ---
        d_url = self.decode.pick()
        self.metrics.upstream_requests.labels("decode", d_url).inc()
        detail = f"id={request_id} prefill={p_url} prefill_ms={p_ms:.1f} decode={d_url}"
        try:
            d_req = client.build_request("POST", d_url + route, content=d_content, headers=headers)
            d_resp = await self._within(client.send(d_req, stream=True))
        except httpx.HTTPError as exc:
            response = self._upstream_failed("decode", d_url, exc)
            self._finish(route, 502, started, f"{detail} error={type(exc).__name__}")
            return response
        out_headers = {k: v for k, v in d_resp.headers.items() if k.lower() not in _HOP_HEADERS}
        out_headers["x-request-id"] = request_id
        if d_resp.status_code >= 400:
            self.metrics.upstream_errors.labels("decode", "http").inc()
        if d_resp.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(
                self._relay(d_resp, route, started, detail, d_url),
                status_code=d_resp.status_code,
                headers=out_headers,
            )
        try:
            content = await self._within(_read_bounded(d_resp, d_url + route))
        except (httpx.HTTPError, ResponseTooLarge) as exc:
            response = self._upstream_failed("decode", d_url, exc)
            self._finish(route, 502, started, f"{detail} error={type(exc).__name__}")
            return response
        finally:
            await d_resp.aclose()
        self._finish(route, d_resp.status_code, started, f"{detail} decode_status={d_resp.status_code}")
        return Response(content, d_resp.status_code, headers=out_headers)

    async def _relay(
        self, d_resp: httpx.Response, route: str, started: float, detail: str, d_url: str
    ) -> AsyncIterator[bytes]:
        status = d_resp.status_code
        note = ""
        try:
            chunks = d_resp.aiter_bytes()
            while True:
                try:
                    chunk = await self._within(chunks.__anext__())
                except StopAsyncIteration:
                    break
                yield chunk
        except httpx.HTTPError as exc:
            # Headers are already sent, so the status cannot change: end the stream with an
            # SSE error event that OpenAI clients raise on.
            self.metrics.upstream_errors.labels("decode", "connection").inc()
            note = f" error={type(exc).__name__}"
            message = f"decode server {d_url} failed mid-stream: {type(exc).__name__}: {exc}"
            yield b"data: " + _dumps({"error": {"message": message, "type": "upstream_connection_error"}})
            yield b"\n\n"
        finally:
            await d_resp.aclose()
            self._finish(route, status, started, f"{detail} decode_status={status} stream=1{note}")

    async def health(self, _request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "prefill_instances": len(self.prefill.urls),
                "decode_instances": len(self.decode.urls),
            }
        )

    async def models(self, request: Request) -> Response:
        # Readiness checks and OpenAI clients ask the proxy for the model list; decode serves it.
        url = self.decode.urls[0]
        try:
            headers = self._headers(request, str(uuid.uuid4()))
            status, kind, content = await self._within(self._fetch("GET", url + "/v1/models", None, headers))
        except (httpx.HTTPError, ResponseTooLarge) as exc:
            return self._upstream_failed("decode", url, exc)
        return Response(content, status, media_type=kind or None)

    async def prometheus(self, _request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _read_bounded(response: httpx.Response, url: str) -> bytes:
    """The whole body of an upstream answer the proxy must buffer, or `ResponseTooLarge` past ``MAX_BODY_BYTES``."""
    refuse_unbounded(response.headers, url)
    chunks: list[bytes] = []
    seen = 0
    async for chunk in response.aiter_raw():
        seen += len(chunk)
        if seen > MAX_BODY_BYTES:
            raise ResponseTooLarge(url, MAX_BODY_BYTES)
        chunks.append(chunk)
    return b"".join(chunks)


async def _warm_up() -> None:
    """One request over a throwaway loopback server before the proxy serves.

    Why: the first proxied request paid about 15 ms more than the next ones (anyio's socket modules imported, its
    getaddrinfo worker thread started, httpcore's first connection), and a cluster's start waits for exactly that
    request (the P/D-ready round trip). Every step is bounded by WARM_UP_TIMEOUT_S, also against another local
    process that connects to the throwaway port and holds the connection; a warm-up that fails costs nothing but
    that bound: the first request then pays as before.
    """

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WARM_UP_TIMEOUT_S)
            writer.write(b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n")
            await asyncio.wait_for(writer.drain(), WARM_UP_TIMEOUT_S)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()

    try:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
    except OSError:
        return
    try:
        port = server.sockets[0].getsockname()[1]
        async with httpx.AsyncClient(trust_env=False, timeout=WARM_UP_TIMEOUT_S, verify=ssl_context()) as warm:
            await warm.post(f"http://127.0.0.1:{port}/warm-up", json={})
    except (httpx.HTTPError, OSError):
        pass
    finally:
        server.close()
        with contextlib.suppress(asyncio.TimeoutError, OSError):
            await asyncio.wait_for(server.wait_closed(), WARM_UP_TIMEOUT_S)


def create_app(config: ProxyConfig) -> Starlette:
    """Build the proxy app; serve it with uvicorn (the lifespan opens the shared HTTP client)."""
    proxy = _Proxy(config)
    routes = [
        Route("/v1/completions", proxy.handle, methods=["POST"]),
        Route("/v1/chat/completions", proxy.handle, methods=["POST"]),
        Route("/health", proxy.health, methods=["GET"]),
        Route("/healthcheck", proxy.health, methods=["GET"]),
        Route("/v1/models", proxy.models, methods=["GET"]),
        Route("/metrics", proxy.prometheus, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=proxy.lifespan)
    app.state.proxy = proxy
    return app
