"""Scrape a vLLM-style ``/metrics`` endpoint and compare snapshots.

Parsing gives what :func:`prometheus_client.parser.text_string_to_metric_families` gives (a faster reader of the
subset vLLM writes first, ``common/exposition.py``, checked against it), never a ``startswith`` match:
samples are keyed by their **exact** sample name plus their label set, so
``vllm:prefix_cache_hits_total`` never matches ``vllm:prefix_cache_hits_created`` (the
``startswith`` bug of vLLM's own tests).

A metric that is not exposed at all is *missing*, which is different from zero: a server without
NixlConnector has no ``vllm:nixl_*`` samples. ``value()`` raises :class:`MetricNotFoundError`
for a missing metric (strict snapshots, the default); ``get()`` returns ``None``.

vLLM records metrics asynchronously (after the HTTP response has been sent), so wait with
:func:`wait_settled` instead of sleeping.

This module is pytest-free.
"""

from __future__ import annotations

import difflib
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pytest_pdserve.clients import body_excerpt, request_failed
from pytest_pdserve.common.deadline import get_within
from pytest_pdserve.common.digits import is_int
from pytest_pdserve.common.exposition import parse_samples

# Re-exported: scrape / wait_settled raise them and `pytest_pdserve.metrics` is public (README); they live in
# errors.py with every other exception.
from pytest_pdserve.errors import MetricNotFoundError, MetricsScrapeError, MetricsSettleTimeout

__all__ = [
    "CACHED_SOURCES",
    "DEFAULT_SETTLE_NAMES",
    "PROMPT_SOURCES",
    "MetricNotFoundError",
    "MetricsDelta",
    "MetricsScrapeError",
    "MetricsSettleTimeout",
    "MetricsSnapshot",
    "parse_metrics",
    "scrape",
    "wait_settled",
]

LabelSet = frozenset[tuple[str, str]]
"""A sample's labels, order-free and hashable."""

SampleKey = tuple[str, LabelSet]
"""(exact sample name, label set)."""

PromptSource = Literal["local_compute", "local_cache_hit", "external_kv_transfer"]
CachedSource = Literal["device", "host", "p2p", "disk", "external_unspecified"]

PROMPT_SOURCES: tuple[str, ...] = ("local_compute", "local_cache_hit", "external_kv_transfer")
"""Values of the ``source`` label of ``vllm:prompt_tokens_by_source_total``."""

CACHED_SOURCES: tuple[str, ...] = ("device", "host", "p2p", "disk", "external_unspecified")
"""Values of the ``source`` label of ``vllm:prompt_tokens_cached_by_source_total``."""

# Exact sample names (vLLM 0.32/0.33; counters carry prometheus_client's ``_total`` suffix).
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
EXTERNAL_PREFIX_CACHE_QUERIES = "vllm:external_prefix_cache_queries_total"
EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits_total"
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
PROMPT_TOKENS_CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
NIXL_BYTES_SUM = "vllm:nixl_bytes_transferred_sum"
NIXL_BYTES_COUNT = "vllm:nixl_bytes_transferred_count"
NIXL_FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers_total"
NIXL_DESCRIPTORS_SUM = "vllm:nixl_num_descriptors_sum"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"
CACHE_CONFIG_INFO = "vllm:cache_config_info"
"""An info gauge (always 1) whose labels are the engine's effective CacheConfig (``block_size``, ...)."""

DEFAULT_SETTLE_NAMES: tuple[str, ...] = (
    REQUEST_SUCCESS,
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    PROMPT_TOKENS_BY_SOURCE,
    NIXL_BYTES_SUM,
)
"""Counters :func:`wait_settled` watches by default (missing ones are ignored)."""

MISSING_METRIC_MESSAGE = "metric {name}{labels} is not exposed by {source}{hint}"
"""Template of :class:`MetricNotFoundError` messages."""

