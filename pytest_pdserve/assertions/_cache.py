"""Cache and transfer checks: prefix-cache hits, KV over NIXL, shrinking transfers, prompt-token sources."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from pytest_pdserve.assertions._completions import (
    complete,
    with_defaults,
)
from pytest_pdserve.assertions._measure import ClusterLike as PDCluster
from pytest_pdserve.assertions._measure import ServerLike as ServerHandle
from pytest_pdserve.assertions._measure import measured, servers_of
from pytest_pdserve.assertions._preconditions import (
    block_size_of,
    require_measurable,
    require_more_than_a_block,
    require_prefix,
)
from pytest_pdserve.assertions._report import (
    Check,
    failure,
    fmt_num,
    metric_check,
    precondition_error,
)
from pytest_pdserve.assertions._sources import (
    EXPECT_CHOICES,
    raise_if_failed,
    require_arithmetic,
    source_checks,
)
from pytest_pdserve.metrics import (
    NIXL_BYTES_SUM,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    PROMPT_TOKENS,
    PROMPT_TOKENS_BY_SOURCE,
    REQUEST_SUCCESS,
    MetricsDelta,
)

T = TypeVar("T")

VACUOUS_NO_QUERIES_MESSAGE = (
    "vacuous: no prefix-cache queries on {server}; the request never reached its prefix cache"
    " (did it go to this server? is prefix caching enabled?)"
)
NO_CACHE_HIT_MESSAGE = "no prefix-cache hit on {server}: {hits} hit tokens, expected >= {min_hit_tokens}"
NO_KV_TRANSFER_MESSAGE = "no KV transfer: the request did not go through P/D ({reason})"
TRANSFER_NOT_SHRUNK_MESSAGE = (
    "the repeated request moved {second} NIXL bytes, not fewer than the first ({first});"
    " the decode prefix cache did not shrink the transfer"
)
FIRST_TRANSFER_ZERO_MESSAGE = "vacuous: the first request moved no NIXL bytes ({first}); nothing could shrink"
NOT_REACHED_MESSAGE = "the request reached none of {servers} (no {metric} change within {timeout} s)"


@dataclass(frozen=True)
class MeasuredResult:
    """What a cache/transfer check saw: outputs and deltas per server name, per request."""

    outputs: tuple[Any, ...]
    deltas: tuple[Mapping[str, MetricsDelta], ...]


# ---------------------------------------------------------------------------------------------
# Cache and transfer checks
# ---------------------------------------------------------------------------------------------


def _model_of(server: ServerHandle) -> str | None:
    try:
        data = server.client.get("/v1/models").json()
        return str(data["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def assert_prefix_cache_hit(
    server: ServerHandle,
    request_or_fn: Mapping[str, Any] | Callable[[], object],
    *,
    min_hit_tokens: int = 1,
    prime: bool = False,
) -> MeasuredResult:
    """Sending *request_or_fn* must hit *server*'s prefix cache for at least *min_hit_tokens*.

    A dict is POSTed to *server* directly (twice with ``prime=True``: the first run fills the
    cache and is not measured); a callable is run as is (e.g. to go through the proxy) while
    *server*'s metrics are measured. Fails as vacuous when the cache was not queried at all.

    Preconditions: the cache was queried; with a dict, the prompt can hit *min_hit_tokens* (it is
    longer than one block of the server's effective block size, ``vllm:cache_config_info``).
    """
    __tracebackhide__ = True
    if server.role == "proxy":
        raise ValueError(
            f"{server.name} is the proxy, which has no prefix cache; pass a prefill or decode server"
            " (and a callable to send through the proxy)"
        )
    if callable(request_or_fn):
        action: Callable[[], object] = request_or_fn
        count: int | None = None
    else:
        prepared = with_defaults(
            request_or_fn, _model_of(server) if "model" not in request_or_fn else None, determinism=False
        )
        action = lambda: complete(server, prepared)  # noqa: E731
        count = 1
    if prime:
        measured([server], action, requests=count)
    out, deltas = measured([server], action, requests=count)
    delta = deltas[server.name]
    checks = [
        metric_check(server.name, delta, PREFIX_CACHE_QUERIES, ">", 0),
        metric_check(server.name, delta, PREFIX_CACHE_HITS, ">=", min_hit_tokens),
    ]
    if not checks[0].ok:
        raise failure(VACUOUS_NO_QUERIES_MESSAGE.format(server=server.name), checks)
    prompt_tokens = getattr(out, "prompt_tokens", None) if count is not None else None
    block = block_size_of(server, deltas)
    require_more_than_a_block("assert_prefix_cache_hit", prompt_tokens, block)
    if prompt_tokens is not None and block is not None and ((prompt_tokens - 1) // block) * block < min_hit_tokens:
        raise precondition_error(
            f"min_hit_tokens={min_hit_tokens} cannot be reached: a {prompt_tokens}-token prompt hits at most"
            f" {((prompt_tokens - 1) // block) * block} tokens (whole blocks of {block}, at most P-1 tokens)",
            checks,
        )
    if not checks[1].ok:
        raise failure(
            NO_CACHE_HIT_MESSAGE.format(
                server=server.name, hits=fmt_num(checks[1].delta), min_hit_tokens=min_hit_tokens
            ),
            checks,
        )
    return MeasuredResult((out,), (deltas,))


def assert_kv_transferred(
    cluster: PDCluster, request: Mapping[str, Any], *, endpoint: str | None = None
) -> MeasuredResult:
    """The request, sent through the proxy, must move KV over NIXL into a decode server.

    Proves P/D happened: decode ``vllm:nixl_bytes_transferred_sum`` and
    ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` both went up.
    """
    __tracebackhide__ = True
    prepared = with_defaults(request, cluster.model, determinism=False)
    out, deltas = measured(
        servers_of(cluster), lambda: complete(cluster.client, prepared, endpoint=endpoint), requests=2
    )
    checks = _transfer_checks(cluster, deltas)
    if not any(c.ok for c in checks if c.metric == NIXL_BYTES_SUM) or not any(
        c.ok for c in checks if c.metric.startswith(PROMPT_TOKENS_BY_SOURCE)
    ):
        reason = "no decode server received KV over NIXL"
        if all(c.after is None for c in checks if c.metric == NIXL_BYTES_SUM):
            reason = "the decode servers expose no vllm:nixl_* metrics: is NixlConnector configured?"
        raise failure(NO_KV_TRANSFER_MESSAGE.format(reason=reason), checks)
    return MeasuredResult((out,), (deltas,))


def _transfer_checks(cluster: PDCluster, deltas: Mapping[str, MetricsDelta]) -> list[Check]:
    checks: list[Check] = []
    for server in cluster.decode:
        d = deltas[server.name]
        checks.append(metric_check(server.name, d, NIXL_BYTES_SUM, ">", 0))
        checks.append(metric_check(server.name, d, PROMPT_TOKENS_BY_SOURCE, ">", 0, source="external_kv_transfer"))
    return checks


def assert_transfer_shrinks(
    cluster: PDCluster, request: Mapping[str, Any], *, endpoint: str | None = None
) -> MeasuredResult:
    """Repeating a request through the proxy must move fewer NIXL bytes into the same decode server.

    The first request must move bytes (else vacuous). With several decode servers the request is
    repeated until the round-robin brings it back to the first one's decode server.
    Precondition: the prompt is longer than one block (else decode caches nothing to shrink by).
    """
    __tracebackhide__ = True
    prepared = with_defaults(request, cluster.model, determinism=False)
    servers = servers_of(cluster)
    send = lambda: complete(cluster.client, prepared, endpoint=endpoint)  # noqa: E731
    out1, d1 = measured(servers, send, requests=2)
    firsts = {s.name: d1[s.name].get(NIXL_BYTES_SUM) or 0.0 for s in cluster.decode}
    target, first = max(firsts.items(), key=lambda kv: kv[1])
    first_checks = [metric_check(s.name, d1[s.name], NIXL_BYTES_SUM, ">", 0) for s in cluster.decode]
    if first <= 0:
        raise failure(FIRST_TRANSFER_ZERO_MESSAGE.format(first=fmt_num(first)), first_checks)
    require_more_than_a_block("assert_transfer_shrinks", out1.prompt_tokens, cluster.block_size)
    outputs: list[Any] = [out1]
    all_deltas: list[Mapping[str, MetricsDelta]] = [d1]
    for _ in range(len(cluster.decode)):
        out, d = measured(servers, send, requests=2)
        outputs.append(out)
        all_deltas.append(d)
        if (d[target].get(REQUEST_SUCCESS) or d[target].get(PROMPT_TOKENS) or 0) > 0 or len(cluster.decode) == 1:
            second = d[target].get(NIXL_BYTES_SUM) or 0.0
            check = metric_check(target, d[target], NIXL_BYTES_SUM, "<", first)
            if not check.ok:
                raise failure(TRANSFER_NOT_SHRUNK_MESSAGE.format(first=fmt_num(first), second=fmt_num(second)), [check])
            return MeasuredResult(tuple(outputs), tuple(all_deltas))
    from pytest_pdserve.assertions import SETTLE_TIMEOUT  # read at call time, like measured()

    raise AssertionError(NOT_REACHED_MESSAGE.format(servers=target, metric=REQUEST_SUCCESS, timeout=SETTLE_TIMEOUT))


# ---------------------------------------------------------------------------------------------
# Prompt-token sources (the arithmetic is in _sources.py)
# ---------------------------------------------------------------------------------------------


def assert_prompt_token_sources(
    delta_or_cluster: MetricsDelta | PDCluster,
    *,
    expect: str,
    prompt_tokens: int | None = None,
    block_size: int | None = None,
    prefix_tokens: int | None = None,
    request: Mapping[str, Any] | None = None,
    prime: Mapping[str, Any] | None = None,
) -> MeasuredResult:
    """Check a decode server's ``vllm:prompt_tokens_by_source_total`` split for one request.

    Given a :class:`MetricsDelta` (of the decode server, around one request), only the arithmetic
    of :func:`expected_prompt_token_sources` is checked; *prompt_tokens* and *block_size* are
    required. Given a cluster, *request* is required and the scenario is run: ``direct_decode``
    sends it to ``decode[0]``; the others go through the proxy, after priming every decode server
    directly with *prime* (``full_hit``: default the request itself; ``partial_hit``: required,
    and *prefix_tokens* defaults to its ``usage.prompt_tokens``). *prompt_tokens* defaults to the
    response's ``usage.prompt_tokens`` and *block_size* to the cluster's.

    Preconditions (checked, and named when not met): a full hit needs a prompt longer than one block;
    a partial hit a primed prefix of at least one block, shorter than the prompt (and, for text
    prompts, a prefix of it); with a cluster, the decode server's prefix cache was queried and (except
    ``direct_decode``) it exposes NIXL metrics; ``cold_decode`` needs a prompt the decode server has not
    cached.
    """
    __tracebackhide__ = True
    if expect not in EXPECT_CHOICES:
        raise ValueError(f"expect={expect!r} is not valid; accepted: {', '.join(EXPECT_CHOICES)}")
    if isinstance(delta_or_cluster, MetricsDelta):
        if prompt_tokens is None or block_size is None:
            raise ValueError("with a MetricsDelta, prompt_tokens and block_size are required")
        require_arithmetic(expect, prompt_tokens, block_size, prefix_tokens)
        delta_checks = source_checks(
            delta_or_cluster.source, delta_or_cluster, expect, prompt_tokens, block_size, prefix_tokens
        )
        raise_if_failed(delta_checks, expect, prompt_tokens, block_size, prefix_tokens)
        return MeasuredResult((), ({delta_or_cluster.source: delta_or_cluster},))
    cluster = delta_or_cluster
    if request is None:
        raise ValueError("with a cluster, pass request= (the request whose prompt tokens are counted)")
    block = block_size if block_size is not None else cluster.block_size
    prepared = with_defaults(request, cluster.model, determinism=False)
    outputs: list[Any] = []
    if expect == "partial_hit" and prime is None:
        raise ValueError("expect='partial_hit' with a cluster needs prime= (the shorter prefix request)")
    if expect == "partial_hit" and prime is not None:
        require_prefix(prime, request)
    if expect in ("full_hit", "partial_hit"):
        primer = with_defaults(prime if prime is not None else request, cluster.model, determinism=False)
        for server in cluster.decode:
            primed, _ = measured([server], lambda s=server: complete(s, primer), requests=1)  # type: ignore[misc]
            outputs.append(primed)
            if prefix_tokens is None and expect == "partial_hit":
                prefix_tokens = primed.prompt_tokens
    if expect == "direct_decode":
        target = cluster.decode[0]
        out, deltas = measured([target], lambda: complete(target, prepared), requests=1)
        targets = [target]
    else:
        out, deltas = measured(servers_of(cluster), lambda: complete(cluster.client, prepared), requests=2)
        targets = list(cluster.decode)
    outputs.append(out)
    p = prompt_tokens if prompt_tokens is not None else out.prompt_tokens
    if p is None:
        raise AssertionError("the response has no usage.prompt_tokens; pass prompt_tokens=")
    require_arithmetic(expect, p, block, prefix_tokens)
    reached = [s for s in targets if (deltas[s.name].get(PROMPT_TOKENS) or 0) > 0] or targets[:1]
    require_measurable(expect, reached, deltas)
    checks: list[Check] = []
    for server in reached:
        checks += source_checks(server.name, deltas[server.name], expect, p, block, prefix_tokens)
    raise_if_failed(checks, expect, p, block, prefix_tokens)
    return MeasuredResult(tuple(outputs), (deltas,))
