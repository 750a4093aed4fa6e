"""The manager that starts, shares and stops P/D clusters.

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

Attach mode (`ClusterManager.attached`) checks the given URLs through `attach.py` and, when no proxy
URL is given, starts only the built-in proxy in front of them. The objects handed to tests
(`PDCluster`, `ServerHandle`) live in `cluster.py`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pytest_pdserve import commands, leases, verify
from pytest_pdserve.attach import ROLES, attach, attach_mismatch
from pytest_pdserve.cluster import (
    SIM_DEFAULT_MODELS,
    ClusterUnavailable,
    EngineSetup,
    PDCluster,
    ServerHandle,
    served_model_name,
)
from pytest_pdserve.commands import Role, ServerCommand, ServerPorts, SessionDefaults
from pytest_pdserve.errors import ClusterSpecError, PDServeError
from pytest_pdserve.inventory import Inventory, gpu_processes
from pytest_pdserve.process import ServerProcess, StopReport, new_run_token, wait_all_ready
from pytest_pdserve.spec import DEFAULT_BLOCK_SIZE, ClusterSpec
from pytest_pdserve.watchdog import Watchdog

log = logging.getLogger(__name__)

Reporter = Callable[[str], None]

#: How long the release gate waits for nvidia-smi to stop listing our pids on a GPU.
GPU_RELEASE_TIMEOUT = 60.0
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
    gpu_lease: leases.GpuLease | None
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
            # What the servers really run must be what was asked (verify.py); a mismatch fails the start.
            verify.verify_cluster(cluster, max_model_len=spec.max_model_len or self.defaults.max_model_len)
            if self.pd_ready_check:  # P/D-ready, not HTTP-ready: KV must move through the proxy (verify.py)
                cluster.pd_ready_seconds = verify.pd_round_trip(cluster)
                cluster.started_seconds = time.monotonic() - t0
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
