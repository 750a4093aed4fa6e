"""One-line checks for P/D tests that cannot pass vacuously and explain their failures.

Every check measures what it claims: a prefix-cache assertion first proves the cache was queried,
a KV-transfer assertion proves bytes moved over NIXL, a cold/warm comparison proves the warm run
hit the cache. Metrics are read with :func:`pytest_pdserve.metrics.wait_settled` (vLLM updates
them after the response), never after a fixed sleep.

Failures raise a plain :class:`AssertionError`; their texts are the module-level ``*_MESSAGE``
templates, so tests can match them. This module is pytest-free.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import httpx

from pytest_pdserve.metrics import (
    NIXL_BYTES_SUM,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    PROMPT_TOKENS,
    PROMPT_TOKENS_BY_SOURCE,
    REQUEST_SUCCESS,
    MetricsDelta,
    MetricsSettleTimeout,
    MetricsSnapshot,
    wait_settled,
)

__all__ = [
    "Check",
    "Completion",
    "ComparisonResult",
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
    "complete",
    "expected_prompt_token_sources",
    "first_divergence",
    "format_checks",
]

T = TypeVar("T")

# ---------------------------------------------------------------------------------------------
# What the cluster must provide (cluster.py implements it; a Protocol keeps this module free of it)
# ---------------------------------------------------------------------------------------------


class ServerHandle(Protocol):
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


class PDCluster(Protocol):
    """A running P/D cluster: prefill and decode servers behind a proxy."""

    @property
    def prefill(self) -> Sequence[ServerHandle]: ...

    @property
    def decode(self) -> Sequence[ServerHandle]: ...

    @property
    def proxy(self) -> ServerHandle: ...

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


# ---------------------------------------------------------------------------------------------
# Message templates (public so tests can match them)
# ---------------------------------------------------------------------------------------------

FLASH_ATTN_HINT = (
    "hint: FLASH_ATTN is not batch-invariant on Hopper; try --attention-backend=FLASHINFER or "
    "TRITON_ATTN, or VLLM_BATCH_INVARIANT=1"
)
DIVERGENCE_MESSAGE = "{title}: outputs differ at {unit} {index} ({label_a}: {len_a}, {label_b}: {len_b} {unit}s)"
LOGPROB_DRIFT_MESSAGE = "{title}: top-1 logprob drift {drift:.4f} at token {index} exceeds the tolerance {tolerance}"
NO_LOGPROBS_MESSAGE = "{title}: logprob_tolerance needs top logprobs, but {label} returned none"
REQUEST_FAILED_MESSAGE = "request to {target} ({path}) failed with HTTP {status}: {body}"
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
PROMPT_SOURCES_MESSAGE = (
    "prompt token sources do not match expect={expect!r} (prompt_tokens={prompt_tokens},"
    " block_size={block_size}{extra})"
)
NOT_REACHED_MESSAGE = "the request reached none of {servers} (no {metric} change within {timeout} s)"
RESET_FAILED_MESSAGE = "POST /reset_prefix_cache on {server} did not succeed: HTTP {status} {body}"

SETTLE_TIMEOUT = 5.0
"""Seconds to wait for a request to show up in metrics (vLLM records them after responding).
Read at call time, so a suite can raise it for slow machines."""

DEFAULT_TOP_LOGPROBS = 5
DEFAULT_MAX_TOKENS = 16
DEFAULT_SEED = 0
_WINDOW = 40  # characters of text shown around a divergence

Expect = Literal["cold_decode", "full_hit", "partial_hit", "direct_decode"]
EXPECT_CHOICES: tuple[str, ...] = ("cold_decode", "full_hit", "partial_hit", "direct_decode")

# ---------------------------------------------------------------------------------------------
# Requests and completions
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Completion:
    """The first choice of a completion/chat response, normalised.

    ``token_ids``/``top_logprobs`` are ``None`` when the server did not return them.
    """

    text: str
    token_ids: tuple[int, ...] | None = None
    tokens: tuple[str, ...] | None = None
    top_logprobs: tuple[Mapping[str, float], ...] | None = None
    token_logprobs: tuple[float | None, ...] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    source: str = ""
    raw: Any = field(default=None, repr=False, compare=False)

    def top1_logprob(self, index: int) -> float | None:
        """The best logprob at *index* (top_logprobs, else the chosen token's logprob)."""
        if self.top_logprobs is not None and index < len(self.top_logprobs) and self.top_logprobs[index]:
            return max(self.top_logprobs[index].values())
        if self.token_logprobs is not None and index < len(self.token_logprobs):
            return self.token_logprobs[index]
        return None


def _endpoint(request: Mapping[str, Any], endpoint: str | None) -> str:
    if endpoint is not None:
        return endpoint
    return "/v1/chat/completions" if "messages" in request else "/v1/completions"


def _with_defaults(request: Mapping[str, Any], model: str | None, *, determinism: bool) -> dict[str, Any]:
    if not isinstance(request, Mapping):
        raise TypeError(f"request must be a JSON object (dict), got {type(request).__name__}: {request!r}")
    out = dict(request)
    if model is not None:
        out.setdefault("model", model)
    out.setdefault("temperature", 0)
    if "max_tokens" not in out and "max_completion_tokens" not in out:
        out["max_tokens"] = DEFAULT_MAX_TOKENS
    if determinism:
        out.setdefault("seed", DEFAULT_SEED)
    return out


def _determinism_extras(request: Mapping[str, Any]) -> dict[str, Any]:
    """Fields asking for token ids and top logprobs (vLLM 0.32+ knows ``return_token_ids``)."""
    extras: dict[str, Any] = {}
    if "return_token_ids" not in request:
        extras["return_token_ids"] = True
    if "messages" in request:
        if "logprobs" not in request and "top_logprobs" not in request:
            extras.update(logprobs=True, top_logprobs=DEFAULT_TOP_LOGPROBS)
    elif "logprobs" not in request:
        extras["logprobs"] = DEFAULT_TOP_LOGPROBS
    return extras


def _client_of(target: ServerHandle | httpx.Client) -> tuple[httpx.Client, str]:
    if isinstance(target, httpx.Client):
        return target, str(target.base_url)
    return target.client, f"{target.name} ({target.url})"


def complete(
    target: ServerHandle | httpx.Client,
    request: Mapping[str, Any],
    *,
    endpoint: str | None = None,
) -> Completion:
    """POST *request* to *target* (``/v1/completions``, or chat when it has ``messages``).

    Streaming requests (``"stream": true``) are collected from their SSE events.

    :raises AssertionError: on an HTTP error or an error event (naming the target and status).
    """
    client, label = _client_of(target)
    path = _endpoint(request, endpoint)
    if request.get("stream"):
        with client.stream("POST", path, json=dict(request)) as resp:
            if resp.status_code >= 400:
                resp.read()
                _request_failed(label, path, resp)
            return _from_sse(resp.iter_lines(), label)
    resp = client.post(path, json=dict(request))
    if resp.status_code >= 400:
        _request_failed(label, path, resp)
    return _from_json(resp.json(), label)


def _request_failed(label: str, path: str, resp: httpx.Response) -> None:
    raise AssertionError(
        REQUEST_FAILED_MESSAGE.format(target=label, path=path, status=resp.status_code, body=resp.text[:500])
    )


def _logprob_fields(
    logprobs: Any,
) -> tuple[tuple[str, ...] | None, tuple[float | None, ...] | None, tuple[Mapping[str, float], ...] | None]:
    if not isinstance(logprobs, Mapping):
        return None, None, None
    tokens: tuple[str, ...] | None
    chosen: tuple[float | None, ...] | None
    top: tuple[Mapping[str, float], ...] | None
    if "content" in logprobs:  # chat format
        content = logprobs.get("content") or []
        tokens = tuple(str(c.get("token", "")) for c in content)
        chosen = tuple(c.get("logprob") for c in content)
        top = tuple(
            {str(t.get("token", "")): float(t.get("logprob")) for t in (c.get("top_logprobs") or [])} for c in content
        )
        return tokens, chosen, (top if any(top) else None)
    tokens_raw = logprobs.get("tokens")
    tokens = tuple(tokens_raw) if tokens_raw is not None else None
    chosen_raw = logprobs.get("token_logprobs")
    chosen = tuple(chosen_raw) if chosen_raw is not None else None
    top_raw = logprobs.get("top_logprobs")
    top = tuple(dict(t or {}) for t in top_raw) if top_raw is not None else None
    return tokens, chosen, top


def _from_json(data: Any, label: str) -> Completion:
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError) as exc:
        raise AssertionError(f"{label} returned no choices: {json.dumps(data)[:500]}") from exc
    message = choice.get("message")
    text = message.get("content") if isinstance(message, Mapping) else choice.get("text")
    tokens, chosen, top = _logprob_fields(choice.get("logprobs"))
    token_ids = choice.get("token_ids")
    usage = data.get("usage") or {}
    return Completion(
        text=text or "",
        token_ids=tuple(token_ids) if token_ids is not None else None,
        tokens=tokens,
        top_logprobs=top,
        token_logprobs=chosen,
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        finish_reason=choice.get("finish_reason"),
        source=label,
        raw=data,
    )


