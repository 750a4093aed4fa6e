"""Preconditions: what must be true for a check to measure anything; each names the one not met."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pytest_pdserve.assertions._completions import (
    Completion,
)
from pytest_pdserve.assertions._measure import ClusterLike as PDCluster
from pytest_pdserve.assertions._measure import ServerLike as ServerHandle
from pytest_pdserve.assertions._report import (
    fmt_num,
    metric_check,
    precondition_error,
)
from pytest_pdserve.metrics import (
    NIXL_BYTES_SUM,
    PREFIX_CACHE_QUERIES,
    PROMPT_TOKENS_BY_SOURCE,
    MetricsDelta,
)

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# Preconditions (what must be true for a check to measure anything)
# ---------------------------------------------------------------------------------------------


def require_output(title: str, outputs: Sequence[Completion]) -> None:
    """Comparing empty outputs proves nothing: at least one run must have produced a token."""
    __tracebackhide__ = True
    if all(not o.text and not o.token_ids for o in outputs):
        first = outputs[0]
        raise precondition_error(
            f"{title}: every run returned an empty output (completion_tokens={first.completion_tokens},"
            f" finish_reason={first.finish_reason!r}), so there is nothing to compare; raise max_tokens"
        )


def require_more_than_a_block(what: str, prompt_tokens: int | None, block_size: int | None) -> None:
    """A prefix-cache hit is whole blocks of at most ``P - 1`` tokens: a prompt of one block or less cannot hit."""
    __tracebackhide__ = True
    if prompt_tokens is not None and block_size is not None and prompt_tokens <= block_size:
        raise precondition_error(
            f"{what} needs a prompt longer than one block: it has {prompt_tokens} tokens and block_size="
            f"{block_size}, so no full block can be cached (use at least {block_size + 1} tokens,"
            f" e.g. prompt_with_tokens(cluster, {block_size + 1}))"
        )


def require_pd(title: str, cluster: PDCluster, deltas: Mapping[str, MetricsDelta]) -> None:
    """The P/D side of a comparison must really have gone through P/D: some decode server loaded KV."""
    __tracebackhide__ = True
    checks = [
        metric_check(s.name, deltas[s.name], PROMPT_TOKENS_BY_SOURCE, ">", 0, source="external_kv_transfer")
        for s in cluster.decode
        if s.name in deltas
    ]
    if checks and all(c.after is not None for c in checks) and not any(c.ok for c in checks):
        raise precondition_error(
            f"{title}: the P/D run loaded no KV into a decode server (it did not go through P/D)", checks
        )


def block_size_of(server: ServerHandle, deltas: Mapping[str, MetricsDelta]) -> int | None:
    """The server's effective block size from ``vllm:cache_config_info`` (``None`` when not exposed)."""
    delta = deltas.get(server.name)
    return delta.after.block_size() if delta is not None else None


def require_prefix(prime: Mapping[str, Any], request: Mapping[str, Any]) -> None:
    """A partial hit needs the primed prompt to be a prefix of the request's (checked when both are text
    or both token ids; chat messages are not checked)."""
    __tracebackhide__ = True
    a, b = prime.get("prompt"), request.get("prompt")
    comparable = (isinstance(a, str) and isinstance(b, str)) or (isinstance(a, list) and isinstance(b, list))
    if comparable and not b[: len(a)] == a:  # type: ignore[index,arg-type]
        raise precondition_error(
            f"expect='partial_hit' needs prime= to be a prefix of request=: the request's prompt does not start"
            f" with the primed prompt ({_short(a)} vs {_short(b)})"
        )


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def require_measurable(expect: str, reached: Sequence[ServerHandle], deltas: Mapping[str, MetricsDelta]) -> None:
    """The decode server's cache was queried, it has a KV connector (except direct_decode), and a cold
    request really found nothing cached."""
    __tracebackhide__ = True
    for server in reached:
        d = deltas[server.name]
        queried = metric_check(server.name, d, PREFIX_CACHE_QUERIES, ">", 0)
        if queried.after is not None and not queried.ok and expect in ("full_hit", "partial_hit"):
            raise precondition_error(
                f"expect={expect!r}: {server.name}'s prefix cache was not queried (is prefix caching enabled"
                " there?), so no hit could be measured",
                [queried],
            )
        if expect != "direct_decode" and not d.has(NIXL_BYTES_SUM):
            raise precondition_error(
                f"expect={expect!r}: {server.name} exposes no vllm:nixl_* metrics, so no KV transfer can be"
                " counted: is NixlConnector configured there?"
            )
        hit = d.get(PROMPT_TOKENS_BY_SOURCE, source="local_cache_hit") or 0
        if expect == "cold_decode" and hit > 0:
            raise precondition_error(
                f"expect='cold_decode' needs a prompt {server.name} has not cached, but it hit {fmt_num(hit)} tokens"
                " (was the prompt sent earlier with the same cache_salt?)",
                [metric_check(server.name, d, PROMPT_TOKENS_BY_SOURCE, "==", 0, source="local_cache_hit")],
            )
