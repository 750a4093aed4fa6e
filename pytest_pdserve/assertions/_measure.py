"""What the assertions need from a cluster, and its metrics measured around a request.

:class:`ServerLike` and :class:`ClusterLike` are Protocols that ``cluster.py`` implements, so the
assertions stay free of it. :func:`_measured` runs an action and waits (bounded by *timeout*) until
the servers' metrics show it, since vLLM records them after responding. The caller passes the
timeout: :mod:`pytest_pdserve.assertions` reads its ``SETTLE_TIMEOUT`` at call time. Pytest-free.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar

import httpx

from pytest_pdserve.metrics import (
    PREFIX_CACHE_QUERIES,
    REQUEST_SUCCESS,
    MetricsDelta,
    MetricsSettleTimeout,
    MetricsSnapshot,
    wait_settled,
)

T = TypeVar("T")

# ---------------------------------------------------------------------------------------------
# What the cluster must provide (cluster.py implements it; a Protocol keeps the assertions free of it)
# ---------------------------------------------------------------------------------------------


class ServerLike(Protocol):
    """One running server (or the proxy) as the cluster exposes it."""

    @property
    def role(self) -> str:
        """``"prefill"``, ``"decode"`` or ``"proxy"``."""

    @property
    def name(self) -> str:
        """E.g. ``"prefill-0"``."""

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""

    @property
    def client(self) -> httpx.Client:
        """An ``httpx.Client`` with ``base_url=url``."""

    def metrics(self) -> MetricsSnapshot:
        """A fresh scrape of ``/metrics``."""


class ClusterLike(Protocol):
    """A running P/D cluster: prefill and decode servers behind a proxy."""

    @property
    def prefill(self) -> Sequence[ServerLike]: ...

    @property
    def decode(self) -> Sequence[ServerLike]: ...

    @property
    def proxy(self) -> ServerLike: ...

    @property
    def model(self) -> str:
        """The served model id."""

    @property
    def block_size(self) -> int: ...

    @property
    def attention_backend(self) -> str | None: ...

    @property
    def engine(self) -> str:
        """``"vllm"`` or ``"sim"``."""

    @property
    def client(self) -> httpx.Client:
        """The proxy's client."""


def is_cluster(obj: object) -> bool:
    return hasattr(obj, "prefill") and hasattr(obj, "decode") and hasattr(obj, "proxy")


def servers_of(cluster: ClusterLike) -> list[ServerLike]:
    return [*cluster.prefill, *cluster.decode]


def summed(deltas: Mapping[str, MetricsDelta], name: str, **labels: str) -> float:
    return sum((d.get(name, **labels) or 0.0) for d in deltas.values())


# ---------------------------------------------------------------------------------------------
# Metrics around a request
# ---------------------------------------------------------------------------------------------


def _snapshots(servers: Sequence[ServerLike]) -> dict[str, MetricsSnapshot]:
    return {s.name: s.metrics() for s in servers}


def _advanced(before: Mapping[str, MetricsSnapshot], now: Mapping[str, MetricsSnapshot], name: str) -> float:
    total = 0.0
    for key, snap in now.items():
        after = snap.get(name)
        if after is not None:
            total += after - (before[key].get(name) or 0.0)
    return total


def _settle(
    servers: Sequence[ServerLike],
    before: Mapping[str, MetricsSnapshot],
    *,
    requests: int | None,
    timeout: float,
) -> dict[str, MetricsDelta]:
    """Wait until *servers* together count *requests* more finished requests, then until each
    server's counters are stable; return the deltas. ``requests=None`` waits for any prefix-cache
    query instead (when the caller does not know the count)."""
    __tracebackhide__ = True
    if not servers:
        return {}
    metric = REQUEST_SUCCESS if requests is not None else PREFIX_CACHE_QUERIES
    needed = float(requests) if requests is not None else 1.0
    deadline = time.monotonic() + timeout
    now = _snapshots(servers)
    watchable = any(snap.has(metric) for snap in now.values())
    while watchable and _advanced(before, now, metric) < needed and time.monotonic() < deadline:
        time.sleep(0.02)
        now = _snapshots(servers)
    deltas: dict[str, MetricsDelta] = {}
    for server in servers:
        # Stability catches counters recorded just after request_success (the NIXL stats).
        settled = wait_settled(server.metrics, timeout=timeout, stable_for=2)
        deltas[server.name] = settled - before[server.name]
    return deltas


def measure_around(
    servers: Sequence[ServerLike], action: Callable[[], T], *, requests: int | None, timeout: float
) -> tuple[T, dict[str, MetricsDelta]]:
    __tracebackhide__ = True
    before = _snapshots(servers)
    result = action()
    try:
        return result, _settle(servers, before, requests=requests, timeout=timeout)
    except MetricsSettleTimeout as exc:
        raise AssertionError(str(exc)) from exc


def measured(
    servers: Sequence[ServerLike], action: Callable[[], T], *, requests: int | None
) -> tuple[T, dict[str, MetricsDelta]]:
    """:func:`measure_around` within ``pytest_pdserve.assertions.SETTLE_TIMEOUT``, read at call time so a suite
    (or a test's monkeypatch) can raise it."""
    __tracebackhide__ = True
    from pytest_pdserve import assertions  # the package's knob, read at call time (a monkeypatch may raise it)

    return measure_around(servers, action, requests=requests, timeout=assertions.SETTLE_TIMEOUT)