NIXL_MISSING_HINT = " (no vllm:nixl_* metrics at all: is this server running with NixlConnector?)"


def _format_labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _format_number(value: float) -> str:
    if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


class _Accessors:
    """Named accessors shared by snapshots and deltas; each sums over all series of a metric."""

    def value(self, name: str, **labels: str) -> float:  # pragma: no cover - overridden
        raise NotImplementedError

    def prefix_cache_queries(self, **labels: str) -> float:
        """``vllm:prefix_cache_queries_total`` (tokens looked up in the local prefix cache)."""
        return self.value(PREFIX_CACHE_QUERIES, **labels)

    def prefix_cache_hits(self, **labels: str) -> float:
        """``vllm:prefix_cache_hits_total`` (tokens found in the local prefix cache)."""
        return self.value(PREFIX_CACHE_HITS, **labels)

    def external_prefix_cache_queries(self, **labels: str) -> float:
        """``vllm:external_prefix_cache_queries_total`` (tokens asked of the KV connector)."""
        return self.value(EXTERNAL_PREFIX_CACHE_QUERIES, **labels)

    def external_prefix_cache_hits(self, **labels: str) -> float:
        """``vllm:external_prefix_cache_hits_total`` (tokens the KV connector provided)."""
        return self.value(EXTERNAL_PREFIX_CACHE_HITS, **labels)

    def prompt_tokens_by_source(self, source: str, **labels: str) -> float:
        """``vllm:prompt_tokens_by_source_total{source=...}``; *source* is one of :data:`PROMPT_SOURCES`."""
        _check_choice(source, PROMPT_SOURCES, "source of prompt_tokens_by_source")
        return self.value(PROMPT_TOKENS_BY_SOURCE, source=source, **labels)

    def prompt_tokens_cached_by_source(self, source: str, **labels: str) -> float:
        """``vllm:prompt_tokens_cached_by_source_total{source=...}``; *source* in :data:`CACHED_SOURCES`."""
        _check_choice(source, CACHED_SOURCES, "source of prompt_tokens_cached_by_source")
        return self.value(PROMPT_TOKENS_CACHED_BY_SOURCE, source=source, **labels)

    def nixl_bytes_transferred(self, **labels: str) -> float:
        """Bytes moved by NIXL: the ``_sum`` of the ``vllm:nixl_bytes_transferred`` histogram."""
        return self.value(NIXL_BYTES_SUM, **labels)

    def nixl_transfers(self, **labels: str) -> float:
        """NIXL transfers: the ``_count`` of the ``vllm:nixl_bytes_transferred`` histogram."""
        return self.value(NIXL_BYTES_COUNT, **labels)

    def nixl_failed_transfers(self, **labels: str) -> float:
        """``vllm:nixl_num_failed_transfers_total``."""
        return self.value(NIXL_FAILED_TRANSFERS, **labels)

    def nixl_num_descriptors(self, **labels: str) -> float:
        """The ``_sum`` of the ``vllm:nixl_num_descriptors`` histogram."""
        return self.value(NIXL_DESCRIPTORS_SUM, **labels)

    def generation_tokens(self, **labels: str) -> float:
        """``vllm:generation_tokens_total``."""
        return self.value(GENERATION_TOKENS, **labels)

    def prompt_tokens(self, **labels: str) -> float:
        """``vllm:prompt_tokens_total``."""
        return self.value(PROMPT_TOKENS, **labels)

    def request_success(self, **labels: str) -> float:
        """``vllm:request_success_total``, summed over ``finished_reason`` unless given."""
        return self.value(REQUEST_SUCCESS, **labels)


def _check_choice(value: str, accepted: tuple[str, ...], what: str) -> None:
    if value not in accepted:
        raise ValueError(f"{value!r} is not a valid {what}; accepted: {', '.join(accepted)}")


