"""Adopt a claimed kept cluster: prove it is the one kept, and that no test left it changed. [pytest-free]

Every server must be the kept process (pid and start time), listen where its state says (`state.KeptCluster
.foreign_listener`, before the first request carries the API key), answer ``/health`` and schedule requests;
what it runs is read back as at a fresh start (`verify.verify_cluster`) and must serve the models and weights it
served at its start; then its prefix caches are reset, so that a previous run's prompts do not warm this run's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

from pytest_pdserve.clients import http_transport
from pytest_pdserve.cluster import PDCluster, Reused, ServerHandle
from pytest_pdserve.common.deadline import get_within
from pytest_pdserve.config.commands import ServerCommand, ServerPorts
from pytest_pdserve.config.effective import Role
from pytest_pdserve.errors import PrefixCacheHeld, ReuseError
from pytest_pdserve.reuse.client import Claim
from pytest_pdserve.reuse.state import KeptServer
from pytest_pdserve.running import verify
from pytest_pdserve.running.launch import LaunchedCluster
from pytest_pdserve.running.verify import ObservedConfig
from pytest_pdserve.spec import ClusterSpec

__all__ = ["DEFAULT_KV_LEASE", "LORA_LOAD_ROUTE", "adopt"]

_ROLES: dict[str, Role] = {"prefill": "prefill", "decode": "decode"}


def _not_scheduling(h: ServerHandle) -> str | None:
    """Why a server schedules no request, in words, or None. vLLM 0.32's ``/is_sleeping`` is true while the
    scheduler is paused (``/pause``, ``/sleep`` at any level: ``EngineCore.is_sleeping``); ``/is_paused`` says so
    on its own where ``/is_sleeping`` counts only the executor. A server without either route: nothing says so."""
    for route, key in (("/is_sleeping", "is_sleeping"), ("/is_paused", "is_paused")):
        try:
            r = get_within(h.client, route, 5.0)
            if r.status_code == 200 and bool(r.json().get(key)):
                return f"{h.name} is asleep or paused (POST /sleep or /pause without /wake_up or /resume)"
        except (httpx.HTTPError, ValueError, AttributeError):  # an older server, a body that is not JSON object
            continue  # (not ResponseTooLarge: reading the next route's endless answer is no better)
    return None


#: vLLM's route for loading a LoRA adapter while serving (with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1).
LORA_LOAD_ROUTE = "POST /v1/load_lora_adapter"


def _changed_since_start(server: KeptServer, now: ObservedConfig | None) -> list[str]:
    """What ``server`` serves now that it did not at its start, in words (empty: nothing changed).

    Two things a test can change over HTTP that the prefix-cache reset does not undo: the models served (vLLM
    lists runtime-loaded LoRA adapters in ``/v1/models``, ``OpenAIServingModels.show_available_models``, and
    serves them by name) and the weights (``/weight_info``'s version, which an RL trainer's
    ``/update_weight_version`` or ``/finish_weight_update`` sets). A state kept by a version that did not record
    one, or a value not read back, is not compared.
    """
    if now is None:
        return []
    found = []
    if server.served_models is not None and list(server.served_models) != list(now.served_models):
        before, after = list(server.served_models), list(now.served_models)
        parts = []
        if added := [m for m in after if m not in before]:
            parts.append(f"now also serves {', '.join(added)} (a LoRA adapter loaded at run time: {LORA_LOAD_ROUTE})")
        if removed := [m for m in before if m not in after]:
            parts.append(f"no longer serves {', '.join(removed)}")
        found.append(f"{server.name} {'; '.join(parts) or f'lists {after} instead of {before}'}")
    was = server.weight_version
    if was is not None and now.weight_version is not None and now.weight_version != was:
        found.append(
            f"{server.name} runs weight version {now.weight_version!r}, not {was!r} as at its start (weights "
            "changed at run time: POST /update_weight_version or /finish_weight_update)"
        )
    return found


#: NixlConnector's ``kv_lease_duration`` when the config sets none (vLLM 0.32's ``nixl/base_scheduler.py``).
DEFAULT_KV_LEASE = 30.0
_HELD_MARGIN = 5.0  # past the lease: the server frees expired leases on its own ticks


def _kv_lease_seconds(argv: Sequence[str] | None) -> float:
    """The longest ``kv_lease_duration`` in a server's ``--kv-transfer-config`` (at the top, or in a
    MultiConnector's ``connectors``); :data:`DEFAULT_KV_LEASE` where none is set or the argv is unknown."""
    try:
        assert argv is not None
        config = json.loads(argv[list(argv).index("--kv-transfer-config") + 1])
    except (AssertionError, ValueError, IndexError):
        return DEFAULT_KV_LEASE
    leases: list[float] = []
    todo = [config]
    for _ in range(64):  # bounded: a config nests a few connectors at most
        if not todo:
            break
        node = todo.pop()
        extra = node.get("kv_connector_extra_config") if isinstance(node, Mapping) else None
        if isinstance(extra, Mapping):
            lease = extra.get("kv_lease_duration")
            if isinstance(lease, (int, float)) and not isinstance(lease, bool) and lease > 0:
                leases.append(float(lease))
            todo.extend(c for c in extra.get("connectors") or () if isinstance(c, Mapping))
    return max(leases, default=DEFAULT_KV_LEASE)


