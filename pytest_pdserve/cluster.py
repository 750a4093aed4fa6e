"""Running P/D clusters: the objects tests get, and the manager that starts, shares and stops them.

`ClusterManager` is pytest-free: the fixtures give it the resolved settings, the inventory, a log
directory and a reporter callback. Lifecycle of one cluster (each step undone if a later one fails):

1. lease GPUs (positions in the caller's visible list; TP-aware) and every port each server binds;
2. build argv/env per server (`commands.py`) and spawn P and D together, each in its own session;
   when P and D would share a GPU they are staggered instead, since two vLLMs profiling one GPU at
   once mis-size their KV caches;
3. register every process group, and the lease fds, with the session's watchdog, so a SIGKILLed
   pytest still takes its servers (and only its servers) down and leases stay held until they are gone;
4. wait for all servers at once (fail fast on the first exit, with its log tail and a hint);
5. start the proxy and wait for it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pytest_pdserve import commands, leases, vllm_compat
from pytest_pdserve.commands import EngineInfo, Role, ServerCommand, ServerPorts, SessionDefaults
from pytest_pdserve.errors import AttachError, ClusterSpecError, PDServeError
from pytest_pdserve.inventory import Inventory, gpu_processes
from pytest_pdserve.metrics import MetricsSnapshot, scrape
from pytest_pdserve.process import ServerProcess, StopReport, new_run_token, wait_all_ready
from pytest_pdserve.spec import DEFAULT_BLOCK_SIZE, ClusterSpec
from pytest_pdserve.watchdog import Watchdog

log = logging.getLogger(__name__)

Reporter = Callable[[str], None]

SIM_DEFAULT_MODELS = {"llama": "pdserve-sim/tiny-llama", "nemotronh": "pdserve-sim/tiny-nemotronh"}
#: The simulator speaks vLLM 0.33's flags.
SIM_VERSION = vllm_compat.LATEST_KNOWN
#: How long the release gate waits for nvidia-smi to stop listing our pids on a GPU.
GPU_RELEASE_TIMEOUT = 60.0
HTTP_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
#: Undocumented knob (tests, firewalled CI hosts): lease every port from ``LOW-HIGH`` instead of the default
#: range (20000 up to just below the kernel's ephemeral range).
PORT_RANGE_ENV = "PDSERVE_PORT_RANGE"


def port_range_from_env(environ: Mapping[str, str] | None = None) -> tuple[int, int | None]:
    """``(low, high)`` for the port lease calls from ``$PDSERVE_PORT_RANGE``; ``(20000, None)`` (leases'
    default: up to the ephemeral range) when unset.

    :raises PDServeError: the value is not ``LOW-HIGH`` with ``1 <= LOW <= HIGH <= 65535``.
    """
    raw = (os.environ if environ is None else environ).get(PORT_RANGE_ENV, "").strip()
    if not raw:
        return 20000, None
    low, sep, high = raw.partition("-")
    try:
        lo, hi = int(low), int(high)
    except ValueError:
        lo = hi = 0
    if not sep or not 1 <= lo <= hi <= 65535:
        raise PDServeError(
            f"${PORT_RANGE_ENV}={raw!r} is not a port range: expected LOW-HIGH with 1 <= LOW <= HIGH <= 65535, "
            "e.g. 20000-20999"
        )
    return lo, hi


@dataclass(frozen=True)
class EngineSetup:
    """Everything engine-specific the manager needs: how to run it, its platform env, its default model."""

    info: EngineInfo
    platform_env: Mapping[str, str] = field(default_factory=dict)
    #: Default model for a spec without one (the tiny model for real vLLM); None = simulator names.
    model_resolver: Callable[[ClusterSpec], str] | None = None


class ClusterUnavailable(PDServeError):
    """The machine cannot host this cluster (too few GPUs, or none free and gpu_wait=skip): a skip, not a failure."""


@dataclass
class ServerHandle:
    """One server of a cluster (prefill, decode or proxy), running or attached.

    :ivar url: ``http://127.0.0.1:PORT`` (no trailing slash).
    :ivar gpus: the device tokens this server sees (``CUDA_VISIBLE_DEVICES`` value), empty on CPU.
    """

    role: str
    index: int
    url: str
    api_key: str | None = None
    log_path: Path | None = None
    process: ServerProcess | None = None
    command: ServerCommand | None = None
    ports: ServerPorts | None = None
    gpus: tuple[str, ...] = ()
    ready_seconds: float | None = None
    _client: httpx.Client | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        """``prefill-0``, ``decode-1``, ``proxy``."""
        return "proxy" if self.role == "proxy" else f"{self.role}-{self.index}"

    @property
    def port(self) -> int:
        """The HTTP port."""
        url = httpx.URL(self.url)
        return url.port or (443 if url.scheme == "https" else 80)

    @property
    def side_channel_port(self) -> int | None:
        """The NIXL side-channel port (``VLLM_NIXL_SIDE_CHANNEL_PORT``), None for the proxy or attached servers."""
        return self.ports.side_channel if self.ports is not None and self.role != "proxy" else None

    @property
    def headers(self) -> dict[str, str]:
        """Headers every request needs (the API key, when the servers require one)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def client(self) -> httpx.Client:
        """A reusable httpx client with ``base_url`` set and the API key sent."""
        if self._client is None or self._client.is_closed:
            # trust_env=False: a corporate HTTP(S)_PROXY must never see our loopback traffic.
            self._client = httpx.Client(base_url=self.url, headers=self.headers, timeout=HTTP_TIMEOUT, trust_env=False)
        return self._client

    def async_client(self, **kwargs: Any) -> httpx.AsyncClient:
        """A new `httpx.AsyncClient` for this server; the caller closes it."""
        return httpx.AsyncClient(
            base_url=self.url, headers=self.headers, timeout=HTTP_TIMEOUT, trust_env=False, **kwargs
        )

    def metrics(self) -> MetricsSnapshot:
        """Scrape ``/metrics`` now."""
        return scrape(self.client)

    def log_offset(self) -> int:
        """Current size of the log file (0 for attached servers)."""
        try:
            return self.log_path.stat().st_size if self.log_path is not None else 0
        except OSError:
            return 0

    def read_log(self, since: int = 0, max_bytes: int = 256 * 1024) -> str:
        """Log text written after byte offset ``since`` (the last ``max_bytes`` of it)."""
        if self.log_path is None:
            return ""
        try:
            with self.log_path.open("rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                start = max(since, size - max_bytes)
                fh.seek(start)
                data = fh.read()
        except OSError:
            return ""
        text = data.decode("utf-8", "replace")
        return text if start == since else "[...]\n" + text.split("\n", 1)[-1]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


@dataclass
class PDCluster:
    """A running (or attached) P/D cluster: what ``pd_cluster`` gives a test.

    ``cluster.client`` talks to the proxy; ``cluster.prefill[i]`` / ``cluster.decode[j]`` to each server.
    """

    spec: ClusterSpec
    engine: str
    model: str
    block_size: int
    attention_backend: str | None
    prefill: tuple[ServerHandle, ...]
    decode: tuple[ServerHandle, ...]
    proxy: ServerHandle
    attached: bool = False
    #: "cuda", "rocm" or "cpu": where the servers run (examples skip what a platform cannot do).
    platform: str = "cpu"
    vllm_version: str | None = None
    started_seconds: float = 0.0
    _stopped: bool = field(default=False, repr=False)

    @property
    def url(self) -> str:
        """The proxy's base URL; OpenAI routes live under ``/v1``."""
        return self.proxy.url

    @property
    def base_url(self) -> str:
        """``<proxy>/v1``, for OpenAI-style clients."""
        return f"{self.proxy.url}/v1"

    @property
    def client(self) -> httpx.Client:
        """httpx client for the proxy."""
        return self.proxy.client

    @property
    def servers(self) -> tuple[ServerHandle, ...]:
        """Prefill servers, decode servers, then the proxy."""
        return (*self.prefill, *self.decode, self.proxy)

    @property
    def log_paths(self) -> dict[str, Path]:
        """``{name: log file}`` for every server that has one."""
        return {s.name: s.log_path for s in self.servers if s.log_path is not None}

    def metrics(self) -> dict[str, MetricsSnapshot]:
        """Scrape every prefill and decode server: ``{name: snapshot}``."""
        return {s.name: s.metrics() for s in (*self.prefill, *self.decode)}

    def complete(self, prompt: str | list[int], **body: Any) -> dict[str, Any]:
        """POST ``/v1/completions`` through the proxy (temperature 0 unless given) and return the JSON."""
        payload: dict[str, Any] = {"model": self.model, "prompt": prompt, "temperature": 0.0, **body}
        response = self.client.post("/v1/completions", json=payload)
        if response.status_code != 200:
            raise AssertionError(
                f"POST {self.proxy.url}/v1/completions -> {response.status_code}: {response.text[:2000]}"
            )
        result: dict[str, Any] = response.json()
        return result

    def describe(self) -> str:
        """The one-line summary printed when the cluster is ready."""
        parts = []
        for s in (*self.prefill, *self.decode):
            gpu = f" gpu={','.join(s.gpus)}" if s.gpus else ""
            side = f" nixl={s.side_channel_port}" if s.side_channel_port else ""
            parts.append(f"{s.name}={_where(s)}{gpu}{side}")
        parts.append(f"proxy={_where(self.proxy)}")
        backend = self.attention_backend or "auto"
        how = "attached" if self.attached else f"ready in {self.started_seconds:.1f}s"
        return (
            f"pdserve: cluster {self.spec.name} ({self.engine}, {len(self.prefill)}P x {len(self.decode)}D) {how}: "
            f"{' '.join(parts)} backend={backend} model={self.model}"
        )


def _where(server: ServerHandle) -> str:
    """``:PORT`` for our own loopback servers, ``host:port`` for attached remote ones."""
    host = httpx.URL(server.url).host
    return f":{server.port}" if host == "127.0.0.1" else f"{host}:{server.port}"


@dataclass
class _Running:
    """What the manager must undo for one cluster."""

    cluster: PDCluster
    processes: list[ServerProcess]
    gpu_lease: leases.GpuLease | None
    port_leases: list[leases.PortLease]
    label: str
    last_used: float = field(default_factory=time.monotonic)


class ClusterManager:
    """Starts clusters on demand, shares equal specs, and stops everything at the end of the session."""

    def __init__(
        self,
        *,
        engine_setup: Callable[[str], EngineSetup],
        default_engine: str,
        defaults: SessionDefaults,
        inventory: Inventory,
        log_dir: Path,
        lease_dir: Path,
        model: str | None = None,
        startup_timeout: float = 1200.0,
        shutdown_timeout: float = 30.0,
        gpu_wait: str = "wait",
        gpu_wait_timeout: float = 1800.0,
        prefill_gpu_ids: tuple[int, ...] | None = None,
        decode_gpu_ids: tuple[int, ...] | None = None,
        proxy_command: tuple[str, ...] | None = None,
        reporter: Reporter | None = None,
    ) -> None:
        self._engine_setup = engine_setup
        self._engines: dict[str, EngineSetup] = {}
        self.default_engine = default_engine
        self.defaults = defaults
        self.inventory = inventory
        self.log_dir = log_dir
        self.lease_dir = lease_dir
        self.model = model
        self.startup_timeout = startup_timeout
        self.shutdown_timeout = shutdown_timeout
        self.gpu_wait = gpu_wait
        self.gpu_wait_timeout = gpu_wait_timeout
        self.prefill_gpu_ids = prefill_gpu_ids
        self.decode_gpu_ids = decode_gpu_ids
        self.proxy_command = proxy_command
        self.report = reporter or (lambda msg: log.info("%s", msg))
        self.run_token = new_run_token()
        self.port_range = port_range_from_env()
        self._watchdog: Watchdog | None = None
        self._running: dict[ClusterSpec, _Running] = {}
        self._failed: dict[ClusterSpec, BaseException] = {}
        self._lock = threading.RLock()
        self._counter = 0

    # ------------------------------------------------------------------ public

    def get(self, spec: ClusterSpec) -> PDCluster:
        """The running cluster for ``spec``, starting it if needed.

        A spec that failed to start fails again at once (same error) instead of restarting for every test.
        """
        with self._lock:
            if spec in self._running:
                running = self._running[spec]
                running.last_used = time.monotonic()
                return running.cluster
            if spec in self._failed:
                # Same error, fresh traceback: re-raising the object would grow its traceback test after test.
                raise self._failed[spec].with_traceback(None)
            try:
                running = self._start(spec)
            except ClusterUnavailable:
                raise
            except BaseException as exc:
                # BaseException: pytest-timeout's signal method raises a non-Exception; clean up for it too.
                if isinstance(exc, (Exception,)):
                    self._failed[spec] = exc
                raise
            self._running[spec] = running
            return running.cluster

    def attached(self, spec: ClusterSpec, cfg: Any) -> PDCluster:
        """Attach mode: the servers at ``cfg.prefill_urls`` / ``cfg.decode_urls`` (started by someone else).

        Starts no server and leases no GPU and no server port; the given proxy (``cfg.proxy_url``) is
        used, or the built-in one is started in front of the servers (it leases only its own port).
        Every spec shares the one attached deployment; a spec asking for something the deployment does
        not have (another topology, model or block size, or server settings attach mode cannot apply)
        is skipped (`ClusterUnavailable`), not faked.
        """
        __tracebackhide__ = True  # the AttachError message says it all; pytest shows no frames of ours
        key = ClusterSpec(name="attached")
        with self._lock:
            failed = self._failed.get(key)
            if failed is not None:
                # Every later test fails at once with the same message; a cleared traceback keeps the
                # shared exception object from growing one more chain of frames per test.
                raise failed.with_traceback(None)
            if key not in self._running:
                try:
                    self._running[key] = self._attach(cfg)
                except Exception as exc:
                    self._failed[key] = exc
                    raise
            cluster = self._running[key].cluster
            self._running[key].last_used = time.monotonic()
        mismatch = _attach_mismatch(spec, cluster)
        if mismatch:
            raise ClusterUnavailable(
                f"cluster {spec.name} needs {'; '.join(mismatch)}: attach mode runs every test against the attached "
                f"deployment ({len(cluster.prefill)}P x {len(cluster.decode)}D, model {cluster.model}, block size "
                f"{cluster.block_size}) and cannot start servers with other settings"
            )
        return cluster

    def _attach(self, cfg: Any) -> _Running:
        """Check every attached URL, then use the given proxy or start the built-in one in front of the servers."""
        __tracebackhide__ = True
        t0 = time.monotonic()
        origin = {role: cfg.source_of(f"{role}_urls" if role != "proxy" else "proxy_url") for role in _ROLES}
        cluster = attach(
            prefill_urls=cfg.prefill_urls, decode_urls=cfg.decode_urls, proxy_url=cfg.proxy_url, model=cfg.model,
            api_key=self.defaults.api_key, attention_backend=self.defaults.attention_backend,
            block_size=self.defaults.block_size, check_only=cfg.proxy_url is None, origin=origin,
        )  # fmt: skip
        processes: list[ServerProcess] = []
        port_leases: list[leases.PortLease] = []
        if cfg.proxy_url is None:
            # The servers answered: only now start a proxy in front of them (it leases its own port only).
            try:
                cluster.proxy = self._start_proxy(
                    "attached", [*cluster.prefill, *cluster.decode], self._watch(), processes, port_leases, t0
                )
            except BaseException:
                self._cleanup("attached", processes, None, port_leases)
                raise
        cluster.started_seconds = time.monotonic() - t0
        self.report(cluster.describe())
        return _Running(cluster, processes, None, port_leases, "attached")

    def running(self) -> list[PDCluster]:
        """Clusters that are up now."""
        return [r.cluster for r in self._running.values()]

    def stop(self, spec: ClusterSpec) -> None:
        """Stop one cluster (no-op if it is not running)."""
        with self._lock:
            running = self._running.pop(spec, None)
        if running is not None:
            self._teardown(running)

    def stop_all(self) -> None:
        """Stop every cluster, then the watchdog. Safe to call twice."""
        with self._lock:
            items = list(self._running.values())
            self._running.clear()
        for running in items:
            self._teardown(running)
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None

    # ------------------------------------------------------------------ start

    def engine_for(self, spec: ClusterSpec) -> EngineSetup:
        """The engine this spec runs on (its own ``engine`` field, else the session's ``--pd-engine``)."""
        name = spec.engine or self.default_engine
        if name not in self._engines:
            self._engines[name] = self._engine_setup(name)
        return self._engines[name]

    def _resolve_model(self, spec: ClusterSpec, setup: EngineSetup) -> str:
        if spec.model is not None:
            return spec.model
        if self.model is not None:
            return self.model
        if setup.model_resolver is not None:
            return setup.model_resolver(spec)
        return SIM_DEFAULT_MODELS[spec.model_kind]

    def _watch(self) -> Watchdog:
        if self._watchdog is None or not self._watchdog.alive:
            # wait=False: the hello is checked at the first command, after the servers are spawned.
            self._watchdog = Watchdog.start(
                self.run_token,
                grace=min(self.shutdown_timeout, 10.0),
                log_path=self.log_dir / "watchdog.log",
                wait=False,
            )
        return self._watchdog

    def _gpu_plan(self, spec: ClusterSpec, label: str) -> tuple[leases.GpuLease | None, list[list[int]]]:
        """Positions (in the inventory) for each server, in order P0..Pn, D0..Dm; and the lease held."""
        tps = [spec.prefill_tp] * spec.num_prefill + [spec.decode_tp] * spec.num_decode
        if not self.inventory.gpus:
            return None, [[] for _ in tps]
        explicit = self.prefill_gpu_ids is not None or self.decode_gpu_ids is not None
        if explicit:
            return self._explicit_plan(spec, tps, label)
        need = sum(tps)
        if need > self.inventory.count:
            raise ClusterUnavailable(
                f"cluster {spec.name} needs {need} GPUs ({spec.num_prefill}P x TP{spec.prefill_tp} + "
                f"{spec.num_decode}D x TP{spec.decode_tp}), {self.inventory.count} visible: {self.inventory.describe()}"
            )
        self._make_room(need)
        keys = [g.uuid or str(g.index) for g in self.inventory.gpus]
        if self.gpu_wait == "skip":
            lease = leases.try_acquire_gpus(self.lease_dir, keys, need, contiguous=False, purpose=label)
            if lease is None:
                raise ClusterUnavailable(
                    f"no {need} free GPUs for cluster {spec.name} (leased by other tests; --pd-gpu-wait=skip)"
                )
        else:
            lease = leases.acquire_gpus(
                self.lease_dir, keys, need, contiguous=False, timeout=self.gpu_wait_timeout,
                on_wait=self.report, purpose=label,
            )  # fmt: skip
        positions = sorted(lease.positions)
        plan, at = [], 0
        for tp in tps:
            plan.append(positions[at : at + tp])
            at += tp
        return lease, plan

    def _explicit_plan(
        self, spec: ClusterSpec, tps: list[int], label: str
    ) -> tuple[leases.GpuLease | None, list[list[int]]]:
        if spec.num_prefill != 1 or spec.num_decode != 1:
            raise ClusterSpecError(
                "PREFILL_GPU_ID / DECODE_GPU_ID (--pd-prefill-gpu-ids / --pd-decode-gpu-ids) only apply to a "
                f"1P x 1D cluster; cluster {spec.name} is {spec.num_prefill}P x {spec.num_decode}D"
            )
        p_ids = list(self.prefill_gpu_ids or [])
        d_ids = list(self.decode_gpu_ids or [])
        for what, ids, tp in (("prefill", p_ids, tps[0]), ("decode", d_ids, tps[1])):
            if ids and len(ids) != tp:
                raise ClusterSpecError(f"{what} GPU ids {ids} do not match its tensor-parallel size {tp}")
            for i in ids:
                if i >= self.inventory.count:
                    raise ClusterUnavailable(
                        f"{what} GPU id {i} is not visible: {self.inventory.count} GPUs ({self.inventory.describe()})"
                    )
        wanted = sorted(set(p_ids) | set(d_ids))
        lease = None
        if wanted:
            keys = [self.inventory.gpus[i].uuid or str(self.inventory.gpus[i].index) for i in wanted]
            lease = leases.acquire_gpus(
                self.lease_dir, keys, len(keys), contiguous=False, timeout=self.gpu_wait_timeout,
                on_wait=self.report, purpose=label,
            )  # fmt: skip
        return lease, [p_ids, d_ids]

    def _make_room(self, need: int) -> None:
        """Stop our own least recently used clusters whose GPUs a new spec needs (the factory's contract)."""
        while self._running:
            held = sum(len(r.gpu_lease.positions) for r in self._running.values() if r.gpu_lease)
            if self.inventory.count - held >= need:
                return
            victim = min(self._running.values(), key=lambda r: r.last_used)
            self.report(f"pdserve: stopping cluster {victim.cluster.spec.name} to free its GPUs for another spec")
            self.stop(victim.cluster.spec)

    def _lease_ports(self, label: str, width: int) -> tuple[ServerPorts, list[leases.PortLease]]:
        low, high = self.port_range
        held: list[leases.PortLease] = []
        try:
            held.append(leases.acquire_ports(self.lease_dir, 1, low=low, high=high, purpose=f"{label} http"))
            for width_, what in ((width, "nixl side channel"), (commands.VLLM_PORT_WINDOW, "VLLM_PORT")):
                held.append(
                    leases.acquire_port_span(self.lease_dir, width_, low=low, high=high, purpose=f"{label} {what}")
                )
        except BaseException:
            # The caller only learns about leases we return: free the ones taken before the failure.
            for lease in held:
                lease.release()
            raise
        http, side, window = held
        return ServerPorts(http=http.base, side_channel=side.base, vllm_port=window.base), held

    def _child_env(self, delta: Mapping[str, str | None]) -> dict[str, str]:
        env = dict(os.environ)
        for key, value in delta.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        # Our plugin env must not leak into the servers: a pytest run inside the server would be wrong.
        env.pop("PYTEST_CURRENT_TEST", None)
        return env

    def _start(self, spec: ClusterSpec) -> _Running:
        self._counter += 1
        label = f"{spec.name}-{self._counter}"
        t0 = time.monotonic()
        setup = self.engine_for(spec)
        model = self._resolve_model(spec, setup)
        processes: list[ServerProcess] = []
        port_leases: list[leases.PortLease] = []
        gpu_lease: leases.GpuLease | None = None
        watchdog = self._watch()
        try:
            gpu_lease, plan = self._gpu_plan(spec, label)
            # Lease fds go to the watchdog once the servers are spawned: its hello (~50 ms) then overlaps
            # their start-up instead of delaying it.
            holds: list[tuple[str, tuple[int, ...]]] = []
            if gpu_lease is not None:
                holds.append((f"{label}-gpus", gpu_lease.fds))
            roles: list[tuple[Role, int]] = [("prefill", i) for i in range(spec.num_prefill)]
            roles += [("decode", j) for j in range(spec.num_decode)]
            handles: list[ServerHandle] = []
            for (role, index), positions in zip(roles, plan, strict=True):
                ports, held = self._lease_ports(f"{label} {role}-{index}", 1)
                port_leases += held
                gpu_env = self.inventory.child_env(positions) if positions else {}
                cmd = commands.build_server_command(
                    spec=spec, role=role, index=index, model=model, ports=ports, engine=setup.info,
                    defaults=self.defaults, gpu_env=gpu_env, platform_env=setup.platform_env,
                )  # fmt: skip
                log_path = self.log_dir / f"{label}-{cmd.name}.log"
                self._write_header(log_path, cmd)
                url = f"http://127.0.0.1:{ports.http}"
                proc = ServerProcess(
                    cmd.name, cmd.argv, self._child_env(cmd.env), log_path,
                    health_url=f"{url}/health", models_url=f"{url}/v1/models",
                    model_id=served_model_name(cmd.argv, model),
                    api_key=self.defaults.api_key, run_token=self.run_token,
                )  # fmt: skip
                tokens = tuple(self.inventory.gpus[p].token for p in positions)
                handles.append(
                    ServerHandle(role, index, url, self.defaults.api_key, log_path, proc, cmd, ports, tokens)
                )
                processes.append(proc)
            # The proxy starts together with the servers (it needs only their URLs), so its own start-up
            # (~0.5 s of imports) hides behind theirs instead of adding to the cluster's ready time.
            proxy = self._prepare_proxy(label, handles, watchdog, processes, port_leases, hold=False)
            holds += [(f"{label}-ports-{lease.base}", lease.fds) for lease in port_leases]

            def hold_leases() -> None:
                for name, fds in holds:
                    watchdog.hold(name, fds)

            self._start_servers(spec, [*handles, proxy], plan, t0, watchdog, hold_leases)
            n_p = spec.num_prefill
            backend = spec.attention_backend if spec.attention_backend is not None else self.defaults.attention_backend
            cluster = PDCluster(
                spec=spec, engine=setup.info.name, model=served_model_name(cmd.argv, model),
                block_size=spec.block_size or self.defaults.block_size or DEFAULT_BLOCK_SIZE,
                attention_backend=backend, prefill=tuple(handles[:n_p]), decode=tuple(handles[n_p:]),
                proxy=proxy, platform=self.inventory.platform, vllm_version=str(setup.info.version),
                started_seconds=time.monotonic() - t0,
            )  # fmt: skip
            self.report(cluster.describe())
            return _Running(cluster, processes, gpu_lease, port_leases, label)
        except BaseException:
            self._cleanup(label, processes, gpu_lease, port_leases)
            raise

    def _write_header(self, log_path: Path, cmd: ServerCommand) -> None:
        # The command line and env delta head each log, so a CI artifact says what ran.
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("a", encoding="utf-8") as fh:
            fh.write(f"# pdserve: {cmd.name}: {json.dumps(commands.redact(cmd.argv))}\n")
            fh.write(f"# pdserve: env: {json.dumps(dict(cmd.env), sort_keys=True)}\n")

    def _start_servers(
        self,
        spec: ClusterSpec,
        handles: list[ServerHandle],
        plan: list[list[int]],
        t0: float,
        watchdog: Watchdog,
        after_spawn: Callable[[], None] = lambda: None,
    ) -> None:
        deadline = t0 + self.startup_timeout
        shared = _shares_gpu(plan)
        progress = _Progress(self.report)
        if shared:
            # Staggered: each server is ready before the next starts, so KV-cache profiling sees a quiet GPU.
            # (The proxy, last in `handles`, uses no GPU: it starts with the first server.)
            self.report(f"pdserve: {spec.name}: servers share a GPU; starting them one after another")
            proxy = handles[-1] if handles[-1].role == "proxy" else None
            servers = handles[:-1] if proxy is not None else handles
            for i, h in enumerate(servers):
                batch = [h, proxy] if (i == 0 and proxy is not None) else [h]
                for b in batch:
                    assert b.process is not None
                    b.process.start()
                    watchdog.watch(b.process.pid or 0, b.process.pgid or 0)
                if i == 0:
                    after_spawn()
                ready = wait_all_ready([b.process for b in batch if b.process is not None], deadline, progress)
                for b in batch:
                    b.ready_seconds = ready[b.name]
            return
        for h in handles:  # spawn all first: every server's start-up begins at once
            assert h.process is not None
            h.process.start()
        for h in handles:
            assert h.process is not None
            watchdog.watch(h.process.pid or 0, h.process.pgid or 0)
        after_spawn()
        ready = wait_all_ready([h.process for h in handles if h.process is not None], deadline, progress)
        for h in handles:
            h.ready_seconds = ready.get(h.name)

    def _prepare_proxy(
        self,
        label: str,
        handles: list[ServerHandle],
        watchdog: Watchdog,
        processes: list[ServerProcess],
        port_leases: list[leases.PortLease],
        hold: bool = True,
    ) -> ServerHandle:
        """Lease the proxy's port and build its process (not started): its argv needs only the servers' URLs."""
        low, high = self.port_range
        lease = leases.acquire_ports(self.lease_dir, 1, low=low, high=high, purpose=f"{label} proxy")
        port_leases.append(lease)
        if hold:
            watchdog.hold(f"{label}-ports-{lease.base}", lease.fds)
        port = lease.base
        prefill = [h for h in handles if h.role == "prefill"]
        decode = [h for h in handles if h.role == "decode"]
        argv, health = proxy_argv(self.proxy_command, port, prefill, decode, self.defaults.api_key)
        url = f"http://127.0.0.1:{port}"
        log_path = self.log_dir / f"{label}-proxy.log"
        proc = ServerProcess(
            "proxy", argv, self._child_env({}), log_path, health_url=f"{url}{health}",
            api_key=self.defaults.api_key, run_token=self.run_token,
        )  # fmt: skip
        processes.append(proc)
        return ServerHandle("proxy", 0, url, self.defaults.api_key, log_path, proc, None, ServerPorts(port, 0, 0))

    def _start_proxy(
        self,
        label: str,
        handles: list[ServerHandle],
        watchdog: Watchdog,
        processes: list[ServerProcess],
        port_leases: list[leases.PortLease],
        t0: float,
    ) -> ServerHandle:
        """Start the proxy alone and wait for it (attach mode, where the servers are already up)."""
        proxy = self._prepare_proxy(label, handles, watchdog, processes, port_leases)
        assert proxy.process is not None
        proxy.process.start()
        watchdog.watch(proxy.process.pid or 0, proxy.process.pgid or 0)
        proxy.ready_seconds = wait_all_ready([proxy.process], t0 + self.startup_timeout, _Progress(self.report))[
            "proxy"
        ]
        return proxy

    # ------------------------------------------------------------------ stop

    def _teardown(self, running: _Running) -> None:
        for s in running.cluster.servers:
            s.close()
        self._cleanup(running.label, running.processes, running.gpu_lease, running.port_leases)

    def _cleanup(
        self,
        label: str,
        processes: list[ServerProcess],
        gpu_lease: leases.GpuLease | None,
        port_leases: list[leases.PortLease],
    ) -> None:
        """Stop processes in parallel, then hand GPUs back behind the release gate, then ports. Best effort."""
        our_pids = _tree_pids(self.run_token, processes)
        reports: list[StopReport] = []
        started = [p for p in processes if p.pid is not None]
        if started:
            with ThreadPoolExecutor(max_workers=len(started)) as pool:
                for report in pool.map(lambda p: _safe_stop(p, self.shutdown_timeout), started):
                    if report is not None:
                        reports.append(report)
        for p in started:
            if self._watchdog is not None and p.pgid is not None:
                try:
                    self._watchdog.unwatch(p.pgid)
                except Exception:
                    log.exception("watchdog unwatch failed")
        if gpu_lease is not None:
            gate = _release_gate(self.inventory, gpu_lease, our_pids)
            waited = gpu_lease.release(wait_until=gate, timeout=GPU_RELEASE_TIMEOUT)
            if gate is not None:
                self.report(f"pdserve: {label}: GPUs {list(gpu_lease.keys)} released after a {waited:.2f}s gate")
        for lease in port_leases:
            lease.release()
        if self._watchdog is not None:
            for name in [f"{label}-gpus", *(f"{label}-ports-{lease.base}" for lease in port_leases)]:
                try:
                    self._watchdog.drop(name)
                except Exception:
                    log.debug("watchdog drop %s failed", name, exc_info=True)


def _safe_stop(proc: ServerProcess, grace: float) -> StopReport | None:
    try:
        return proc.stop(grace)
    except Exception:
        log.exception("stopping %s failed", proc.name)
        return None


def _tree_pids(run_token: str, processes: Sequence[ServerProcess]) -> set[int]:
    """Every pid we started (servers and their descendants), read before stopping them."""
    from pytest_pdserve.watchdog import RUN_TOKEN_ENV, pids_with_env

    pids = {p.pid for p in processes if p.pid is not None}
    with contextlib.suppress(OSError):
        pids.update(pids_with_env(RUN_TOKEN_ENV, run_token))
    return pids


def _release_gate(inventory: Inventory, lease: leases.GpuLease, our_pids: set[int]) -> Callable[[], bool] | None:
    """On real CUDA: hand a GPU back only when nvidia-smi lists none of our pids on it."""
    if inventory.platform != "cuda" or inventory.simulated:
        return None
    uuids = set(lease.keys)

    def gate() -> bool:
        apps = gpu_processes()
        if apps is None:  # nvidia-smi failed: nothing to wait on
            return True
        return not any(a.uuid in uuids and a.pid in our_pids for a in apps)

    return gate


def served_model_name(argv: Sequence[str], model: str) -> str:
    """The model id clients must send: the first value of the last ``--served-model-name`` in argv, else ``model``.

    The extra args may rename the model (``VLLM_SERVE_EXTRA_ARGS=--served-model-name,x``); readiness and
    ``PDCluster.complete`` must then use the new name, or the start waits for a model that is never listed.
    """
    name = model
    for i, arg in enumerate(argv):
        if arg == "--served-model-name" and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            name = argv[i + 1]
        elif arg.startswith("--served-model-name="):
            name = arg.split("=", 1)[1]
    return name


def _shares_gpu(plan: list[list[int]]) -> bool:
    seen: set[int] = set()
    for positions in plan:
        if seen & set(positions):
            return True
        seen |= set(positions)
    return False


def proxy_argv(
    template: tuple[str, ...] | None,
    port: int,
    prefill: Sequence[ServerHandle],
    decode: Sequence[ServerHandle],
    api_key: str | None,
) -> tuple[list[str], str]:
    """argv of the proxy and the path its readiness is checked on.

    A user command (``--pd-proxy-command``) is an argv template: ``{port}`` and ``{python}`` are
    substituted inside elements, and an element that is exactly ``{prefill_hosts}``,
    ``{prefill_ports}``, ``{decode_hosts}`` or ``{decode_ports}`` expands to one element per server,
    matching vLLM's ``toy_proxy_server.py`` flags. Its readiness is checked on ``/healthcheck``.
    """
    if template is None:
        argv = [sys.executable, "-m", "pytest_pdserve.proxy", "--host", "127.0.0.1", "--port", str(port)]
        for h in prefill:
            argv += ["--prefill", h.url]
        for h in decode:
            argv += ["--decode", h.url]
        if api_key:
            argv += ["--api-key", api_key]
        return argv, "/health"
    lists = {
        "{prefill_hosts}": [httpx.URL(h.url).host for h in prefill],
        "{prefill_ports}": [str(h.port) for h in prefill],
        "{decode_hosts}": [httpx.URL(h.url).host for h in decode],
        "{decode_ports}": [str(h.port) for h in decode],
    }
    out: list[str] = []
    for element in template:
        if element in lists:
            out += lists[element]
        else:
            out.append(element.replace("{port}", str(port)).replace("{python}", sys.executable))
    return out, "/healthcheck"


class _Progress:
    """Throttled start-up progress: role, elapsed time, last log line; at most one line per role per 5 s."""

    EVERY = 5.0

    def __init__(self, report: Reporter) -> None:
        self.report = report
        self.last: dict[str, float] = {}

    def __call__(self, name: str, elapsed: float, last_line: str) -> None:
        now = time.monotonic()
        if now - self.last.get(name, 0.0) < self.EVERY:
            return
        self.last[name] = now
        self.report(f"pdserve: starting {name} ({elapsed:.0f}s) {last_line[-160:]}")


_ROLES = ("prefill", "decode", "proxy")

#: ClusterSpec fields attach mode cannot apply to servers it did not start (compared with the defaults).
_SERVER_SETTINGS = (
    "prefill_tp", "decode_tp", "model_kind", "max_model_len", "gpu_memory_utilization", "enable_prefix_caching",
    "mamba_cache_mode", "trust_remote_code", "kv_connector", "kv_buffer_device", "kv_load_failure_policy",
    "kv_connector_extra_config", "extra_args", "prefill_extra_args", "decode_extra_args", "env", "prefill_env",
    "decode_env",
)  # fmt: skip


def attach(
    *,
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    proxy_url: str | None,
    model: str | None,
    api_key: str | None,
    attention_backend: str | None,
    block_size: int | None,
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
    ``vllm:cache_config_info`` metric when they export it, else ``block_size``, else the default.

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
    return PDCluster(
        spec=ClusterSpec(name="attached"), engine="attached", model=wanted,
        block_size=discovered or block_size or DEFAULT_BLOCK_SIZE, attention_backend=attention_backend,
        prefill=tuple(h for h in handles if h.role == "prefill"),
        decode=tuple(h for h in handles if h.role == "decode"), proxy=proxy, attached=True,
    )  # fmt: skip


def _get(h: ServerHandle, path: str, timeout: float) -> httpx.Response:
    return httpx.get(f"{h.url}{path}", headers=h.headers, timeout=timeout, trust_env=False)


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
        hint = " (the server wants an API key: --pd-api-key / $PDSERVE_API_KEY)" if r.status_code == 401 else ""
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
    """The block size an attached server reports in ``vllm:cache_config_info`` (None when none does)."""
    for h in handles:
        with contextlib.suppress(Exception):  # best effort: an older server or a metrics-less proxy path
            for labels in scrape(h.client, timeout=timeout, strict=False).series("vllm:cache_config_info"):
                value = dict(labels).get("block_size", "")
                if value.isdigit() and int(value) > 0:
                    return int(value)
    return None


def _attach_mismatch(spec: ClusterSpec, cluster: PDCluster) -> list[str]:
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


def iter_handles(clusters: Sequence[PDCluster]) -> Iterator[ServerHandle]:
    """Every server handle of every cluster."""
    for c in clusters:
        yield from c.servers
