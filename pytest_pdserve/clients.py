"""The httpx clients the plugin hands out (``ServerHandle.client``, ``async_client()``, ``cluster.client``).

Their transport does two things per request:

* **Per-test prefix-cache isolation.** A POST to a generation route whose JSON body has no ``cache_salt``
  gets the current test's salt. vLLM adds the salt to the extra keys of a request's *first* block hash
  (``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``), and every later block hash chains
  from it, so requests with different salts never share a prefix-cache block, while requests with the same
  salt share exactly as unsalted ones do. A body that already has the key keeps it: a test that wants to
  share passes its own salt (or ``None``: the unsalted cache everyone else without a salt uses).
* **A request timeout that names the server and the request**, instead of a bare ``httpx.ReadTimeout``.

The request helpers (``ServerHandle.complete`` / ``chat``, ``assertions.complete``, :func:`reset_prefix_cache`) share
one failure rule, :func:`request_failed` (any status but 200), and quote :data:`BODY_EXCERPT_CHARS` of a failed
answer's body.

The current salt is set by the plugin around each test (``fixtures.py``); outside a test it is ``None`` and
nothing is added. Requests you send with your own clients (``openai.OpenAI(base_url=cluster.base_url)``)
carry no salt: add ``extra_body={"cache_salt": pd_cache_salt}``. Pytest-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import httpx

from pytest_pdserve.common.client_options import OPTIONS, ClientOptions, salt_for, salted
from pytest_pdserve.common.deadline import TOTAL, bound_async, connection_limits, http_transport
from pytest_pdserve.common.tls import ssl_context
from pytest_pdserve.errors import PrefixCacheHeld, RequestFailed

__all__ = [
    "BODY_EXCERPT_CHARS",
    "OPTIONS",
    "PrefixCacheHeld",
    "REQUEST_TIMEOUT_MESSAGE",
    "SALTED_PATHS",
    "ClientOptions",
    "body_excerpt",
    "http_transport",  # defined in deadline.py; named here too, where callers looked for it before
    "make_async_client",
    "make_client",
    "request_failed",
    "reset_prefix_cache",
    "salt_for",
    "salted",
    "summarize",
]

SALTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
"""Routes whose requests read the prefix cache (``/tokenize`` and ``/metrics`` touch no cache)."""

CONNECT_TIMEOUT = 10.0
REQUEST_TIMEOUT_MESSAGE = "{server} did not answer {request} within {timeout:g} s ({kind}){remedy}"
RESET_FAILED_MESSAGE = "POST /reset_prefix_cache on {server} did not succeed: HTTP {status} {body}"

#: How much of a failed answer's body every request helper's error quotes (``ServerHandle.complete`` / ``chat``,
#: ``assertions.complete``, :func:`reset_prefix_cache`, stream error events). vLLM's error JSON
#: (``{"error": {"message", "type", "param", "code"}}``, a validation message listing its input) fits; an HTML page
#: from something else on the port, or a traceback, is cut.
BODY_EXCERPT_CHARS = 2000


def request_failed(response: httpx.Response) -> bool:
    """The one failure rule of the plugin's request helpers: any status but 200 is a failure.

    vLLM answers 200 on success and nothing else (its routes return ``JSONResponse(content=...)`` or a
    ``StreamingResponse``, and an ``ErrorResponse`` with its own code). A helper that took 201-399 as success would
    hand a test a redirect's or an empty 204's body as if it were an answer, and hide what sent it there.
    """
    return response.status_code != 200


def body_excerpt(text: str) -> str:
    """The start of a body for an error message (:data:`BODY_EXCERPT_CHARS`)."""
    return text[:BODY_EXCERPT_CHARS]


def _timeout() -> httpx.Timeout:
    return httpx.Timeout(OPTIONS.request_timeout, connect=min(CONNECT_TIMEOUT, OPTIONS.request_timeout))


def _with_salt(request: httpx.Request) -> httpx.Request:
    salt = OPTIONS.salt
    if salt is None or request.method != "POST" or request.url.path not in SALTED_PATHS:
        return request
    try:
        body = json.loads(request.content)
    except (httpx.RequestNotRead, ValueError):
        return request  # a streamed or non-JSON body is sent as is
    if not isinstance(body, dict) or "cache_salt" in body:
        return request
    body["cache_salt"] = salt
    headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() != "content-length"]
    return httpx.Request(
        request.method, request.url, headers=headers, content=json.dumps(body).encode(), extensions=request.extensions
    )


def _short(value: Any, limit: int = 48) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def summarize(request: httpx.Request) -> str:
    """``POST /v1/completions {"prompt": "red hat..." (812 chars), "max_tokens": 16}``: the request, briefly."""
    head = f"{request.method} {request.url.path}"
    try:
        body = json.loads(request.content) if request.content else None
    except (httpx.RequestNotRead, ValueError):
        return head
    if not isinstance(body, Mapping):
        return head
    parts = []
    for key, value in body.items():
        if key == "messages" and isinstance(value, list):
            parts.append(f'"messages": [{len(value)} messages]')
        elif isinstance(value, (dict, list)) and key != "prompt":
            parts.append(f'"{key}": ...')
        else:
            parts.append(f'"{key}": {_short(value)}')
    return f"{head} {{{', '.join(parts)}}}"


def _timed_out(exc: httpx.TimeoutException, server: str, request: httpx.Request) -> httpx.TimeoutException:
    """The same exception type (callers catching httpx.TimeoutException still do), with a message that says who."""
    if TOTAL in request.extensions:  # the plugin's own check with its total deadline, not the request timeout
        return type(exc)(f"{server}: {summarize(request)}: {exc}", request=request)
    message = REQUEST_TIMEOUT_MESSAGE.format(
        server=server,
        request=summarize(request),
        timeout=OPTIONS.request_timeout,
        kind=type(exc).__name__,
        remedy=OPTIONS.timeout_remedy,
    )
    return type(exc)(message, request=request)


class _Transport(httpx.BaseTransport):
    def __init__(self, server: str, inner: httpx.BaseTransport | None = None) -> None:
        self._server = server
        self._inner = inner or http_transport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request = _with_salt(request)
        try:
            return self._inner.handle_request(request)
        except httpx.TimeoutException as exc:
            raise _timed_out(exc, self._server, request) from exc

    def close(self) -> None:
        self._inner.close()


class _AsyncTransport(httpx.AsyncBaseTransport):
    def __init__(self, server: str, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self._server = server
        self._inner = inner or async_http_transport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request = _with_salt(request)
        try:
            return await bound_async(request, self._inner.handle_async_request)  # bounded as the sync clients
        except httpx.TimeoutException as exc:
            raise _timed_out(exc, self._server, request) from exc

    async def aclose(self) -> None:
        await self._inner.aclose()


def async_http_transport() -> httpx.AsyncHTTPTransport:
    """An async transport that shares :func:`ssl_context` and the idle-connection expiry of :func:`http_transport`."""
    return httpx.AsyncHTTPTransport(verify=ssl_context(), limits=connection_limits())


def make_client(
    server: str, base_url: str, headers: Mapping[str, str], *, inner: httpx.BaseTransport | None = None
) -> httpx.Client:
    """A client for *server* (named in errors, e.g. ``decode-0 (http://127.0.0.1:8200)``).

    :param inner: the transport that really sends (default :func:`http_transport`; tests pass a mock).
    """
    # trust_env=False: a corporate HTTP(S)_PROXY must never see our loopback traffic.
    return httpx.Client(
        base_url=base_url,
        headers=dict(headers),
        timeout=_timeout(),
        trust_env=False,
        transport=_Transport(server, inner),
    )


def make_async_client(
    server: str,
    base_url: str,
    headers: Mapping[str, str],
    *,
    inner: httpx.AsyncBaseTransport | None = None,
    **kwargs: Any,
) -> httpx.AsyncClient:
    """An async client like :func:`make_client`; the caller closes it."""
    kwargs.setdefault("timeout", _timeout())
    kwargs.setdefault("transport", _AsyncTransport(server, inner))
    return httpx.AsyncClient(base_url=base_url, headers=dict(headers), trust_env=False, **kwargs)


def reset_prefix_cache(client: httpx.Client, server: str, *, reset_external: bool = True) -> bool:
    """``POST /reset_prefix_cache?reset_external=true``: True when reset, False when the server has no such route
    (vLLM serves it only with ``VLLM_SERVER_DEV_MODE=1``). :raises AssertionError: the server answered that it failed.

    ``reset_external`` (vLLM's query parameter; its default there is false) also empties the KV connector's own
    cache, an OffloadingConnector's CPU tier: without it a "cold" request still hits the blocks the tier kept.
    NixlConnector keeps none (its ``reset_cache`` is the no-op of ``KVConnectorBase_V1``), so it costs nothing.
    """
    __tracebackhide__ = True
    resp = client.post("/reset_prefix_cache", params={"reset_external": "true"} if reset_external else None)
    if resp.status_code in (404, 405):
        return False
    message = RESET_FAILED_MESSAGE.format(server=server, status=resp.status_code, body=body_excerpt(resp.text))
    if request_failed(resp):
        raise RequestFailed(message, resp.status_code)
    try:
        body = resp.json() if resp.content else None
    except ValueError:
        body = None
    if isinstance(body, Mapping) and body.get("success") is False:
        raise PrefixCacheHeld(f"{message} (KV blocks still in use: a running request, or a prefill whose KV no decode "
                              "has read yet, held for NixlConnector's kv_lease_duration)")  # fmt: skip
    return True