def _reset_prefix_cache(h: ServerHandle, argv: Sequence[str] | None, report: Callable[[str], None]) -> None:
    """Reset one kept server's prefix cache (with the connector's: `clients.reset_prefix_cache`), waiting while
    KV blocks are held: a run's last prefill whose KV no decode read keeps its blocks until NixlConnector's lease
    ends, and a reset fails until then. Bounded by that lease; :raises ReuseError: no reset."""
    wait = _kv_lease_seconds(argv) + _HELD_MARGIN
    deadline = time.monotonic() + wait
    for attempt in range(100_000):  # bounded by the deadline; the count only against a logic error
        try:
            reset = h.reset_prefix_cache()
        except PrefixCacheHeld as exc:
            if time.monotonic() >= deadline:
                raise ReuseError(f"resetting {h.name}'s prefix cache failed for {wait:g}s: {exc}") from None
            if attempt == 0:
                report(
                    f"pdserve: reuse: {h.name} still holds KV blocks (a request left them; NixlConnector's lease "
                    f"frees them): waiting up to {wait:g}s to reset its prefix cache"
                )
            time.sleep(0.2)  # the server frees them on its own clock: poll it, bounded above
            continue
        except AssertionError as exc:
            raise ReuseError(f"resetting {h.name}'s prefix cache failed: {exc}") from None
        if not reset:
            raise ReuseError(f"{h.name} has no POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1 was turned off)")
        return


def adopt(
    claim: Claim,
    spec: ClusterSpec,
    *,
    api_key: str | None,
    max_model_len: int | None,
    report: Callable[[str], None] = lambda msg: None,
) -> LaunchedCluster:
    """The claimed kept cluster as this run's `LaunchedCluster`, after proving it is the one that was kept.

    Every server must be the kept process (pid and start time), answer ``/health`` and schedule requests (not
    asleep, not paused: `_not_scheduling`); what the servers run is read back as at a fresh start
    (`verify.verify_cluster`), and the models served and the weight version must be what they were at the start
    (`_changed_since_start`); then the prefill and decode prefix caches are reset (a previous run's prompts must not
    warm this run's; `_reset_prefix_cache` waits for KV blocks a prefill-only request left held).
    :raises ReuseError: what failed; every change a test left is named (the caller stops the cluster).
    """
    t0 = time.monotonic()
    kept = claim.kept
    state = kept.state
    dead = kept.dead_server()
    if dead is not None:
        raise ReuseError(dead)
    foreign = kept.foreign_listener()  # before the first request: each carries the API key
    if foreign is not None:
        raise ReuseError(foreign)

    def handle(s: KeptServer) -> ServerHandle:
        command = None
        if s.argv is not None:
            if s.role not in _ROLES:
                raise ReuseError(f"{s.name}: role {s.role!r} in the state file {kept.path} is not a server's")
            env: dict[str, str | None] = dict(s.env or {})
            env["VLLM_API_KEY"] = api_key  # kept out of the state file; the fingerprint says it is the same key
            command = ServerCommand(_ROLES[s.role], s.index, s.argv, env)
        ports = ServerPorts(*s.ports) if s.ports else None
        log_path = Path(s.log_path) if s.log_path is not None else None
        return ServerHandle(s.role, s.index, s.url, api_key, log_path, None, command, ports, s.gpus, s.ready_seconds)

    servers = [handle(s) for s in state.servers]
    proxy = handle(state.proxy)
    if proxy.ports is None:
        proxy.ports = ServerPorts(proxy.port, 0, 0)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(headers=headers, timeout=2.0, trust_env=False, transport=http_transport()) as client:
        for h in (*servers, proxy):
            try:
                status = get_within(client, f"{h.url}/health", 2.0).status_code
            except httpx.HTTPError as exc:
                raise ReuseError(f"{h.name} at {h.url} does not answer /health: {type(exc).__name__}") from None
            if status != 200:
                raise ReuseError(f"{h.name} at {h.url} answers /health with HTTP {status}")
    cluster = PDCluster.of(
        spec, servers, proxy, engine=state.engine, model=state.model, block_size=state.block_size,
        attention_backend_asked=state.attention_backend, platform=state.platform, vllm_version=state.vllm_version,
        reused=Reused(kept.id, time.time() - kept.created, state.started_seconds),
    )  # fmt: skip
    # Everything a test left changed is named at once (a person fixes all of it in one go), then refused; the
    # resets come last, as they may wait for held KV blocks.
    problems = [p for h in (*cluster.prefill, *cluster.decode) if (p := _not_scheduling(h)) is not None]
    observed = verify.verify_cluster(cluster, max_model_len=max_model_len)
    for s in state.servers:
        problems += _changed_since_start(s, observed.get(s.name))
    if problems:
        raise ReuseError("; ".join(problems))
    argv_of = {s.name: s.argv for s in state.servers}
    for h in (*cluster.prefill, *cluster.decode):
        _reset_prefix_cache(h, argv_of.get(h.name), report)
    cluster.started_seconds = time.monotonic() - t0
    return LaunchedCluster(cluster, [], None, [], state.label)