def _from_sse(lines: Iterable[str], label: str) -> Completion:
    text: list[str] = []
    ids: list[int] = []
    saw_ids = False
    tokens: list[str] = []
    chosen: list[float | None] = []
    top: list[Mapping[str, float]] = []
    usage: Mapping[str, Any] = {}
    finish: str | None = None
    events: list[Any] = []
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        event = json.loads(payload)
        events.append(event)
        if "error" in event:
            raise AssertionError(f"{label} sent an error event mid-stream: {payload[:500]}")
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, Mapping) else choice.get("text")
            text.append(piece or "")
            if choice.get("token_ids") is not None:
                saw_ids = True
                ids.extend(choice["token_ids"])
            t, c, tp = _logprob_fields(choice.get("logprobs"))
            tokens.extend(t or ())
            chosen.extend(c or ())
            top.extend(tp or ())
            finish = choice.get("finish_reason") or finish
    return Completion(
        text="".join(text),
        token_ids=tuple(ids) if saw_ids else None,
        tokens=tuple(tokens) if tokens else None,
        top_logprobs=tuple(top) if top else None,
        token_logprobs=tuple(chosen) if chosen else None,
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        finish_reason=finish,
        source=label,
        raw=events,
    )


def _complete_with_extras(
    target: ServerHandle | httpx.Client, request: Mapping[str, Any], endpoint: str | None
) -> Completion:
    """Ask for token ids and logprobs; a server that rejects those fields gets the plain request."""
    extras = _determinism_extras(request)
    if not extras:
        return complete(target, request, endpoint=endpoint)
    try:
        return complete(target, {**request, **extras}, endpoint=endpoint)
    except AssertionError as exc:
        if "HTTP 400" not in str(exc) and "HTTP 422" not in str(exc):
            raise
    return complete(target, request, endpoint=endpoint)


