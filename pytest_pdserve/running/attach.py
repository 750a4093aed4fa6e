"""Attach mode: a cluster made of servers someone else started.

`attach` checks every given prefill/decode (and proxy) URL in parallel - health, served model, block
size from ``vllm:cache_config_info`` - and builds a `PDCluster` from them; it starts and leases
nothing. `attach_mismatch` says what a spec asks for that the attached deployment does not have, so
the manager can skip it instead of faking it. `start_attached` is what `ClusterManager.attached` (in
`manager.py`) runs once per session: it checks the URLs and starts the built-in proxy in front of them
when no proxy URL is given.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx

from pytest_pdserve.cluster import PDCluster, ServerHandle
from pytest_pdserve.common.deadline import get_within
from pytest_pdserve.common.digits import is_int
from pytest_pdserve.config.cluster_settings import ClusterSettings
from pytest_pdserve.config.effective import AskedConfig
from pytest_pdserve.errors import AttachError, MetricsScrapeError, ResponseTooLarge
from pytest_pdserve.machine import leases
from pytest_pdserve.metrics import scrape
from pytest_pdserve.running.hints import AUTH_HINT
from pytest_pdserve.running.launch import ClusterLauncher, LaunchedCluster
from pytest_pdserve.running.process import ServerProcess
from pytest_pdserve.spec import ClusterSpec

#: ClusterSpec fields attach mode cannot apply to servers it did not start (compared with the defaults).
_SERVER_SETTINGS = (
    "prefill_tp", "decode_tp", "model_kind", "max_model_len", "gpu_memory_utilization", "enable_prefix_caching",
    "mamba_cache_mode", "trust_remote_code", "kv_connector", "kv_buffer_device", "kv_load_failure_policy",
    "kv_connector_extra_config", "extra_args", "prefill_extra_args", "decode_extra_args", "env", "prefill_env",
    "decode_env",
)  # fmt: skip


def start_attached(
    settings: ClusterSettings, launcher: ClusterLauncher, asked: AskedConfig, environ: Mapping[str, str]
) -> LaunchedCluster:
    """Check every attached URL, then use the given proxy or start the built-in one in front of the servers.

    ``settings`` are the session's (its ``*_urls``, ``proxy_url``, ``model`` and ``attach_origin``);
    ``asked`` the attached cluster's spec merged with the session (``effective.effective``); ``environ`` is what the
    built-in proxy inherits (``start_env.start_environ``).
    """
    __tracebackhide__ = True
    t0 = time.monotonic()
    proxy_url = settings.proxy_url
    cluster = attach(
        prefill_urls=settings.prefill_urls, decode_urls=settings.decode_urls, proxy_url=proxy_url,
        model=settings.model, api_key=asked.api_key, attention_backend=asked.attention_backend,
        block_size=asked.block_size, check_only=proxy_url is None, origin=dict(settings.attach_origin),
    )  # fmt: skip
    processes: list[ServerProcess] = []
    port_leases: list[leases.PortLease] = []
    if proxy_url is None:
        # The servers answered: only now start a proxy in front of them (it leases its own port only).
        try:
            servers = [*cluster.prefill, *cluster.decode]
            cluster.set_proxy(launcher.start_proxy("attached", servers, processes, port_leases, t0, environ))
        except BaseException:
            launcher.cleanup("attached", processes, None, port_leases)
            raise
    cluster.started_seconds = time.monotonic() - t0
    launcher.report(cluster.describe())
    return LaunchedCluster(cluster, processes, None, port_leases, "attached")


def attach(
    *,
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    proxy_url: str | None,
    model: str | None,
    api_key: str | None,
    attention_backend: str | None,
    block_size: int,
    timeout: float = 10.0,
    check_only: bool = False,
    origin: Mapping[str, str] | None = None,
) -> PDCluster:
    """A cluster made of servers someone else started (attach mode); starts and leases nothing.

    Every prefill and decode URL must answer ``GET /health`` with 200 and list the model in
    ``GET /v1/models`` (the first model of the first prefill server when ``model`` is None); they are
    checked in parallel and one `AttachError` names every URL that did not. ``proxy_url`` must answer
    ``/health`` or ``/healthcheck`` (vLLM's toy proxy). With ``check_only`` the proxy is left as a
    placeholder for the caller to fill in. The block size is read from the servers'
    ``vllm:cache_config_info`` metric when they export it, else ``block_size`` (the session's, merged by
    `effective.effective`). URL passwords never reach an error message (`AttachError` is redacted).

    :param origin: where each role's URLs came from (``{"decode": "--pd-decode-url"}``), for the error.
    """
    __tracebackhide__ = True
    where = dict(origin or {})
    if not prefill_urls or not decode_urls:
        raise AttachError(
            "attach mode needs at least one prefill URL (--pd-prefill-url, $PDSERVE_PREFILL_URLS or ini "
            "pdserve_prefill_urls) and one decode URL (--pd-decode-url, $PDSERVE_DECODE_URLS or ini "
            f"pdserve_decode_urls); got prefill {list(prefill_urls)}, decode {list(decode_urls)}"
            + (f", proxy {proxy_url}" if proxy_url else "")
        )
    handles = [ServerHandle("prefill", i, u.rstrip("/"), api_key) for i, u in enumerate(prefill_urls)]
    handles += [ServerHandle("decode", j, u.rstrip("/"), api_key) for j, u in enumerate(decode_urls)]
    proxy = ServerHandle("proxy", 0, (proxy_url or "http://127.0.0.1:0").rstrip("/"), api_key)
    to_check = [*handles, *([proxy] if proxy_url is not None and not check_only else [])]
    # In parallel: an unreachable host costs one connect timeout, not one per URL.
    with ThreadPoolExecutor(max_workers=len(to_check)) as pool:
        futures = [(h, pool.submit(_check_attached, h, timeout)) for h in to_check]
    problems: list[str] = []
    served: dict[str, list[str]] = {}
    for h, fut in futures:
        exc = fut.exception()
        if exc is None:
            served[h.name] = fut.result()
            continue
        given = f" (given by {where[h.role]})" if h.role in where else ""
        problems.append(f"{h.name} at {h.url}{given}: {exc}")
    if problems:
        raise AttachError(
            f"attach mode: {len(problems)} of {len(to_check)} attached URLs did not answer:\n  "
            + "\n  ".join(problems)
            + "\nAre the servers up and reachable from this machine? (no server is started in attach mode)"
        )
    wanted = model if model is not None else served[handles[0].name][0]
    wrong = [f"{h.name} at {h.url} serves {served[h.name]}" for h in handles if wanted not in served[h.name]]
    if wrong:
        source = "--pd-model" if model is not None else f"what {handles[0].name} serves first"
        raise AttachError(f"attach mode: model {wanted!r} ({source}) is not served everywhere: " + "; ".join(wrong))
    discovered = _attached_block_size(handles, timeout)
    return PDCluster.of(
        ClusterSpec(name="attached"), handles, proxy, engine="attached", model=wanted,
        block_size=discovered or block_size, attention_backend_asked=attention_backend, attached=True,
    )  # fmt: skip


def _get(h: ServerHandle, path: str, timeout: float) -> httpx.Response:
    return get_within(None, f"{h.url}{path}", timeout, headers=h.headers)  # a trickling body must not hold us


def _check_health(h: ServerHandle, paths: Sequence[str], timeout: float) -> None:
    """``GET`` each of ``paths`` until one answers 200; else an `AttachError` saying what each did."""
    __tracebackhide__ = True
    errors = []
    for path in paths:
        try:
            r = _get(h, path, timeout)
        except httpx.HTTPError as exc:
            errors.append(f"GET {path}: {type(exc).__name__}: {exc or 'no answer'}")
            continue
        if r.status_code == 200:
            return
        hint = f" ({AUTH_HINT})" if r.status_code in (401, 403) else ""
        errors.append(f"GET {path} -> HTTP {r.status_code}{hint}")
    raise AttachError("; ".join(errors))


def _check_attached(h: ServerHandle, timeout: float) -> list[str]:
    """Health, then the model ids ``GET /v1/models`` lists (at least one); a proxy: health only."""
    __tracebackhide__ = True
    if h.role == "proxy":
        # /healthcheck: vLLM's toy_proxy_server.py; /health: ours and most others.
        _check_health(h, ("/health", "/healthcheck"), timeout)
        return []
    _check_health(h, ("/health",), timeout)
    try:
        r = _get(h, "/v1/models", timeout)
        r.raise_for_status()
        ids = [str(m["id"]) for m in r.json()["data"]]
    except httpx.HTTPStatusError as exc:
        raise AttachError(f"GET /v1/models -> HTTP {exc.response.status_code}") from None
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
        raise AttachError(f"GET /v1/models: {type(exc).__name__}: {exc} (expected an OpenAI model list)") from None
    if not ids:
        raise AttachError("GET /v1/models lists no model")
    return ids


def _attached_block_size(handles: Sequence[ServerHandle], timeout: float) -> int | None:
    """The block size an attached server reports in ``vllm:cache_config_info`` (None when none does).

    Best effort for a scrape that fails (an older server, a metrics-less path), never for an answer over the size
    bound: that is an `AttachError` naming the server, not a reason to read the next server's (or the same) stream.
    """
    for h in handles:
        try:
            snapshot = scrape(h.client, timeout=timeout, strict=False)
        except ResponseTooLarge as exc:
            raise AttachError(f"attach mode: {h.name} at {h.url}: {exc}") from None
        except MetricsScrapeError:
            continue
        for labels in snapshot.series("vllm:cache_config_info"):
            value = dict(labels).get("block_size", "")
            if is_int(value) and int(value) > 0:
                return int(value)
    return None


def attach_mismatch(spec: ClusterSpec, cluster: PDCluster) -> list[str]:
    """What ``spec`` asks for that the attached deployment does not have (empty: it can run there)."""
    out = []
    topology = (spec.num_prefill, spec.num_decode)
    # 1P x 1D is what `pd_cluster` asks for by default: in attach mode it means "the deployment", whatever its
    # shape; a spec asking for another topology runs only when the deployment has exactly that one.
    if topology != (1, 1) and topology != (len(cluster.prefill), len(cluster.decode)):
        out.append(f"{spec.num_prefill}P x {spec.num_decode}D")
    if spec.model is not None and spec.model != cluster.model:
        out.append(f"model {spec.model}")
    if spec.block_size is not None and spec.block_size != cluster.block_size:
        out.append(f"block size {spec.block_size}")
    backend = spec.attention_backend
    if backend is not None and backend.upper() != (cluster.attention_backend or "").upper():
        out.append(f"attention backend {backend}")
    default = ClusterSpec()
    changed = [name for name in _SERVER_SETTINGS if getattr(spec, name) != getattr(default, name)]
    if changed:
        out.append(f"server settings {', '.join(changed)}")
    return out