@dataclass(frozen=True)
class MetricsSnapshot(_Accessors):
    """One immutable scrape: ``samples[(exact_name, frozenset(labels))] = value``.

    :param source: where it came from (the ``/metrics`` URL), used in error messages.
    :param strict: when true (default) ``value()`` raises :class:`MetricNotFoundError` for an
        absent metric; when false it returns ``0.0`` instead.
    """

    samples: Mapping[SampleKey, float]
    source: str = "<text>"
    strict: bool = True
    taken_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        # Freeze the mapping so a snapshot can be shared and compared safely.
        object.__setattr__(self, "samples", MappingProxyType(dict(self.samples)))

    @property
    def names(self) -> frozenset[str]:
        """Every exact sample name present."""
        return frozenset(name for name, _ in self.samples)

    def has(self, name: str, **labels: str) -> bool:
        """Whether at least one sample named exactly *name* carries all of *labels*."""
        return bool(self._matching(name, labels))

    def series(self, name: str) -> dict[LabelSet, float]:
        """All label sets of sample *name* with their values (empty when absent)."""
        return {lbl: v for (n, lbl), v in self.samples.items() if n == name}

    def info(self, name: str = CACHE_CONFIG_INFO) -> dict[str, str] | None:
        """The labels of info gauge *name* (vLLM's ``vllm:cache_config_info``): ``None`` when absent."""
        for (n, lbl), _ in self.samples.items():
            if n == name:
                return dict(lbl)
        return None

    def block_size(self) -> int | None:
        """The effective block size from ``vllm:cache_config_info``, ``None`` when not exposed."""
        raw = (self.info() or {}).get("block_size")
        return int(raw) if raw is not None and is_int(raw) else None  # str.isdigit() is true for "²"

    def _matching(self, name: str, labels: Mapping[str, str]) -> list[float]:
        wanted = set(labels.items())
        return [v for (n, lbl), v in self.samples.items() if n == name and wanted <= lbl]

    def get(self, name: str, **labels: str) -> float | None:
        """Sum of samples named exactly *name* whose labels include *labels*; ``None`` if none."""
        found = self._matching(name, labels)
        return math.fsum(found) if found else None

    def value(self, name: str, **labels: str) -> float:
        """Like :meth:`get`, but an absent metric raises (strict) or reads as 0.0 (not strict)."""
        got = self.get(name, **labels)
        if got is not None:
            return got
        if not self.strict:
            return 0.0
        raise MetricNotFoundError(self.missing_message(name, labels))

    def missing_message(self, name: str, labels: Mapping[str, str]) -> str:
        """Explain why *name* with *labels* is absent: close names or the label sets that exist."""
        hint = ""
        present = self.series(name)
        if present:
            sets = sorted(_format_labels(dict(lbl)) for lbl in present)
            hint = f"; it has only the series {', '.join(sets)}"
        elif name.startswith("vllm:nixl_") and not any(n.startswith("vllm:nixl_") for n in self.names):
            hint = NIXL_MISSING_HINT
        else:
            close = difflib.get_close_matches(name, sorted(self.names), n=3, cutoff=0.75)
            if close:
                hint = f"; did you mean {', '.join(close)}?"
        return MISSING_METRIC_MESSAGE.format(
            name=name, labels=_format_labels(dict(labels)), source=self.source, hint=hint
        )

    def __sub__(self, other: MetricsSnapshot) -> MetricsDelta:
        if not isinstance(other, MetricsSnapshot):
            return NotImplemented
        return MetricsDelta(before=other, after=self)

    def __str__(self) -> str:
        lines = [f"MetricsSnapshot of {self.source} ({len(self.samples)} samples)"]
        for (name, lbl), v in sorted(self.samples.items(), key=lambda kv: (kv[0][0], sorted(kv[0][1]))):
            if name.endswith(("_created", "_bucket")):
                continue  # timestamps and buckets drown the useful lines
            lines.append(f"  {name}{_format_labels(dict(lbl))} {_format_number(v)}")
        return "\n".join(lines)