# ---------------------------------------------------------------------------------------------
# Divergence
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Divergence:
    """Where two completions part: ``unit`` is ``"token"`` (ids compared) or ``"character"``."""

    unit: Literal["token", "character"]
    index: int
    char_index: int


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def first_divergence(a: Completion, b: Completion) -> Divergence | None:
    """``None`` when *a* and *b* agree (token ids when both have them, else text)."""
    char_index = _common_prefix(a.text, b.text)
    if a.token_ids is not None and b.token_ids is not None:
        index = _common_prefix(a.token_ids, b.token_ids)
        if index < max(len(a.token_ids), len(b.token_ids)):
            if a.tokens is not None:
                # Cut the text window at the token boundary when the token strings spell the text.
                head = "".join(a.tokens[:index])
                if a.text.startswith(head) and b.text.startswith(head):
                    char_index = len(head)
            return Divergence("token", index, char_index)
    if a.text != b.text:
        return Divergence("character", char_index, char_index)
    return None


def _needs_flash_attn_hint(backend: str | None) -> bool:
    return backend is None or backend.strip().upper() in ("", "AUTO", "FLASH_ATTN")


def _at(seq: Sequence[T] | None, index: int) -> T | str:
    if seq is None:
        return "n/a"
    return seq[index] if index < len(seq) else "(ended)"


def _format_top(top: Mapping[str, float] | str) -> str:
    if isinstance(top, str):
        return top
    ranked = sorted(top.items(), key=lambda kv: -kv[1])
    return "{" + ", ".join(f"{tok!r}: {lp:.4f}" for tok, lp in ranked) + "}"


