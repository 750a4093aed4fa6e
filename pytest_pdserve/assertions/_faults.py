"""What P/D must do about a fault a test caused on purpose (``ServerHandle.pause``/``kill``/``restart``).

* :func:`assert_fails_fast`: a request meets the fault and ends with an error that says something, not a hang.
* :func:`assert_pd_ready`: after a restart, KV moves from prefill into every decode server again.
* :func:`assert_kv_recomputed`: under ``kv_load_failure_policy=recompute`` the request was answered, and decode
  recomputed its prompt instead of loading it: a KV load was tried and failed, and no prompt token came from
  ``external_kv_transfer``. An accuracy check alone cannot tell that from a transfer (the answers are the same).

Pytest-free.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from pytest_pdserve.assertions._completions import complete
from pytest_pdserve.assertions._measure import ClusterLike, ServerLike, is_cluster, measured, servers_of
from pytest_pdserve.assertions._report import Check, failure, metric_check
from pytest_pdserve.clients import body_excerpt
from pytest_pdserve.common.deadline import within
from pytest_pdserve.metrics import NIXL_BYTES_SUM, NIXL_FAILED_TRANSFERS, PROMPT_TOKENS_BY_SOURCE, REQUEST_SUCCESS
from pytest_pdserve.prompts import words

T = TypeVar("T")

HANG_AFTER = 120.0
"""Seconds after which :func:`assert_fails_fast` calls a request hung: a failure answers at once (a refused
connection, a proxy's 502 for it), so this is a margin no loaded machine reaches, not a speed target. Read at call
time, like ``SETTLE_TIMEOUT``."""

SUCCEEDED_MESSAGE = "expected {target} to fail, but {path} answered HTTP 200: the fault did not reach the request"
HUNG_MESSAGE = (
    "{target} {path} did not answer within {hang_after:g} s: the request hung instead of failing with an error"
)
SILENT_MESSAGE = "{target} {path} failed ({how}) but said nothing about why: an empty error"
NOT_PD_READY_MESSAGE = "the cluster is not P/D-ready: requests through the proxy moved no KV into {servers}"
NOT_RECOMPUTED_MESSAGE = "the KV was not recomputed on decode: {reason}"


@dataclass(frozen=True)
class FastFailure:
    """How a request failed (:func:`assert_fails_fast`)."""

    #: The HTTP status, None when the connection itself failed.
    status: int | None
    #: The error body's first characters, or the transport error (``ConnectError: [Errno 111] ...``).
    error: str
    seconds: float


def _client_and_label(target: ServerLike | ClusterLike) -> tuple[httpx.Client, str]:
    if is_cluster(target):
        cluster: Any = target
        return cluster.client, f"the cluster's proxy ({cluster.proxy.url})"
    server: Any = target
    return server.client, f"{server.name} ({server.url})"


def assert_fails_fast(
    target: ServerLike | ClusterLike,
    request: Mapping[str, Any],
    *,
    endpoint: str | None = None,
    hang_after: float | None = None,
) -> FastFailure:
    """*request*, sent to *target* (a server, or a cluster: its proxy), must fail with an error that says why: an
    HTTP status but 200 with a body, or a failed connection, before :data:`HANG_AFTER` seconds. Returns how it
    failed (assert on ``error`` for the words you expect).

    A server the test paused or killed is expected down (``ServerHandle.pause``/``kill``), so its failure reaches the
    test as it is; a server that died *unexpectedly* still raises ``ServerDied``.
    """
    __tracebackhide__ = True
    if hang_after is None:
        from pytest_pdserve import assertions  # the package's knob, read at call time

        hang_after = assertions.HANG_AFTER
    client, label = _client_and_label(target)
    path = endpoint or ("/v1/chat/completions" if "messages" in request else "/v1/completions")
    started = time.monotonic()
    try:
        response = client.post(path, json=dict(request), extensions=within(hang_after))
    except httpx.TimeoutException:
        raise AssertionError(HUNG_MESSAGE.format(target=label, path=path, hang_after=hang_after)) from None
    except httpx.TransportError as exc:
        error = f"{type(exc).__name__}: {exc}".strip()
        if error.endswith(":"):
            raise AssertionError(SILENT_MESSAGE.format(target=label, path=path, how=type(exc).__name__)) from None
        return FastFailure(None, error, time.monotonic() - started)
    if response.status_code == 200:
        raise AssertionError(SUCCEEDED_MESSAGE.format(target=label, path=path))
    text = body_excerpt(response.text).strip()
    if not text:
        raise AssertionError(SILENT_MESSAGE.format(target=label, path=path, how=f"HTTP {response.status_code}"))
    return FastFailure(response.status_code, text, time.monotonic() - started)


def _kv_moved(server: ServerLike, deltas: Mapping[str, Any]) -> list[Check]:
    delta = deltas[server.name]
    return [
        metric_check(server.name, delta, NIXL_BYTES_SUM, ">", 0),
        metric_check(server.name, delta, PROMPT_TOKENS_BY_SOURCE, ">", 0, source="external_kv_transfer"),
    ]


def assert_pd_ready(cluster: ClusterLike, *, max_tokens: int = 1) -> None:
    """P/D works: one request per decode server through the proxy (the proxy takes turns), each under a
    ``cache_salt`` nobody else uses, and every decode server received KV over NIXL (``vllm:nixl_bytes_transferred``
    and ``external_kv_transfer`` prompt tokens went up). What a start checks before it hands a cluster out; after
    ``ServerHandle.restart`` it says the cluster recovered, not just that the server answers HTTP."""
    __tracebackhide__ = True
    salt = f"pdserve-pd-ready-{uuid.uuid4().hex}"
    servers = servers_of(cluster)
    checks: dict[str, list[Check]] = {}
    for i in range(len(cluster.decode)):
        body = {"model": cluster.model, "prompt": words(24, seed=2000 + i), "max_tokens": max_tokens,
                "temperature": 0.0, "cache_salt": salt}  # fmt: skip
        _, deltas = measured(servers, functools.partial(complete, cluster.client, body), requests=2)
        for server in cluster.decode:
            rows = _kv_moved(server, deltas)
            if all(r.ok for r in rows) or server.name not in checks:
                checks[server.name] = rows
    missing = [name for name, rows in checks.items() if not all(r.ok for r in rows)]
    if missing:
        raise failure(
            NOT_PD_READY_MESSAGE.format(servers=", ".join(missing)), [r for rows in checks.values() for r in rows]
        )


def assert_kv_recomputed(cluster: ClusterLike, act: Callable[[], T]) -> T:
    """``act()`` (the test's request: through the proxy, or by hand to prefill and then decode) must end with a
    decode server that recomputed the prompt instead of loading its KV, as ``kv_load_failure_policy=recompute`` does
    when the load fails: measured on the decode servers around ``act``, a request finished
    (``vllm:request_success``), a KV load was tried and failed (``vllm:nixl_num_failed_transfers``, which counts
    failed handshakes too), and no prompt token came from ``external_kv_transfer``. Returns what ``act`` returned.

    The prompt must be one the decode server has not cached: vLLM counts a load that failed after a local
    prefix-cache hit as external tokens (the request's prefill stats are set once, when it is first scheduled), so
    only a cold prompt shows the recompute as ``external_kv_transfer`` = 0.
    """
    __tracebackhide__ = True
    decode = list(cluster.decode)
    result, deltas = measured(decode, act, requests=1)
    checks: list[Check] = []
    for server in decode:
        delta = deltas[server.name]
        checks += [
            metric_check(server.name, delta, REQUEST_SUCCESS, ">", 0),
            metric_check(server.name, delta, NIXL_FAILED_TRANSFERS, ">", 0),
            metric_check(server.name, delta, PROMPT_TOKENS_BY_SOURCE, "==", 0, source="external_kv_transfer"),
        ]
    served = [c.server for c in checks if c.metric == REQUEST_SUCCESS and c.ok]
    if not served:
        raise failure(NOT_RECOMPUTED_MESSAGE.format(reason="no decode server finished a request"), checks)
    for name in served:
        rows = [c for c in checks if c.server == name]
        if all(r.ok for r in rows):
            return result
    bad = next(r for name in served for r in checks if r.server == name and not r.ok)
    reason = (
        "no KV load failed: it was not tried (did the request go through P/D?) or it succeeded"
        if bad.metric == NIXL_FAILED_TRANSFERS
        else "prompt tokens came from external_kv_transfer: KV was loaded (or the prompt had a local prefix-cache hit)"
    )
    raise failure(NOT_RECOMPUTED_MESSAGE.format(reason=reason), checks)
