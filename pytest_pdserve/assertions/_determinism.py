"""Comparisons of outputs: determinism, P/D against a single server, cold against warm cache."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from pytest_pdserve.assertions._completions import (
    Completion,
    complete_with_extras,
    with_defaults,
)
from pytest_pdserve.assertions._measure import ClusterLike as PDCluster
from pytest_pdserve.assertions._measure import ServerLike as ServerHandle
from pytest_pdserve.assertions._measure import is_cluster, measured, servers_of, summed
from pytest_pdserve.assertions._preconditions import (
    require_more_than_a_block,
    require_output,
    require_pd,
)
from pytest_pdserve.assertions._report import (
    Check,
    FlipVerdict,
    compare_logprobs,
    compare_outputs,
    failure,
    fmt_num,
    metric_check,
)
from pytest_pdserve.clients import reset_prefix_cache
from pytest_pdserve.metrics import (
    PREFIX_CACHE_HITS,
    MetricsDelta,
)

T = TypeVar("T")

VACUOUS_WARM_MESSAGE = (
    "vacuous: the warm run hit no prefix cache on {servers}, so cold and warm outputs were computed"
    " the same way; use a prompt longer than one block ({block_size} tokens)"
)
COLD_NOT_COLD_MESSAGE = "vacuous: the cold run already hit the prefix cache ({hits} tokens); {why}"


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
    if is_cluster(cluster_or_client):
        cluster: PDCluster = cluster_or_client  # type: ignore[assignment]
        target, servers, model = cluster.client, servers_of(cluster), cluster.model
        engine, backend = cluster.engine, cluster.attention_backend
    elif isinstance(cluster_or_client, httpx.Client):
        target = cluster_or_client
    else:
        handle: ServerHandle = cluster_or_client  # type: ignore[assignment]
        target = handle
        if handle.role != "proxy":
            servers = [handle]
    prepared = with_defaults(request, model, determinism=True)
    per_request = 2 if servers and is_cluster(cluster_or_client) else 1
    outputs: list[Completion] = []
    deltas: list[Mapping[str, MetricsDelta]] = []
    for _ in range(repeats):
        out, delta = measured(servers, lambda: complete_with_extras(target, prepared, endpoint), requests=per_request)
        outputs.append(out)
        deltas.append(delta)
    labels = tuple(f"run {i + 1}" for i in range(repeats))
    require_output("not deterministic", outputs)
    ties = compare_outputs(
        "not deterministic", outputs, labels, engine=engine, backend=backend, tie_tolerance=tie_tolerance
    )
    return ComparisonResult(tuple(outputs), labels, tuple(deltas), tuple(ties))


def assert_batch_invariant(
    cluster: PDCluster,
    request: Mapping[str, Any],
    fillers: Sequence[Mapping[str, Any]],
    *,
    batch_sizes: Sequence[int] = (1, 4, 16),
    endpoint: str | None = None,
    tie_tolerance: float | None = None,
) -> ComparisonResult:
    """*request*'s output must not depend on how many other requests the engine batches it with.

    For each size ``n`` in *batch_sizes*, *request* is sent through the proxy at the same time as ``n - 1`` of
    *fillers* (other prompts, so the engine runs them in one batch), and every output is compared with the first
    size's. vLLM's kernels are not batch-invariant by default (``VLLM_BATCH_INVARIANT=1`` asks for it), so a
    divergence is reported with its tie / confident verdict like :func:`assert_deterministic`'s.

    :param fillers: at least ``max(batch_sizes) - 1`` requests (fields as in *request*).
    """
    __tracebackhide__ = True
    if not batch_sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in batch_sizes):
        raise ValueError(f"batch_sizes={batch_sizes!r} must be whole numbers >= 1")
    if len(batch_sizes) < 2:
        raise ValueError(f"batch_sizes={batch_sizes!r} must name at least two sizes to compare anything")
    if len(fillers) < max(batch_sizes) - 1:
        raise ValueError(f"{len(fillers)} fillers for a batch of {max(batch_sizes)}: need {max(batch_sizes) - 1}")
    if tie_tolerance is not None and not tie_tolerance > 0:
        raise ValueError(f"tie_tolerance={tie_tolerance!r} must be > 0 (nats)")
    from concurrent.futures import ThreadPoolExecutor  # only this check sends requests concurrently

    probe = with_defaults(request, cluster.model, determinism=True)
    others = [with_defaults(f, cluster.model, determinism=True) for f in fillers]
    outputs: list[Completion] = []
    with ThreadPoolExecutor(max_workers=max(batch_sizes)) as pool:
        for n in batch_sizes:
            batch = [probe, *others[: n - 1]]
            futures = [pool.submit(complete_with_extras, cluster.client, body, endpoint) for body in batch]
            outputs.append(futures[0].result())
            for future in futures[1:]:
                future.result()  # a filler that failed is a failed check too
    labels = tuple(f"batch of {n}" for n in batch_sizes)
    title = "output depends on the batch size"
    require_output(title, outputs)
    ties = compare_outputs(
        title, outputs, labels, engine=cluster.engine, backend=cluster.attention_backend, tie_tolerance=tie_tolerance
    )
    return ComparisonResult(tuple(outputs), labels, (), tuple(ties))


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
    prepared = with_defaults(request, cluster.model, determinism=True)
    servers = servers_of(cluster)
    pd, d1 = measured(servers, lambda: complete_with_extras(cluster.client, prepared, endpoint), requests=2)
    ref, d2 = measured(servers, lambda: complete_with_extras(reference, prepared, endpoint), requests=1)
    labels = ("P/D", f"single {reference.name}")
    title = "P/D output differs from single-instance output"
    require_pd(title, cluster, d1)
    require_output(title, [pd, ref])
    if logprob_tolerance is None:
        compare_outputs(title, [pd, ref], labels, engine=cluster.engine, backend=cluster.attention_backend)
    else:
        compare_logprobs(title, pd, ref, labels, logprob_tolerance, cluster)
    return ComparisonResult((pd, ref), labels, (d1, d2))


def _reset_prefix_caches(servers: Sequence[ServerHandle]) -> list[str]:
    """POST /reset_prefix_cache everywhere; returns the servers without that endpoint."""
    __tracebackhide__ = True
    return [server.name for server in servers if not reset_prefix_cache(server.client, server.name)]


def _hit_checks(deltas: Mapping[str, MetricsDelta], op: str, target: float) -> list[Check]:
    return [
        metric_check(name, d, PREFIX_CACHE_HITS, op, target) for name, d in deltas.items() if d.has(PREFIX_CACHE_HITS)
    ]


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
    servers = servers_of(cluster)
    if reset is not None:
        reset()
        unsupported: list[str] = []
    else:
        unsupported = _reset_prefix_caches(servers)
    prepared = with_defaults(request, cluster.model, determinism=True)
    run = lambda: complete_with_extras(cluster.client, prepared, endpoint)  # noqa: E731
    cold, cold_d = measured(servers, run, requests=2)
    require_more_than_a_block("assert_cold_warm_match", cold.prompt_tokens, cluster.block_size)
    warm, warm_d = measured(servers, run, requests=2)
    cold_hits = summed(cold_d, PREFIX_CACHE_HITS)
    if cold_hits > 0:
        why = (
            f"{', '.join(unsupported)} cannot reset (start vLLM with VLLM_SERVER_DEV_MODE=1, or pass reset=)"
            if unsupported
            else "the reset did not empty the cache"
        )
        raise failure(COLD_NOT_COLD_MESSAGE.format(hits=fmt_num(cold_hits), why=why), _hit_checks(cold_d, "==", 0))
    if summed(warm_d, PREFIX_CACHE_HITS) <= 0:
        raise failure(
            VACUOUS_WARM_MESSAGE.format(servers=", ".join(s.name for s in servers), block_size=cluster.block_size),
            _hit_checks(warm_d, ">", 0),
        )
    labels = ("cold", "warm")
    compare_outputs(
        "cold and warm outputs differ", [cold, warm], labels, engine=cluster.engine, backend=cluster.attention_backend
    )
    return ComparisonResult((cold, warm), labels, (cold_d, warm_d))