def format_divergence(
    title: str,
    a: Completion,
    b: Completion,
    div: Divergence,
    *,
    labels: tuple[str, str],
    engine: str | None,
    backend: str | None,
) -> str:
    """The failure text for two diverging outputs (see :data:`DIVERGENCE_MESSAGE`)."""
    la, lb = labels
    width = max(len(la), len(lb), len("common prefix"))
    unit_len_a = len(a.token_ids) if div.unit == "token" and a.token_ids is not None else len(a.text)
    unit_len_b = len(b.token_ids) if div.unit == "token" and b.token_ids is not None else len(b.text)
    c = div.char_index
    lines = [
        DIVERGENCE_MESSAGE.format(
            title=title, unit=div.unit, index=div.index, label_a=la, label_b=lb, len_a=unit_len_a, len_b=unit_len_b
        ),
        f"  {'common prefix':>{width}}: ...{a.text[max(0, c - _WINDOW) : c]!r}",
        f"  {la:>{width}}: {a.text[c : c + _WINDOW]!r}...",
        f"  {lb:>{width}}: {b.text[c : c + _WINDOW]!r}...",
    ]
    if div.unit == "token":
        i = div.index
        lines.append(f"  token ids at {i}: {la}={_at(a.token_ids, i)} {lb}={_at(b.token_ids, i)}")
        if a.tokens is not None or b.tokens is not None:
            lines.append(f"  tokens at {i}: {la}={_at(a.tokens, i)!r} {lb}={_at(b.tokens, i)!r}")
        if a.top_logprobs is not None or b.top_logprobs is not None:
            lines.append(f"  top logprobs at {i}:")
            lines.append(f"    {la}: {_format_top(_at(a.top_logprobs, i))}")
            lines.append(f"    {lb}: {_format_top(_at(b.top_logprobs, i))}")
    else:
        lines.append("  (no token ids returned: compared text only)")
    lines.append(f"  engine={engine or 'unknown'} attention_backend={backend or 'auto'}")
    if _needs_flash_attn_hint(backend):
        lines.append(FLASH_ATTN_HINT)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Metrics around a request
# ---------------------------------------------------------------------------------------------


def _snapshots(servers: Sequence[ServerHandle]) -> dict[str, MetricsSnapshot]:
    return {s.name: s.metrics() for s in servers}


def _advanced(before: Mapping[str, MetricsSnapshot], now: Mapping[str, MetricsSnapshot], name: str) -> float:
    total = 0.0
    for key, snap in now.items():
        after = snap.get(name)
        if after is not None:
            total += after - (before[key].get(name) or 0.0)
    return total


def _settle(
    servers: Sequence[ServerHandle],
    before: Mapping[str, MetricsSnapshot],
    *,
    requests: int | None,
    timeout: float | None = None,
) -> dict[str, MetricsDelta]:
    """Wait until *servers* together count *requests* more finished requests, then until each
    server's counters are stable; return the deltas. ``requests=None`` waits for any prefix-cache
    query instead (when the caller does not know the count)."""
    if not servers:
        return {}
    timeout = SETTLE_TIMEOUT if timeout is None else timeout
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


def _measured(
    servers: Sequence[ServerHandle], action: Callable[[], T], *, requests: int | None
) -> tuple[T, dict[str, MetricsDelta]]:
    before = _snapshots(servers)
    result = action()
    try:
        return result, _settle(servers, before, requests=requests)
    except MetricsSettleTimeout as exc:
        raise AssertionError(str(exc)) from exc


# ---------------------------------------------------------------------------------------------
# Metric tables
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One row of a failure table: a metric's before/after on a server and what was expected."""

    server: str
    metric: str
    before: float | None
    after: float | None
    expected: str
    ok: bool

    @property
    def delta(self) -> float | None:
        if self.after is None:
            return None
        return self.after - (self.before or 0.0)


def _num(v: float | None) -> str:
    if v is None:
        return "absent"
    return str(int(v)) if v == int(v) else f"{v:.4g}"


