"""One-line checks for P/D tests that cannot pass vacuously and explain their failures.

Every check measures what it claims: a prefix-cache assertion first proves the cache was queried,
a KV-transfer assertion proves bytes moved over NIXL, a cold/warm comparison proves the warm run
hit the cache. Metrics are read with :func:`pytest_pdserve.metrics.wait_settled` (vLLM updates
them after the response), never after a fixed sleep.

Failures raise a plain :class:`AssertionError`; their texts are the module-level ``*_MESSAGE``
templates, so tests can match them. This module is pytest-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

# Request handling, failure texts, metric measuring and the prompt-source arithmetic live in private
# modules; their public names are re-exported here, the one public home of the assertions.
from pytest_pdserve._completions import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_SEED,
    DEFAULT_TOP_LOGPROBS,
    REQUEST_FAILED_MESSAGE,
    Completion,
    _complete_with_extras,
    _with_defaults,
    complete,
)
from pytest_pdserve._measure import PDCluster, ServerHandle, _is_cluster, _servers, _sum
from pytest_pdserve._measure import _measured as _measured_within
from pytest_pdserve._report import (
    CONFIDENT_FLIP,
    DEFAULT_TIE_TOLERANCE,
    DIVERGENCE_MESSAGE,
    FLASH_ATTN_HINT,
    LOGPROB_DRIFT_MESSAGE,
    NO_LOGPROBS_MESSAGE,
    PRECONDITION_MESSAGE,
    TIE_FLIP,
    UNKNOWN_FLIP,
    Check,
    Divergence,
    FlipVerdict,
    _check,
    _compare,
    _compare_logprobs,
    _fail,
    _num,
    _precondition,
    classify_flip,
    first_divergence,
    format_checks,
    format_divergence,
)
from pytest_pdserve._sources import (
    EXPECT_CHOICES,
    PROMPT_SOURCES_MESSAGE,
    Expect,
    _raise_if_failed,
    _require_arithmetic,
    _source_checks,
    expected_prompt_token_sources,
)
from pytest_pdserve.clients import RESET_FAILED_MESSAGE, reset_prefix_cache
from pytest_pdserve.metrics import (
    NIXL_BYTES_SUM,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    PROMPT_TOKENS,
    PROMPT_TOKENS_BY_SOURCE,
    REQUEST_SUCCESS,
    MetricsDelta,
)

__all__ = [
    "COLD_NOT_COLD_MESSAGE",
    "CONFIDENT_FLIP",
    "DEFAULT_TIE_TOLERANCE",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_SEED",
    "DEFAULT_TOP_LOGPROBS",
    "DIVERGENCE_MESSAGE",
    "EXPECT_CHOICES",
    "FIRST_TRANSFER_ZERO_MESSAGE",
    "FLASH_ATTN_HINT",
    "LOGPROB_DRIFT_MESSAGE",
    "NOT_REACHED_MESSAGE",
    "NO_CACHE_HIT_MESSAGE",
    "NO_KV_TRANSFER_MESSAGE",
    "NO_LOGPROBS_MESSAGE",
    "PRECONDITION_MESSAGE",
    "PROMPT_SOURCES_MESSAGE",
    "REQUEST_FAILED_MESSAGE",
    "RESET_FAILED_MESSAGE",
    "SETTLE_TIMEOUT",
    "TIE_FLIP",
    "TRANSFER_NOT_SHRUNK_MESSAGE",
    "UNKNOWN_FLIP",
    "VACUOUS_NO_QUERIES_MESSAGE",
    "VACUOUS_WARM_MESSAGE",
    "Check",
    "Completion",
    "ComparisonResult",
    "Divergence",
    "Expect",
    "FlipVerdict",
    "MeasuredResult",
    "PDCluster",
    "ServerHandle",
    "assert_cold_warm_match",
    "assert_deterministic",
    "assert_kv_transferred",
    "assert_pd_matches_single",
    "assert_prefix_cache_hit",
    "assert_prompt_token_sources",
    "assert_transfer_shrinks",
    "classify_flip",
    "complete",
    "expected_prompt_token_sources",
    "first_divergence",
    "format_checks",
    "format_divergence",
]

T = TypeVar("T")

# ---------------------------------------------------------------------------------------------
# Message templates (public so tests can match them; the divergence and request ones are in
# _report.py and _completions.py, re-exported above)
# ---------------------------------------------------------------------------------------------

VACUOUS_NO_QUERIES_MESSAGE = (
    "vacuous: no prefix-cache queries on {server}; the request never reached its prefix cache"
    " (did it go to this server? is prefix caching enabled?)"
)
NO_CACHE_HIT_MESSAGE = "no prefix-cache hit on {server}: {hits} hit tokens, expected >= {min_hit_tokens}"
VACUOUS_WARM_MESSAGE = (
    "vacuous: the warm run hit no prefix cache on {servers}, so cold and warm outputs were computed"
    " the same way; use a prompt longer than one block ({block_size} tokens)"
)
COLD_NOT_COLD_MESSAGE = "vacuous: the cold run already hit the prefix cache ({hits} tokens); {why}"
NO_KV_TRANSFER_MESSAGE = "no KV transfer: the request did not go through P/D ({reason})"
TRANSFER_NOT_SHRUNK_MESSAGE = (
    "the repeated request moved {second} NIXL bytes, not fewer than the first ({first});"
    " the decode prefix cache did not shrink the transfer"
)
FIRST_TRANSFER_ZERO_MESSAGE = "vacuous: the first request moved no NIXL bytes ({first}); nothing could shrink"
NOT_REACHED_MESSAGE = "the request reached none of {servers} (no {metric} change within {timeout} s)"

SETTLE_TIMEOUT = 5.0
"""Seconds to wait for a request to show up in metrics (vLLM records them after responding).
Read at call time, so a suite can raise it for slow machines."""


def _measured(
    servers: Sequence[ServerHandle], action: Callable[[], T], *, requests: int | None
) -> tuple[T, dict[str, MetricsDelta]]:
    """Run *action* and return its result with the servers' metrics deltas once they show it.

    :data:`SETTLE_TIMEOUT` is read here, at call time, so a suite (or a test's monkeypatch) can raise it.
    """
    __tracebackhide__ = True
    return _measured_within(servers, action, requests=requests, timeout=SETTLE_TIMEOUT)


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ComparisonResult:
    """Outputs that matched, their labels, and metrics deltas per server name (per run).

    ``tie_flips``: the divergences accepted as tie flips (only with ``tie_tolerance=``), one per run that
    differed from the first.
    """

    outputs: tuple[Completion, ...]
    labels: tuple[str, ...]
    deltas: tuple[Mapping[str, MetricsDelta], ...] = ()
    tie_flips: tuple[FlipVerdict, ...] = ()


@dataclass(frozen=True)
class MeasuredResult:
    """What a cache/transfer check saw: outputs and deltas per server name, per request."""

    outputs: tuple[Any, ...]
    deltas: tuple[Mapping[str, MetricsDelta], ...]


# ---------------------------------------------------------------------------------------------
# Preconditions (what must be true for a check to measure anything)
# ---------------------------------------------------------------------------------------------


def _require_output(title: str, outputs: Sequence[Completion]) -> None:
    """Comparing empty outputs proves nothing: at least one run must have produced a token."""
    __tracebackhide__ = True
    if all(not o.text and not o.token_ids for o in outputs):
        first = outputs[0]
        raise _precondition(
            f"{title}: every run returned an empty output (completion_tokens={first.completion_tokens},"
            f" finish_reason={first.finish_reason!r}), so there is nothing to compare; raise max_tokens"
        )


def _require_more_than_a_block(what: str, prompt_tokens: int | None, block_size: int | None) -> None:
    """A prefix-cache hit is whole blocks of at most ``P - 1`` tokens: a prompt of one block or less cannot hit."""
    __tracebackhide__ = True
    if prompt_tokens is not None and block_size is not None and prompt_tokens <= block_size:
        raise _precondition(
            f"{what} needs a prompt longer than one block: it has {prompt_tokens} tokens and block_size="
            f"{block_size}, so no full block can be cached (use at least {block_size + 1} tokens,"
            f" e.g. prompt_with_tokens(cluster, {block_size + 1}))"
        )


def _require_pd(title: str, cluster: PDCluster, deltas: Mapping[str, MetricsDelta]) -> None:
    """The P/D side of a comparison must really have gone through P/D: some decode server loaded KV."""
    __tracebackhide__ = True
    checks = [
        _check(s.name, deltas[s.name], PROMPT_TOKENS_BY_SOURCE, ">", 0, source="external_kv_transfer")
        for s in cluster.decode
        if s.name in deltas
    ]
    if checks and all(c.after is not None for c in checks) and not any(c.ok for c in checks):
        raise _precondition(
            f"{title}: the P/D run loaded no KV into a decode server (it did not go through P/D)", checks
        )


def _block_size_of(server: ServerHandle, deltas: Mapping[str, MetricsDelta]) -> int | None:
    """The server's effective block size from ``vllm:cache_config_info`` (``None`` when not exposed)."""
    delta = deltas.get(server.name)
    return delta.after.block_size() if delta is not None else None


# ---------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------


def assert_deterministic(
    cluster_or_client: PDCluster | ServerHandle | httpx.Client,
    request: Mapping[str, Any],
    *,
    repeats: int = 2,
    endpoint: str | None = None,
    tie_tolerance: float | None = None,
) -> ComparisonResult:
    """Send *request* *repeats* times, one after another, and require identical outputs.

    With a cluster the requests go through the proxy. ``temperature=0`` and a seed are set unless
    given; token ids and top logprobs are requested so a failure shows the diverging token, the
    top-1/top-2 logprob gap there and a verdict: ``tie flip`` (gap under the tolerance) or
    ``confident flip``.

    :param tie_tolerance: accept tie flips whose gap is under this many nats (they are listed in
        ``ComparisonResult.tie_flips``); confident flips always fail. Default: every divergence fails.
    """
    __tracebackhide__ = True
    if tie_tolerance is not None and not tie_tolerance > 0:
        raise ValueError(f"tie_tolerance={tie_tolerance!r} must be > 0 (nats)")
    if repeats < 2:
        raise ValueError(f"repeats={repeats!r} must be >= 2 to compare anything")
    engine = backend = model = None
    servers: list[ServerHandle] = []
    target: ServerHandle | httpx.Client
    if _is_cluster(cluster_or_client):
        cluster: PDCluster = cluster_or_client  # type: ignore[assignment]
        target, servers, model = cluster.client, _servers(cluster), cluster.model
        engine, backend = cluster.engine, cluster.attention_backend
    elif isinstance(cluster_or_client, httpx.Client):
        target = cluster_or_client
    else:
        handle: ServerHandle = cluster_or_client  # type: ignore[assignment]
        target = handle
        if handle.role != "proxy":
            servers = [handle]
    prepared = _with_defaults(request, model, determinism=True)
    per_request = 2 if servers and _is_cluster(cluster_or_client) else 1
    outputs: list[Completion] = []
    deltas: list[Mapping[str, MetricsDelta]] = []
    for _ in range(repeats):
        out, delta = _measured(servers, lambda: _complete_with_extras(target, prepared, endpoint), requests=per_request)
        outputs.append(out)
        deltas.append(delta)
    labels = tuple(f"run {i + 1}" for i in range(repeats))
    _require_output("not deterministic", outputs)
    ties = _compare("not deterministic", outputs, labels, engine=engine, backend=backend, tie_tolerance=tie_tolerance)
    return ComparisonResult(tuple(outputs), labels, tuple(deltas), tuple(ties))


def assert_pd_matches_single(
    cluster: PDCluster,
    request: Mapping[str, Any],
    *,
    single: ServerHandle | None = None,
    logprob_tolerance: float | None = None,
    endpoint: str | None = None,
) -> ComparisonResult:
    """P/D output (through the proxy) must equal one non-disaggregated server's output.

    :param single: the reference server; default the first prefill server, sent to directly (as
        vLLM's test_edge_cases does).
    :param logprob_tolerance: for hybrid models (the prefiller stops one token short, so outputs
        are not bit-identical): compare top-1 logprobs per token up to the first differing token,
        each within this many nats, instead of requiring identical tokens.

    Precondition: the P/D run loaded KV into a decode server (else it compared single with single).
    """
    __tracebackhide__ = True
    reference = single if single is not None else cluster.prefill[0]
    prepared = _with_defaults(request, cluster.model, determinism=True)
    servers = _servers(cluster)
    pd, d1 = _measured(servers, lambda: _complete_with_extras(cluster.client, prepared, endpoint), requests=2)
    ref, d2 = _measured(servers, lambda: _complete_with_extras(reference, prepared, endpoint), requests=1)
    labels = ("P/D", f"single {reference.name}")
    title = "P/D output differs from single-instance output"
    _require_pd(title, cluster, d1)
    _require_output(title, [pd, ref])
    if logprob_tolerance is None:
        _compare(title, [pd, ref], labels, engine=cluster.engine, backend=cluster.attention_backend)
    else:
        _compare_logprobs(title, pd, ref, labels, logprob_tolerance, cluster)
    return ComparisonResult((pd, ref), labels, (d1, d2))


def _reset_prefix_caches(servers: Sequence[ServerHandle]) -> list[str]:
    """POST /reset_prefix_cache everywhere; returns the servers without that endpoint."""
    __tracebackhide__ = True
    return [server.name for server in servers if not reset_prefix_cache(server.client, server.name)]


def _hit_checks(deltas: Mapping[str, MetricsDelta], op: str, target: float) -> list[Check]:
    return [_check(name, d, PREFIX_CACHE_HITS, op, target) for name, d in deltas.items() if d.has(PREFIX_CACHE_HITS)]


def assert_cold_warm_match(
    cluster: PDCluster,
    request: Mapping[str, Any],
    *,
    reset: Callable[[], object] | None = None,
    endpoint: str | None = None,
) -> ComparisonResult:
    """A cold-cache run and a warm run (the same request again) must give the same output.

    Caches are emptied with *reset*, or by ``POST /reset_prefix_cache`` on every server (vLLM needs
    ``VLLM_SERVER_DEV_MODE=1`` for it). Metrics must show the cold run missed and the warm run hit
    a prefix cache; otherwise the comparison would prove nothing and the check fails saying so.
    Precondition: the prompt is longer than one block (else the warm run cannot hit).
    """
    __tracebackhide__ = True
    servers = _servers(cluster)
    if reset is not None:
        reset()
        unsupported: list[str] = []
    else:
        unsupported = _reset_prefix_caches(servers)
    prepared = _with_defaults(request, cluster.model, determinism=True)
    run = lambda: _complete_with_extras(cluster.client, prepared, endpoint)  # noqa: E731
    cold, cold_d = _measured(servers, run, requests=2)
    _require_more_than_a_block("assert_cold_warm_match", cold.prompt_tokens, cluster.block_size)
    warm, warm_d = _measured(servers, run, requests=2)
    cold_hits = _sum(cold_d, PREFIX_CACHE_HITS)
    if cold_hits > 0:
        why = (
            f"{', '.join(unsupported)} cannot reset (start vLLM with VLLM_SERVER_DEV_MODE=1, or pass reset=)"
            if unsupported
            else "the reset did not empty the cache"
        )
        raise _fail(COLD_NOT_COLD_MESSAGE.format(hits=_num(cold_hits), why=why), _hit_checks(cold_d, "==", 0))
    if _sum(warm_d, PREFIX_CACHE_HITS) <= 0:
        raise _fail(
            VACUOUS_WARM_MESSAGE.format(servers=", ".join(s.name for s in servers), block_size=cluster.block_size),
            _hit_checks(warm_d, ">", 0),
        )
    labels = ("cold", "warm")
    _compare(
        "cold and warm outputs differ", [cold, warm], labels, engine=cluster.engine, backend=cluster.attention_backend
    )
    return ComparisonResult((cold, warm), labels, (cold_d, warm_d))


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
        prepared = _with_defaults(
            request_or_fn, _model_of(server) if "model" not in request_or_fn else None, determinism=False
        )
        action = lambda: complete(server, prepared)  # noqa: E731
        count = 1
    if prime:
        _measured([server], action, requests=count)
    out, deltas = _measured([server], action, requests=count)
    delta = deltas[server.name]
    checks = [
        _check(server.name, delta, PREFIX_CACHE_QUERIES, ">", 0),
        _check(server.name, delta, PREFIX_CACHE_HITS, ">=", min_hit_tokens),
    ]
    if not checks[0].ok:
        raise _fail(VACUOUS_NO_QUERIES_MESSAGE.format(server=server.name), checks)
    prompt_tokens = getattr(out, "prompt_tokens", None) if count is not None else None
    block = _block_size_of(server, deltas)
    _require_more_than_a_block("assert_prefix_cache_hit", prompt_tokens, block)
    if prompt_tokens is not None and block is not None and ((prompt_tokens - 1) // block) * block < min_hit_tokens:
        raise _precondition(
            f"min_hit_tokens={min_hit_tokens} cannot be reached: a {prompt_tokens}-token prompt hits at most"
            f" {((prompt_tokens - 1) // block) * block} tokens (whole blocks of {block}, at most P-1 tokens)",
            checks,
        )
    if not checks[1].ok:
        raise _fail(
            NO_CACHE_HIT_MESSAGE.format(server=server.name, hits=_num(checks[1].delta), min_hit_tokens=min_hit_tokens),
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
    prepared = _with_defaults(request, cluster.model, determinism=False)
    out, deltas = _measured(
        _servers(cluster), lambda: complete(cluster.client, prepared, endpoint=endpoint), requests=2
    )
    checks = _transfer_checks(cluster, deltas)
    if not any(c.ok for c in checks if c.metric == NIXL_BYTES_SUM) or not any(
        c.ok for c in checks if c.metric.startswith(PROMPT_TOKENS_BY_SOURCE)
    ):
        reason = "no decode server received KV over NIXL"
        if all(c.after is None for c in checks if c.metric == NIXL_BYTES_SUM):
            reason = "the decode servers expose no vllm:nixl_* metrics: is NixlConnector configured?"
        raise _fail(NO_KV_TRANSFER_MESSAGE.format(reason=reason), checks)
    return MeasuredResult((out,), (deltas,))


def _transfer_checks(cluster: PDCluster, deltas: Mapping[str, MetricsDelta]) -> list[Check]:
    checks: list[Check] = []
    for server in cluster.decode:
        d = deltas[server.name]
        checks.append(_check(server.name, d, NIXL_BYTES_SUM, ">", 0))
        checks.append(_check(server.name, d, PROMPT_TOKENS_BY_SOURCE, ">", 0, source="external_kv_transfer"))
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
    prepared = _with_defaults(request, cluster.model, determinism=False)
    servers = _servers(cluster)
    send = lambda: complete(cluster.client, prepared, endpoint=endpoint)  # noqa: E731
    out1, d1 = _measured(servers, send, requests=2)
    firsts = {s.name: d1[s.name].get(NIXL_BYTES_SUM) or 0.0 for s in cluster.decode}
    target, first = max(firsts.items(), key=lambda kv: kv[1])
    first_checks = [_check(s.name, d1[s.name], NIXL_BYTES_SUM, ">", 0) for s in cluster.decode]
    if first <= 0:
        raise _fail(FIRST_TRANSFER_ZERO_MESSAGE.format(first=_num(first)), first_checks)
    _require_more_than_a_block("assert_transfer_shrinks", out1.prompt_tokens, cluster.block_size)
    outputs: list[Any] = [out1]
    all_deltas: list[Mapping[str, MetricsDelta]] = [d1]
    for _ in range(len(cluster.decode)):
        out, d = _measured(servers, send, requests=2)
        outputs.append(out)
        all_deltas.append(d)
        if (d[target].get(REQUEST_SUCCESS) or d[target].get(PROMPT_TOKENS) or 0) > 0 or len(cluster.decode) == 1:
            second = d[target].get(NIXL_BYTES_SUM) or 0.0
            check = _check(target, d[target], NIXL_BYTES_SUM, "<", first)
            if not check.ok:
                raise _fail(TRANSFER_NOT_SHRUNK_MESSAGE.format(first=_num(first), second=_num(second)), [check])
            return MeasuredResult(tuple(outputs), tuple(all_deltas))
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
        _require_arithmetic(expect, prompt_tokens, block_size, prefix_tokens)
        delta_checks = _source_checks(
            delta_or_cluster.source, delta_or_cluster, expect, prompt_tokens, block_size, prefix_tokens
        )
        _raise_if_failed(delta_checks, expect, prompt_tokens, block_size, prefix_tokens)
        return MeasuredResult((), ({delta_or_cluster.source: delta_or_cluster},))
    cluster = delta_or_cluster
    if request is None:
        raise ValueError("with a cluster, pass request= (the request whose prompt tokens are counted)")
    block = block_size if block_size is not None else cluster.block_size
    prepared = _with_defaults(request, cluster.model, determinism=False)
    outputs: list[Any] = []
    if expect == "partial_hit" and prime is None:
        raise ValueError("expect='partial_hit' with a cluster needs prime= (the shorter prefix request)")
    if expect == "partial_hit" and prime is not None:
        _require_prefix(prime, request)
    if expect in ("full_hit", "partial_hit"):
        primer = _with_defaults(prime if prime is not None else request, cluster.model, determinism=False)
        for server in cluster.decode:
            primed, _ = _measured([server], lambda s=server: complete(s, primer), requests=1)  # type: ignore[misc]
            outputs.append(primed)
            if prefix_tokens is None and expect == "partial_hit":
                prefix_tokens = primed.prompt_tokens
    if expect == "direct_decode":
        target = cluster.decode[0]
        out, deltas = _measured([target], lambda: complete(target, prepared), requests=1)
        measured = [target]
    else:
        out, deltas = _measured(_servers(cluster), lambda: complete(cluster.client, prepared), requests=2)
        measured = list(cluster.decode)
    outputs.append(out)
    p = prompt_tokens if prompt_tokens is not None else out.prompt_tokens
    if p is None:
        raise AssertionError("the response has no usage.prompt_tokens; pass prompt_tokens=")
    _require_arithmetic(expect, p, block, prefix_tokens)
    reached = [s for s in measured if (deltas[s.name].get(PROMPT_TOKENS) or 0) > 0] or measured[:1]
    _require_measurable(expect, reached, deltas)
    checks: list[Check] = []
    for server in reached:
        checks += _source_checks(server.name, deltas[server.name], expect, p, block, prefix_tokens)
    _raise_if_failed(checks, expect, p, block, prefix_tokens)
    return MeasuredResult(tuple(outputs), (deltas,))


def _require_prefix(prime: Mapping[str, Any], request: Mapping[str, Any]) -> None:
    """A partial hit needs the primed prompt to be a prefix of the request's (checked when both are text
    or both token ids; chat messages are not checked)."""
    __tracebackhide__ = True
    a, b = prime.get("prompt"), request.get("prompt")
    comparable = (isinstance(a, str) and isinstance(b, str)) or (isinstance(a, list) and isinstance(b, list))
    if comparable and not b[: len(a)] == a:  # type: ignore[index,arg-type]
        raise _precondition(
            f"expect='partial_hit' needs prime= to be a prefix of request=: the request's prompt does not start"
            f" with the primed prompt ({_short(a)} vs {_short(b)})"
        )


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _require_measurable(expect: str, reached: Sequence[ServerHandle], deltas: Mapping[str, MetricsDelta]) -> None:
    """The decode server's cache was queried, it has a KV connector (except direct_decode), and a cold
    request really found nothing cached."""
    __tracebackhide__ = True
    for server in reached:
        d = deltas[server.name]
        queried = _check(server.name, d, PREFIX_CACHE_QUERIES, ">", 0)
        if queried.after is not None and not queried.ok and expect in ("full_hit", "partial_hit"):
            raise _precondition(
                f"expect={expect!r}: {server.name}'s prefix cache was not queried (is prefix caching enabled"
                " there?), so no hit could be measured",
                [queried],
            )
        if expect != "direct_decode" and not d.has(NIXL_BYTES_SUM):
            raise _precondition(
                f"expect={expect!r}: {server.name} exposes no vllm:nixl_* metrics, so no KV transfer can be"
                " counted: is NixlConnector configured there?"
            )
        hit = d.get(PROMPT_TOKENS_BY_SOURCE, source="local_cache_hit") or 0
        if expect == "cold_decode" and hit > 0:
            raise _precondition(
                f"expect='cold_decode' needs a prompt {server.name} has not cached, but it hit {_num(hit)} tokens"
                " (was the prompt sent earlier with the same cache_salt?)",
                [_check(server.name, d, PROMPT_TOKENS_BY_SOURCE, "==", 0, source="local_cache_hit")],
            )
