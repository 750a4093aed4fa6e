"""The manager that starts, shares and stops P/D clusters.

`ClusterManager` is pytest-free: the fixtures give it the resolved settings, the inventory, a log
directory and a reporter callback. Lifecycle of one cluster (each step undone if a later one fails):

1. plan and lease GPUs (`gpu_plan.py`: positions in the caller's visible list; TP-aware) and every port
   each server binds;
2. build argv/env per server (`commands.py`) and spawn P and D together, each in its own session;
   when P and D would share a GPU they are staggered instead, since two vLLMs profiling one GPU at
   once mis-size their KV caches;
3. register every process group, and the lease fds, with the session's watchdog, so a SIGKILLed
   pytest still takes its servers (and only its servers) down and leases stay held until they are gone;
4. wait for all servers at once (fail fast on the first exit, with its log tail and a hint);
5. start the proxy and wait for it.

Attach mode (`ClusterManager.attached`) checks the given URLs through `attach.py` and, when no proxy
URL is given, starts only the built-in proxy in front of them. The objects handed to tests
(`PDCluster`, `ServerHandle`) live in `cluster.py`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from pytest_pdserve import commands, leases, verify
from pytest_pdserve.attach import ROLES, attach, attach_mismatch
from pytest_pdserve.cluster import (
    SIM_DEFAULT_MODELS,
    EngineSetup,
    PDCluster,
    ServerHandle,
    served_model_name,
)
from pytest_pdserve.commands import Role, ServerCommand, ServerPorts, SessionDefaults
from pytest_pdserve.effective import effective
from pytest_pdserve.errors import ClusterUnavailable, LeaseTimeout, PDServeError, ServerDied
from pytest_pdserve.gpu_plan import GpuPlan, GpuPlanner
from pytest_pdserve.inventory import Inventory
from pytest_pdserve.process import ServerProcess, StopReport, new_run_token, wait_all_ready
from pytest_pdserve.redaction import redact_env
from pytest_pdserve.spec import ClusterSpec
from pytest_pdserve.supervise import start_guard
from pytest_pdserve.watchdog import Watchdog

log = logging.getLogger(__name__)

Reporter = Callable[[str], None]

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


@dataclass
class _Running:
    """What the manager must undo for one cluster."""

    cluster: PDCluster
    processes: list[ServerProcess]
    gpu_plan: GpuPlan | None
    port_leases: list[leases.PortLease]
    label: str
    last_used: float = field(default_factory=time.monotonic)


class ClusterManager:
    """Starts clusters on demand, shares equal specs, and stops everything at the end of the session."""

    #: Prove each new cluster moves KV before handing it out (``--pd-ready-check``; fixtures.py sets it).
    pd_ready_check: bool = True

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
        share_gpus: bool = False,
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
        self.proxy_command = proxy_command
        self.report = reporter or (lambda msg: log.info("%s", msg))
        self.gpus = GpuPlanner(
            inventory, lease_dir, gpu_wait=gpu_wait, gpu_wait_timeout=gpu_wait_timeout,
            prefill_gpu_ids=prefill_gpu_ids, decode_gpu_ids=decode_gpu_ids, share_gpus=share_gpus,
            gpu_memory_utilization=defaults.gpu_memory_utilization, report=self.report,
        )  # fmt: skip
        self.run_token = new_run_token()
        self.port_range = port_range_from_env()
        self._watchdog: Watchdog | None = None
        self._guard: subprocess.Popen[bytes] | None = None
        self._running: dict[ClusterSpec, _Running] = {}
        self._failed: dict[ClusterSpec, BaseException] = {}
        #: Servers that died under a test, one per cluster (health.py), for the end-of-run summary.
        self.deaths: list[ServerDied] = []
        self._lock = threading.RLock()
        self._counter = 0
        #: ``--pd-proxy-port``: the proxy of these specs listens on the given port (leased like any other).
        self.proxy_ports: dict[ClusterSpec, int] = {}

    # ------------------------------------------------------------------ public

    def get(self, spec: ClusterSpec) -> PDCluster:
        """The running cluster for ``spec``, starting it if needed.

        A spec that failed to start fails again at once (same error) instead of restarting for every test.
        """
        with self._lock:
            if spec in self._running:
                self.ensure_watchdog()
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
            except Exception as exc:
                # Remembered so every later test that needs this spec fails at once instead of restarting it.
                # (_start already cleaned up, for BaseExceptions such as pytest-timeout's too.)
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
        mismatch = attach_mismatch(spec, cluster)
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
        origin = {role: cfg.source_of(f"{role}_urls" if role != "proxy" else "proxy_url") for role in ROLES}
        eff = effective(ClusterSpec(name="attached"), self.defaults)
        cluster = attach(
            prefill_urls=cfg.prefill_urls, decode_urls=cfg.decode_urls, proxy_url=cfg.proxy_url, model=cfg.model,
            api_key=eff.api_key, attention_backend=eff.attention_backend,
            block_size=eff.block_size, check_only=cfg.proxy_url is None, origin=origin,
        )  # fmt: skip
        processes: list[ServerProcess] = []
        port_leases: list[leases.PortLease] = []
        if cfg.proxy_url is None:
            # The servers answered: only now start a proxy in front of them (it leases its own port only).
            try:
                cluster.set_proxy(
                    self._start_proxy(
                        "attached", [*cluster.prefill, *cluster.decode], self._watch(), processes, port_leases, t0
                    )
                )
            except BaseException:
                self._cleanup("attached", processes, None, port_leases)
                raise
        cluster.started_seconds = time.monotonic() - t0
        self.report(cluster.describe())
        return _Running(cluster, processes, None, port_leases, "attached")

    def ensure_watchdog(self) -> None:
        """Start the watchdog (or the guard) again if it died while clusters run (both sweep by run token)."""
        with self._lock:
            if self._running:
                self._watch()

    def running(self) -> list[PDCluster]:
        """Clusters that are up now."""
        return [r.cluster for r in self._running.values()]

    def stop(self, spec: ClusterSpec) -> PDCluster | None:
        """Stop one cluster (no-op if it is not running); returns the stopped cluster, so that whoever handed
        it out can forget it (a later ``get`` of the same spec starts a fresh one)."""
        with self._lock:
            running = self._running.pop(spec, None)
        if running is None:
            return None
        self._teardown(running)
        return running.cluster

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
        if self._guard is not None:  # nothing left to guard; it would exit with this process anyway
            self._guard.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._guard.wait(5)
            self._guard = None

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
        if self._guard is None or self._guard.poll() is not None:
            # The second supervisor: acts only once pytest and the watchdog are both gone (supervise.py).
            self._guard = start_guard(self.run_token, self._orphan_grace(), self.log_dir / "guard.log")
        if self._watchdog is None or not self._watchdog.alive:
            # wait=False: the hello is checked at the first command, after the servers are spawned.
            self._watchdog = Watchdog.start(
                self.run_token,
                grace=self._orphan_grace(),
                log_path=self.log_dir / "watchdog.log",
                wait=False,
            )
        return self._watchdog

    def _orphan_grace(self) -> float:
        """SIGTERM-to-SIGKILL grace of the watchdog and the guards, who stop servers when pytest is dead.

        At most 3 s, so that no server is alive 5 s after pytest died, even one that ignores SIGTERM.
        """
        return min(self.shutdown_timeout, 3.0)

    def _make_room(self, need: int) -> None:
        """Stop our own least recently used clusters whose GPUs a new spec needs (the factory's contract)."""
        while self._running:
            held = sum(r.gpu_plan.held for r in self._running.values() if r.gpu_plan)
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
        gpu_plan: GpuPlan | None = None
        watchdog = self._watch()
        try:
            gpu_plan = self.gpus.plan(spec, label, self._make_room)
            # Lease fds go to the watchdog once the servers are spawned: its hello (~50 ms) then overlaps
            # their start-up instead of delaying it.
            holds: list[tuple[str, tuple[int, ...]]] = []
            if gpu_plan.leases:
                holds.append((f"{label}-gpus", gpu_plan.fds))
            roles: list[tuple[Role, int]] = [("prefill", i) for i in range(spec.num_prefill)]
            roles += [("decode", j) for j in range(spec.num_decode)]
            handles: list[ServerHandle] = []
            for (role, index), positions, util in zip(roles, gpu_plan.positions, gpu_plan.utilization, strict=True):
                ports, held = self._lease_ports(f"{label} {role}-{index}", 1)
                port_leases += held
                gpu_env = self.inventory.child_env(positions) if positions else {}
                # Servers sharing a GPU get their share of its memory (gpu_plan.py) unless one was given.
                defaults = self.defaults if util is None else replace(self.defaults, gpu_memory_utilization=util)
                cmd = commands.build_server_command(
                    spec=spec, role=role, index=index, model=model, ports=ports, engine=setup.info,
                    defaults=defaults, gpu_env=gpu_env, platform_env=setup.platform_env,
                    platform_args=setup.platform_args,
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
            proxy = self._prepare_proxy(
                label, handles, watchdog, processes, port_leases, hold=False, port=self.proxy_ports.get(spec)
            )
            holds += [(f"{label}-ports-{lease.base}", lease.fds) for lease in port_leases]

            def hold_leases() -> None:
                for name, fds in holds:
                    watchdog.hold(name, fds)

            # Every process of the cluster holds every lease fd of it: a lease frees only when its servers are gone.
            fds = [*gpu_plan.fds, *(fd for lease in port_leases for fd in lease.fds)]
            self._start_servers(spec, [*handles, proxy], gpu_plan.shared, t0, watchdog, hold_leases, fds)
            n_p = spec.num_prefill
            eff = effective(spec, self.defaults)
            cluster = PDCluster(
                spec=spec, engine=setup.info.name, model=served_model_name(cmd.argv, model),
                block_size=eff.block_size, attention_backend=eff.attention_backend,
                prefill=tuple(handles[:n_p]), decode=tuple(handles[n_p:]),
                proxy=proxy, platform=self.inventory.platform, vllm_version=str(setup.info.version),
                started_seconds=time.monotonic() - t0,
            )  # fmt: skip
            # What the servers really run must be what was asked (verify.py); a mismatch fails the start.
            verify.verify_cluster(cluster, max_model_len=spec.max_model_len or self.defaults.max_model_len)
            if self.pd_ready_check:  # P/D-ready, not HTTP-ready: KV must move through the proxy (verify.py)
                cluster.pd_ready_seconds = verify.pd_round_trip(cluster)
                cluster.started_seconds = time.monotonic() - t0
            self.report(cluster.describe())
            return _Running(cluster, processes, gpu_plan, port_leases, label)
        except BaseException:
            self._cleanup(label, processes, gpu_plan, port_leases)
            raise

    def _write_header(self, log_path: Path, cmd: ServerCommand) -> None:
        # The env delta heads each log (ServerProcess.start adds the argv line), so a CI artifact says what ran.
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("a", encoding="utf-8") as fh:
            fh.write(f"# pdserve: {cmd.name}: env: {json.dumps(redact_env(cmd.env), sort_keys=True)}\n")

    def _start_servers(
        self,
        spec: ClusterSpec,
        handles: list[ServerHandle],
        shared: bool,
        t0: float,
        watchdog: Watchdog,
        after_spawn: Callable[[], None] = lambda: None,
        inherit_fds: Sequence[int] = (),
    ) -> None:
        deadline = t0 + self.startup_timeout
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
                    b.process.start(inherit_fds)
                    watchdog.watch(b.process.pid or 0, b.process.pgid or 0)
                if i == 0:
                    after_spawn()
                ready = wait_all_ready([b.process for b in batch if b.process is not None], deadline, progress)
                for b in batch:
                    b.ready_seconds = ready[b.name]
            return
        for h in handles:  # spawn all first: every server's start-up begins at once
            assert h.process is not None
            h.process.start(inherit_fds)
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
        port: int | None = None,
    ) -> ServerHandle:
        """Lease the proxy's port (``port`` exactly, when given) and build its process (not started)."""
        low, high = self.port_range
        if port is not None:
            try:
                lease = leases.acquire_fixed_port(self.lease_dir, port, purpose=f"{label} proxy")
            except LeaseTimeout as exc:
                raise PDServeError(f"--pd-proxy-port {port}: {exc}; free it or choose another port") from None
        else:
            lease = leases.acquire_ports(self.lease_dir, 1, low=low, high=high, purpose=f"{label} proxy")
        port_leases.append(lease)
        if hold:
            watchdog.hold(f"{label}-ports-{lease.base}", lease.fds)
        port = lease.base
        prefill = [h for h in handles if h.role == "prefill"]
        decode = [h for h in handles if h.role == "decode"]
        cmd = commands.build_proxy_command(
            self.proxy_command, port, [(httpx.URL(h.url).host, h.port, h.url) for h in prefill],
            [(httpx.URL(h.url).host, h.port, h.url) for h in decode], self.defaults.api_key,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        log_path = self.log_dir / f"{label}-proxy.log"
        proc = ServerProcess(
            "proxy", cmd.argv, self._child_env(cmd.env), log_path, health_url=f"{url}{cmd.health_path}",
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
        proxy.process.start([fd for lease in port_leases for fd in lease.fds])
        watchdog.watch(proxy.process.pid or 0, proxy.process.pgid or 0)
        proxy.ready_seconds = wait_all_ready([proxy.process], t0 + self.startup_timeout, _Progress(self.report))[
            "proxy"
        ]
        return proxy

    # ------------------------------------------------------------------ stop

    def _teardown(self, running: _Running) -> None:
        if running.cluster.health.died is not None:
            self.deaths.append(running.cluster.health.died)  # for the terminal summary
        for s in running.cluster.servers:
            s.close()
        self._cleanup(running.label, running.processes, running.gpu_plan, running.port_leases)

    def _cleanup(
        self,
        label: str,
        processes: list[ServerProcess],
        gpu_plan: GpuPlan | None,
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
        if gpu_plan is not None:
            waited = self.gpus.release(gpu_plan, our_pids)
            if waited is not None:
                self.report(f"pdserve: {label}: GPUs {gpu_plan.keys} released after a {waited:.2f}s gate")
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
    from pytest_pdserve.proctree import RUN_TOKEN_ENV, pids_with_env

    pids = {p.pid for p in processes if p.pid is not None}
    with contextlib.suppress(OSError):
        pids.update(pids_with_env(RUN_TOKEN_ENV, run_token))
    return pids


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