def _labels_text(labels: Mapping[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else ""


def _check(server: str, delta: MetricsDelta, name: str, op: str, target: float, **labels: str) -> Check:
    before = delta.before.get(name, **labels)
    after = delta.after.get(name, **labels)
    d = None if after is None else after - (before or 0.0)
    ok = (
        d is not None
        and {"==": d == target, ">": d > target, ">=": d >= target, "<": d < target, "<=": d <= target}[op]
    )
    return Check(server, name + _labels_text(labels), before, after, f"{op} {_num(target)}", ok)


def format_checks(checks: Sequence[Check]) -> str:
    """A table ``metric | before | after | delta | expected`` grouped by server; bad rows marked."""
    header = ("metric", "before", "after", "delta", "expected", "")
    rows = [
        (c.metric, _num(c.before), _num(c.after), _num(c.delta), c.expected, "ok" if c.ok else "<-- FAIL")
        for c in checks
    ]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(5)]

    def line(r: Sequence[str]) -> str:
        cells = [str(r[0]).ljust(widths[0])] + [str(r[i]).rjust(widths[i]) for i in range(1, 5)]
        return "    " + " | ".join(cells) + (f"  {r[5]}" if r[5] else "")

    out: list[str] = []
    server = None
    for c, r in zip(checks, rows, strict=True):
        if c.server != server:
            server = c.server
            out.append(f"  {server}:")
            out.append(line(header))
        out.append(line(r))
    return "\n".join(out)


def _fail(headline: str, checks: Sequence[Check]) -> AssertionError:
    return AssertionError(headline + ("\n" + format_checks(checks) if checks else ""))


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ComparisonResult:
    """Outputs that matched, their labels, and metrics deltas per server name (per run)."""

    outputs: tuple[Completion, ...]
    labels: tuple[str, ...]
    deltas: tuple[Mapping[str, MetricsDelta], ...] = ()


@dataclass(frozen=True)
class MeasuredResult:
    """What a cache/transfer check saw: outputs and deltas per server name, per request."""

    outputs: tuple[Any, ...]
    deltas: tuple[Mapping[str, MetricsDelta], ...]


# ---------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------


def _is_cluster(obj: object) -> bool:
    return hasattr(obj, "prefill") and hasattr(obj, "decode") and hasattr(obj, "proxy")


def _servers(cluster: PDCluster) -> list[ServerHandle]:
    return [*cluster.prefill, *cluster.decode]


def _compare(
    title: str, outputs: Sequence[Completion], labels: Sequence[str], *, engine: str | None, backend: str | None
) -> None:
    for i in range(1, len(outputs)):
        div = first_divergence(outputs[0], outputs[i])
        if div is not None:
            raise AssertionError(
                format_divergence(
                    title,
                    outputs[0],
                    outputs[i],
                    div,
                    labels=(labels[0], labels[i]),
                    engine=engine,
                    backend=backend,
                )
            )


def assert_deterministic(
    cluster_or_client: PDCluster | ServerHandle | httpx.Client,
    request: Mapping[str, Any],
    *,
    repeats: int = 2,
    endpoint: str | None = None,
) -> ComparisonResult:
    """Send *request* *repeats* times, one after another, and require identical outputs.

    With a cluster the requests go through the proxy. ``temperature=0`` and a seed are set unless
    given; token ids and top logprobs are requested so a failure shows the diverging token.
    """
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
    _compare("not deterministic", outputs, labels, engine=engine, backend=backend)
    return ComparisonResult(tuple(outputs), labels, tuple(deltas))


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
    """
    reference = single if single is not None else cluster.prefill[0]
    prepared = _with_defaults(request, cluster.model, determinism=True)
    servers = _servers(cluster)
    pd, d1 = _measured(servers, lambda: _complete_with_extras(cluster.client, prepared, endpoint), requests=2)
    ref, d2 = _measured(servers, lambda: _complete_with_extras(reference, prepared, endpoint), requests=1)
    labels = ("P/D", f"single {reference.name}")
    title = "P/D output differs from single-instance output"
    if logprob_tolerance is None:
        _compare(title, [pd, ref], labels, engine=cluster.engine, backend=cluster.attention_backend)
    else:
        _compare_logprobs(title, pd, ref, labels, logprob_tolerance, cluster)
    return ComparisonResult((pd, ref), labels, (d1, d2))


def _compare_logprobs(
    title: str, a: Completion, b: Completion, labels: tuple[str, str], tolerance: float, cluster: PDCluster
) -> None:
    for completion, label in ((a, labels[0]), (b, labels[1])):
        if completion.top1_logprob(0) is None:
            raise AssertionError(NO_LOGPROBS_MESSAGE.format(title=title, label=label))
    div = first_divergence(a, b)
    ids_a = a.token_ids or a.tokens or ()
    ids_b = b.token_ids or b.tokens or ()
    n = min(len(ids_a), len(ids_b)) if ids_a and ids_b else min(len(a.top_logprobs or ()), len(b.top_logprobs or ()))
    # After the first differing token the contexts differ, so later logprobs are not comparable.
    last = n if div is None or div.unit != "token" else min(n, div.index + 1)
    for i in range(last):
        la, lb = a.top1_logprob(i), b.top1_logprob(i)
        if la is None or lb is None:
            continue
        drift = abs(la - lb)
        if drift > tolerance:
            detail = format_divergence(
                title,
                a,
                b,
                Divergence("token", i, _common_prefix(a.text, b.text)),
                labels=labels,
                engine=cluster.engine,
                backend=cluster.attention_backend,
            )
            raise AssertionError(
                LOGPROB_DRIFT_MESSAGE.format(title=title, drift=drift, index=i, tolerance=tolerance)
                + "\n"
                + detail.split("\n", 1)[1]
            )


def _reset_prefix_caches(servers: Sequence[ServerHandle]) -> list[str]:
    """POST /reset_prefix_cache everywhere; returns the servers without that endpoint."""
    unsupported: list[str] = []
    for server in servers:
        resp = server.client.post("/reset_prefix_cache")
        if resp.status_code in (404, 405):
            unsupported.append(server.name)
            continue
        ok = resp.status_code == 200
        if ok and resp.content:
            try:
                body = resp.json()
            except ValueError:
                body = None
            if isinstance(body, Mapping) and body.get("success") is False:
                ok = False
        if not ok:
            raise AssertionError(
                RESET_FAILED_MESSAGE.format(server=server.name, status=resp.status_code, body=resp.text[:300])
            )
    return unsupported


def _hit_checks(deltas: Mapping[str, MetricsDelta], op: str, target: float) -> list[Check]:
    return [_check(name, d, PREFIX_CACHE_HITS, op, target) for name, d in deltas.items() if d.has(PREFIX_CACHE_HITS)]


def _sum(deltas: Mapping[str, MetricsDelta], name: str, **labels: str) -> float:
    return sum((d.get(name, **labels) or 0.0) for d in deltas.values())


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
    """
    servers = _servers(cluster)
    if reset is not None:
        reset()
        unsupported: list[str] = []
    else:
        unsupported = _reset_prefix_caches(servers)
    prepared = _with_defaults(request, cluster.model, determinism=True)
    run = lambda: _complete_with_extras(cluster.client, prepared, endpoint)  # noqa: E731
    cold, cold_d = _measured(servers, run, requests=2)
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
    """
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
    """
    prepared = _with_defaults(request, cluster.model, determinism=False)
    servers = _servers(cluster)
    send = lambda: complete(cluster.client, prepared, endpoint=endpoint)  # noqa: E731
    out1, d1 = _measured(servers, send, requests=2)
    firsts = {s.name: d1[s.name].get(NIXL_BYTES_SUM) or 0.0 for s in cluster.decode}
    target, first = max(firsts.items(), key=lambda kv: kv[1])
    first_checks = [_check(s.name, d1[s.name], NIXL_BYTES_SUM, ">", 0) for s in cluster.decode]
    if first <= 0:
        raise _fail(FIRST_TRANSFER_ZERO_MESSAGE.format(first=_num(first)), first_checks)
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
# Prompt-token sources (vLLM's multi-connector edge-case arithmetic)
# ---------------------------------------------------------------------------------------------


def expected_prompt_token_sources(
    expect: str,
    *,
    prompt_tokens: int,
    block_size: int,
    prefix_tokens: int | None = None,
    local_cache_hit: int | None = None,
) -> dict[str, int]:
    """``{source: tokens}`` a decode server must count for one request.

    - ``cold_decode`` (D never saw the prompt): all P tokens arrive over NIXL.
    - ``full_hit`` (D primed directly with the same prompt): D hits whole blocks of at most P-1
      tokens, ``((P-1)//B)*B`` (vLLM always computes the last token); the rest arrives over NIXL.
    - ``partial_hit`` (D primed with a *prefix_tokens*-long prefix): ``(min(L, P-1)//B)*B`` hit.
    - ``direct_decode`` (sent to D directly, no proxy): nothing external; what missed
      *local_cache_hit* (observed) is computed locally.
    """
    if expect not in EXPECT_CHOICES:
        raise ValueError(f"expect={expect!r} is not valid; accepted: {', '.join(EXPECT_CHOICES)}")
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens={prompt_tokens!r} must be >= 1")
    if block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be >= 1")
    p, b = prompt_tokens, block_size
    if expect == "cold_decode":
        return {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": p}
    if expect == "direct_decode":
        hit = local_cache_hit or 0
        return {"local_compute": p - hit, "local_cache_hit": hit, "external_kv_transfer": 0}
    if expect == "full_hit":
        cached = ((p - 1) // b) * b
    else:
        if prefix_tokens is None or prefix_tokens < 1:
            raise ValueError(f"expect='partial_hit' needs prefix_tokens >= 1, got {prefix_tokens!r}")
        cached = (min(prefix_tokens, p - 1) // b) * b
    return {"local_compute": 0, "local_cache_hit": cached, "external_kv_transfer": p - cached}


def _source_checks(
    server: str, delta: MetricsDelta, expect: str, prompt_tokens: int, block_size: int, prefix_tokens: int | None
) -> list[Check]:
    observed_hit = delta.get(PROMPT_TOKENS_BY_SOURCE, source="local_cache_hit")
    expected = expected_prompt_token_sources(
        expect,
        prompt_tokens=prompt_tokens,
        block_size=block_size,
        prefix_tokens=prefix_tokens,
        local_cache_hit=int(observed_hit or 0),
    )
    checks = [
        _check(server, delta, PROMPT_TOKENS_BY_SOURCE, "==", expected[src], source=src)
        for src in ("local_compute", "local_cache_hit", "external_kv_transfer")
    ]
    if expect == "direct_decode":
        max_hit = ((prompt_tokens - 1) // block_size) * block_size
        hit_check = checks[1]
        valid = observed_hit is not None and observed_hit % block_size == 0 and observed_hit <= max_hit
        checks[1] = Check(
            server,
            hit_check.metric,
            hit_check.before,
            hit_check.after,
            f"k*{block_size} <= {max_hit}",
            valid,
        )
        nixl = _check(server, delta, NIXL_BYTES_SUM, "==", 0)
        if nixl.after is None:  # a server without NixlConnector moved nothing, as expected
            nixl = Check(server, NIXL_BYTES_SUM, None, None, "== 0 (or absent)", True)
        checks.append(nixl)
    else:
        checks.append(_check(server, delta, NIXL_BYTES_SUM, ">", 0))
    return checks


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
    """
    if expect not in EXPECT_CHOICES:
        raise ValueError(f"expect={expect!r} is not valid; accepted: {', '.join(EXPECT_CHOICES)}")
    if isinstance(delta_or_cluster, MetricsDelta):
        if prompt_tokens is None or block_size is None:
            raise ValueError("with a MetricsDelta, prompt_tokens and block_size are required")
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
    reached = [s for s in measured if (deltas[s.name].get(PROMPT_TOKENS) or 0) > 0] or measured[:1]
    checks: list[Check] = []
    for server in reached:
        checks += _source_checks(server.name, deltas[server.name], expect, p, block, prefix_tokens)
    _raise_if_failed(checks, expect, p, block, prefix_tokens)
    return MeasuredResult(tuple(outputs), (deltas,))


def _raise_if_failed(
    checks: Sequence[Check], expect: str, prompt_tokens: int, block_size: int, prefix_tokens: int | None
) -> None:
    if all(c.ok for c in checks):
        return
    extra = f", prefix_tokens={prefix_tokens}" if prefix_tokens is not None else ""
    raise _fail(
        PROMPT_SOURCES_MESSAGE.format(expect=expect, prompt_tokens=prompt_tokens, block_size=block_size, extra=extra),
        checks,
    )