@dataclass(frozen=True)
class MetricsDelta(_Accessors):
    """``after - before`` for counters; same accessors as :class:`MetricsSnapshot`.

    A metric that appears only in *after* counts as 0 before (vLLM creates some labelled series
    lazily). One absent from *after* raises :class:`MetricNotFoundError` (strict) or reads 0.
    """

    before: MetricsSnapshot
    after: MetricsSnapshot

    @property
    def source(self) -> str:
        """The *after* snapshot's source."""
        return self.after.source

    def get(self, name: str, **labels: str) -> float | None:
        """``after - before`` for the summed samples, or ``None`` when absent from *after*."""
        after = self.after.get(name, **labels)
        if after is None:
            return None
        before = self.before.get(name, **labels)
        return after - (before if before is not None else 0.0)

    def value(self, name: str, **labels: str) -> float:
        """Like :meth:`get`, raising :class:`MetricNotFoundError` when absent (if *after* is strict)."""
        got = self.get(name, **labels)
        if got is not None:
            return got
        if not self.after.strict:
            return 0.0
        raise MetricNotFoundError(self.after.missing_message(name, labels))

    def has(self, name: str, **labels: str) -> bool:
        """Whether *name* (with *labels*) is present in the *after* snapshot."""
        return self.after.has(name, **labels)

    def changed(self) -> dict[SampleKey, tuple[float, float]]:
        """Every sample whose value differs, as ``key -> (before, after)`` (``_created`` excluded)."""
        out: dict[SampleKey, tuple[float, float]] = {}
        for key, after in self.after.samples.items():
            if key[0].endswith("_created"):
                continue
            before = self.before.samples.get(key, 0.0)
            if before != after:
                out[key] = (before, after)
        return out

    def __str__(self) -> str:
        changed = self.changed()
        lines = [f"MetricsDelta of {self.source} ({len(changed)} samples changed)"]
        for (name, lbl), (b, a) in sorted(changed.items(), key=lambda kv: (kv[0][0], sorted(kv[0][1]))):
            if name.endswith("_bucket"):
                continue
            lines.append(
                f"  {name}{_format_labels(dict(lbl))}: {_format_number(b)} -> {_format_number(a)}"
                f" (delta {_format_number(a - b)})"
            )
        return "\n".join(lines)


def parse_metrics(text: str, *, source: str = "<text>", strict: bool = True) -> MetricsSnapshot:
    """Parse Prometheus text exposition into a :class:`MetricsSnapshot`.

    :raises MetricsScrapeError: when *text* is not valid exposition text (naming *source*).
    """
    samples: dict[SampleKey, float] = {}
    fast = parse_samples(text)
    if fast is not None:  # what prometheus_client would give, about 5x sooner (common/exposition.py)
        for name, labels, value in fast:
            samples[(name, labels)] = value
        return MetricsSnapshot(samples=samples, source=source, strict=strict)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = (sample.name, frozenset(sample.labels.items()))
                samples[key] = float(sample.value)
    except (ValueError, OverflowError) as exc:  # OverflowError: an integer of over 308 digits, as float()
        head = text[:200].replace("\n", "\\n")
        raise MetricsScrapeError(
            f"{source} did not return Prometheus text exposition ({exc}); it starts with {head!r}"
        ) from exc
    return MetricsSnapshot(samples=samples, source=source, strict=strict)


def _metrics_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"metrics URL {url!r} must start with http:// or https://")
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


def scrape(target: str | httpx.Client, *, timeout: float = 10.0, strict: bool = True) -> MetricsSnapshot:
    """GET ``/metrics`` from *target* and parse it.

    :param target: a server base URL (``http://127.0.0.1:8100``; ``/metrics`` is appended unless
        present) or an ``httpx.Client`` whose ``base_url`` is the server.
    :raises MetricsScrapeError: on a connection error or a non-200 answer (naming the URL).
    """
    if isinstance(target, httpx.Client):
        source = str(target.base_url.join("/metrics"))
        try:
            response = get_within(target, "/metrics", timeout)
        except httpx.HTTPError as exc:
            raise MetricsScrapeError(f"GET {source} failed: {type(exc).__name__}: {exc}") from exc
    else:
        source = _metrics_url(target)
        try:
            response = get_within(None, source, timeout)
        except httpx.HTTPError as exc:
            raise MetricsScrapeError(f"GET {source} failed: {type(exc).__name__}: {exc}") from exc
    if request_failed(response):
        raise MetricsScrapeError(f"GET {source} returned HTTP {response.status_code}: {body_excerpt(response.text)!r}")
    return parse_metrics(response.text, source=source, strict=strict)


def _watched(snapshot: MetricsSnapshot, names: Iterable[str]) -> dict[str, float | None]:
    return {name: snapshot.get(name) for name in names}


def wait_settled(
    scrape: Callable[[], MetricsSnapshot],
    *,
    names: Iterable[str] = DEFAULT_SETTLE_NAMES,
    timeout: float = 30.0,
    interval: float = 0.02,
    stable_for: int = 2,
    until: Callable[[MetricsSnapshot], bool] | None = None,
) -> MetricsSnapshot:
    """Poll *scrape* until the watched counters stop changing (and *until* holds), then return.

    Use this after a request instead of ``sleep``: vLLM updates its counters after the response.
    Stability alone can return before a slow update lands, so pass *until* when you know what must
    have happened (e.g. ``lambda s: s.request_success() >= before.request_success() + 1``).

    :param names: exact sample names to watch (summed over labels; absent ones are ignored).
    :param stable_for: how many consecutive polls must see unchanged values.
    :raises MetricsSettleTimeout: after *timeout* seconds, naming the counters that kept
        changing or saying that *until* never held.
    :raises ValueError: for a non-positive *timeout*/*interval* or *stable_for* < 1.
    """
    if timeout <= 0 or interval <= 0:
        raise ValueError(f"timeout ({timeout!r}) and interval ({interval!r}) must be > 0")
    if stable_for < 1:
        raise ValueError(f"stable_for={stable_for!r} must be >= 1")
    watched = tuple(names)
    deadline = time.monotonic() + timeout
    first = snapshot = scrape()
    last = _watched(snapshot, watched)
    stable = 0
    # Bounded both by time and by count (a scrape that returns instantly must not spin forever).
    # The count has room for *stable_for* polls past the deadline: on a loaded machine one scrape of
    # vLLM can take seconds, and values that were unchanged at the deadline have not "kept changing";
    # they only lacked the confirming polls, so those are taken before judging.
    max_polls = int(timeout / interval) + 2 * stable_for + 2
    for polls in range(max_polls):
        condition = until is None or until(snapshot)
        if condition and stable >= stable_for:
            return snapshot
        # At least one poll after the first: a single snapshot shows neither stability nor change.
        if time.monotonic() >= deadline and polls > 0 and not (condition and stable > 0):
            break
        time.sleep(interval)
        snapshot = scrape()
        current = _watched(snapshot, watched)
        stable = stable + 1 if current == last else 0
        last = current
    if until is not None and not until(snapshot):
        raise MetricsSettleTimeout(
            f"metrics of {snapshot.source} did not reach the awaited condition within {timeout} s;"
            f" last values: {_describe(last)}"
        )
    moving = {n: (first.get(n), last[n]) for n in watched if first.get(n) != last[n]}
    raise MetricsSettleTimeout(
        f"metrics of {snapshot.source} kept changing for {timeout} s"
        f" ({', '.join(f'{n}: {b} -> {a}' for n, (b, a) in moving.items()) or 'no net change'});"
        " is another client sending requests to this server?"
    )


def _describe(values: Mapping[str, float | None]) -> str:
    return ", ".join(f"{n}={'absent' if v is None else _format_number(v)}" for n, v in values.items())
