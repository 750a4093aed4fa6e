"""Start one P/D cluster, and clean up after it: the launcher the manager uses.

Lifecycle of one cluster (each step undone if a later one fails):

1. plan and lease GPUs (`gpu_plan.py`: positions in the caller's visible list; TP-aware) and every port
   each server binds;
2. build argv/env per server (`commands.py`) and spawn P and D together, each in its own session;
   when P and D would share a GPU they are staggered instead, since two vLLMs profiling one GPU at
   once mis-size their KV caches;
3. register every process group, and the lease fds, with the session's watchdog, so a SIGKILLed
   pytest still takes its servers (and only its servers) down and leases stay held until they are gone;
4. wait for all servers at once (fail fast on the first exit, with its log tail and a hint);
5. start the proxy with them and wait for it; check the effective configuration and, unless turned off,
   one request through the proxy that moves KV (`verify.py`).

Cleanup stops processes in parallel, hands GPUs back behind the release gate, then frees the ports.
Sharing clusters between tests, remembering failures and making room are the manager's (`manager.py`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from pytest_pdserve.cluster import PDCluster, ServerHandle, served_model_name
from pytest_pdserve.common import created
from pytest_pdserve.common.child_env import child_environ
from pytest_pdserve.common.logfile import open_append
from pytest_pdserve.common.redaction import redact_env
from pytest_pdserve.config import acceptance, commands
from pytest_pdserve.config.cluster_settings import ClusterSettings
from pytest_pdserve.config.commands import Role, ServerCommand, ServerPorts
from pytest_pdserve.config.effective import AskedConfig, effective
from pytest_pdserve.engines.engine import EngineSetup
from pytest_pdserve.errors import LeaseTimeout, PDServeError
from pytest_pdserve.machine import leases
from pytest_pdserve.machine.gpu_plan import GpuPlan, GpuPlanner
from pytest_pdserve.machine.paths import LOG_DIR_MODE, ensure_dir
from pytest_pdserve.running import port_race, verify
from pytest_pdserve.running.process import ServerProcess, StopReport, new_run_token, wait_all_ready
from pytest_pdserve.running.proctree import tree_pids
from pytest_pdserve.running.progress import StartProgress
from pytest_pdserve.running.rpc_dirs import RPC_BASE_ENV, make_rpc_dir
from pytest_pdserve.running.supervisors import Supervisors
from pytest_pdserve.running.watchdog import Watchdog
from pytest_pdserve.spec import ClusterSpec

log = logging.getLogger(__name__)

Reporter = Callable[[str], None]


@dataclass
class LaunchedCluster:
    """A running cluster and everything that must be undone to stop it."""

    cluster: PDCluster
    processes: list[ServerProcess]
    gpu_plan: GpuPlan | None
    port_leases: list[leases.PortLease]
    label: str
    last_used: float = field(default_factory=time.monotonic)

    @property
    def held_gpus(self) -> int:
        """GPUs this cluster holds: its plan's, or (no plan: a kept cluster this run claimed, whose keeper holds
        the leases) the distinct GPUs its servers see (none for attached servers)."""
        if self.gpu_plan is not None:
            return self.gpu_plan.held
        return len({gpu for s in self.cluster.servers for gpu in s.gpus})


class ClusterLauncher:
    """Starts clusters and cleans up after them; owns the session's watchdog and guard (the supervisors)."""

    def __init__(self, settings: ClusterSettings, report: Reporter) -> None:
        self.settings = settings
        #: The session's GPU planner (which GPUs each server sees, their leases and release gate).
        self.gpus = GpuPlanner(settings, report)
        self.report = report
        self.run_token = new_run_token()
        self.supervisors = Supervisors(self.run_token, settings.shutdown_timeout, self.log_path, report)
        #: Around a restart's wait (:meth:`respawn`): the pytest side pauses pytest-timeout's clock, as for a start.
        self.restart_clock: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext

    def log_path(self, name: str) -> Path:
        """``name`` in the log directory, which is made again if it was removed mid-run: private (0700) like the
        first time (a plain ``mkdir`` made it 0755).

        :raises PathError: it cannot be made (the message names it)."""
        return ensure_dir(self.settings.log_dir, LOG_DIR_MODE, mark=created.RUN_LOGS) / name

    # ------------------------------------------------------------------ supervisors (supervisors.py)

    def watch(self) -> Watchdog:
        """The session's watchdog, (re)started with the guard if either is gone."""
        return self.supervisors.watch()

    def close(self) -> None:
        """Stop the watchdog and the guard (after every cluster is stopped). Safe to call twice."""
        self.supervisors.close()

    def orphan_grace(self) -> float:
        """SIGTERM-to-SIGKILL grace of the watchdog and the guards (:meth:`Supervisors.orphan_grace`)."""
        return self.supervisors.orphan_grace()

    # ------------------------------------------------------------------ start

    def launch(
        self,
        spec: ClusterSpec,
        label: str,
        setup: EngineSetup,
        model: str,
        asked: AskedConfig,
        *,
        make_room: Callable[[int], None],
        environ: Mapping[str, str],
        proxy_port: int | None = None,
    ) -> LaunchedCluster:
        """Start ``spec``'s servers and proxy and return them running (everything undone on failure); started again
        on other ports when another process took a port leased for it (port_race.py).

        :param asked: ``spec`` merged with the session (``effective.effective``), made once for the cluster.
        :param environ: what every process of the cluster inherits (``start_env.start_environ``'s one copy)."""
        return port_race.start_retrying(
            lambda held: self._launch_once(spec, label, setup, model, asked, make_room, proxy_port, held, environ),
            label=label, fixed_port=proxy_port, report=self.report,
        )  # fmt: skip

    def check_accepted(self, spec: ClusterSpec, setup: EngineSetup, asked: AskedConfig) -> None:
        """Refuse what vLLM would refuse or die on (config/acceptance.py) before anything is leased, built or started:
        one command per role, with a placeholder model and ports (the rules read neither).

        :raises VllmRefuses: with vLLM's reason.
        """
        ports = ServerPorts(http=0, side_channel=0, vllm_port=0)
        model = spec.model or f"<the {spec.model_kind} model>"
        for role in ("prefill", "decode"):
            cmd = commands.build_server_command(
                spec=spec, role=role, index=0, model=model, ports=ports, engine=setup.info, asked=asked, gpu_env={},
                platform_env=setup.platform_env, platform_args=setup.platform_args,
            )  # fmt: skip
            acceptance.check_command(cmd, spec, setup.info, self.settings.defaults.platform)

    def _launch_once(
        self, spec: ClusterSpec, label: str, setup: EngineSetup, model: str, asked: AskedConfig,
        make_room: Callable[[int], None], proxy_port: int | None, port_leases: list[leases.PortLease],
        environ: Mapping[str, str],
    ) -> LaunchedCluster:  # fmt: skip
        t0 = time.monotonic()
        processes: list[ServerProcess] = []
        gpu_plan: GpuPlan | None = None
        watchdog = self.watch()
        try:
            gpu_plan = self.gpus.plan(spec, label, make_room)
            # Lease fds go to the watchdog once the servers are spawned: its hello (~50 ms) then overlaps
            # their start-up instead of delaying it.
            holds: list[tuple[str, tuple[int, ...]]] = []
            if gpu_plan.leases:
                holds.append((f"{label}-gpus", gpu_plan.fds))
            roles: list[tuple[Role, int]] = [("prefill", i) for i in range(spec.num_prefill)]
            roles += [("decode", j) for j in range(spec.num_decode)]
            handles: list[ServerHandle] = []
            notes: dict[str, None] = {}  # ordered, once each: every server usually has the same
            # Servers sharing a GPU get their share of its memory (gpu_plan.py) unless one was given: the merge again
            # with that share as the session's (one per share; the cluster's own `asked` otherwise).
            shared_asked = {
                util: effective(spec, replace(self.settings.defaults, gpu_memory_utilization=util))
                for util in set(gpu_plan.utilization) if util is not None
            }  # fmt: skip
            for (role, index), positions, util in zip(roles, gpu_plan.positions, gpu_plan.utilization, strict=True):
                ports, held = self._lease_ports(f"{label} {role}-{index}", 1)
                port_leases += held
                gpu_env = self.settings.inventory.child_env(positions) if positions else {}
                cmd = commands.build_server_command(
                    spec=spec, role=role, index=index, model=model, ports=ports, engine=setup.info,
                    asked=asked if util is None else shared_asked[util], gpu_env=gpu_env,
                    platform_env=setup.platform_env, platform_args=setup.platform_args,
                )  # fmt: skip
                # What vLLM would refuse or die on is refused here, before any server starts (rules/).
                verdict = acceptance.check_command(cmd, spec, setup.info, self.settings.defaults.platform)
                for replaced in verdict.replacements:
                    notes[replaced.describe()] = None
                for limit in verdict.limits:
                    notes[limit] = None
                handles.append(self._server(label, role, index, cmd, ports, model, positions, setup.info.name, environ))
                assert handles[-1].process is not None
                processes.append(handles[-1].process)
            # The proxy starts together with the servers (it needs only their URLs), so its own start-up
            # (~0.5 s of imports) hides behind theirs instead of adding to the cluster's ready time.
            proxy = self._prepare_proxy(
                label, handles, watchdog, processes, port_leases, environ, hold=False, port=proxy_port
            )
            holds += [(f"{label}-ports-{lease.base}", lease.fds) for lease in port_leases]

            def hold_leases() -> None:
                for name, fds in holds:
                    watchdog.hold(name, fds)

            # Every process of the cluster holds every lease fd of it: a lease frees only when its servers are gone.
            fds = [*gpu_plan.fds, *(fd for lease in port_leases for fd in lease.fds)]
            self._start_servers(spec, [*handles, proxy], gpu_plan.shared, t0, watchdog, hold_leases, fds)
            for h in [*handles, proxy]:  # ServerHandle.restart
                h.respawn = functools.partial(self.respawn, processes, fds)
            cluster = PDCluster.of(
                spec, handles, proxy, engine=setup.info.name, model=served_model_name(cmd.argv, model),
                block_size=asked.block_size, attention_backend_asked=asked.attention_backend,
                platform=self.settings.inventory.platform, vllm_version=str(setup.info.version),
                started_seconds=time.monotonic() - t0, notes=(*asked.overrides, *notes),
            )  # fmt: skip
            # What the servers really run must be what was asked (a mismatch fails the start), and P/D-ready, not
            # HTTP-ready: KV must move through the proxy. Both at once (verify.check_started).
            pd_ready = verify.check_started(
                cluster, max_model_len=asked.max_model_len, pd_ready=self.settings.ready_check
            )
            if pd_ready is not None:
                cluster.pd_ready_seconds = pd_ready
                cluster.started_seconds = time.monotonic() - t0
            self.report(cluster.describe())
            return LaunchedCluster(cluster, processes, gpu_plan, port_leases, label)
        except BaseException:
            self.cleanup(label, processes, gpu_plan, port_leases)
            raise

    def _server(
        self,
        label: str,
        role: Role,
        index: int,
        cmd: ServerCommand,
        ports: ServerPorts,
        model: str,
        positions: Sequence[int],
        engine: str,
        environ: Mapping[str, str],
    ) -> ServerHandle:
        """One server's process (not started) and handle; its log starts with the env delta it runs with."""
        log_path = self.log_path(f"{label}-{cmd.name}.log")
        # The env delta heads each log (ServerProcess.start adds the argv line), so a CI artifact says what ran.
        try:  # never blocks on a FIFO planted where the log goes (logfile.open_append)
            with os.fdopen(open_append(log_path), "a", encoding="utf-8") as fh:
                fh.write(f"# pdserve: {cmd.name}: env: {json.dumps(redact_env(cmd.env), sort_keys=True)}\n")
        except OSError as exc:
            raise PDServeError(f"{cmd.name}: cannot write its log {log_path}: {exc.strerror or exc}") from None
        url = f"http://127.0.0.1:{ports.http}"
        env = child_env(cmd.env, environ)
        rpc_dir = None
        if engine == "vllm" and RPC_BASE_ENV not in env:  # its IPC sockets in a directory of its own (rpc_dirs.py)
            rpc_dir = make_rpc_dir()
            env[RPC_BASE_ENV] = str(rpc_dir)
        proc = ServerProcess(
            cmd.name, cmd.argv, env, log_path,
            health_url=f"{url}/health", models_url=f"{url}/v1/models",
            model_id=served_model_name(cmd.argv, model),
            api_key=self.settings.defaults.api_key, run_token=self.run_token, rpc_dir=rpc_dir,
        )  # fmt: skip
        tokens = tuple(self.settings.inventory.gpus[p].token for p in positions)
        return ServerHandle(role, index, url, self.settings.defaults.api_key, log_path, proc, cmd, ports, tokens)

    def _lease_ports(self, label: str, width: int) -> tuple[ServerPorts, list[leases.PortLease]]:
        low, high = self.settings.port_range
        held: list[leases.PortLease] = []
        try:
            lease_dir = self.settings.lease_dir
            held.append(leases.acquire_ports(lease_dir, 1, low=low, high=high, purpose=f"{label} http"))
            for width_, what in ((width, "nixl side channel"), (commands.VLLM_PORT_WINDOW, "VLLM_PORT")):
                held.append(leases.acquire_port_span(lease_dir, width_, low=low, high=high, purpose=f"{label} {what}"))
        except BaseException:
            # The caller only learns about leases we return: free the ones taken before the failure.
            for lease in held:
                lease.release()
            raise
        http, side, window = held
        return ServerPorts(http=http.base, side_channel=side.base, vllm_port=window.base), held

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
        deadline = t0 + self.settings.startup_timeout
        progress = StartProgress(self.report, self.settings.terminal)
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
        environ: Mapping[str, str],
        hold: bool = True,
        port: int | None = None,
    ) -> ServerHandle:
        """Lease the proxy's port (``port`` exactly, when given) and build its process (not started)."""
        low, high = self.settings.port_range
        if port is not None:
            try:
                lease = leases.acquire_fixed_port(self.settings.lease_dir, port, purpose=f"{label} proxy")
            except LeaseTimeout as exc:
                raise PDServeError(f"--pd-proxy-port {port}: {exc}; free it or choose another port") from None
        else:
            lease = leases.acquire_ports(self.settings.lease_dir, 1, low=low, high=high, purpose=f"{label} proxy")
        port_leases.append(lease)
        if hold:
            watchdog.hold(f"{label}-ports-{lease.base}", lease.fds)
        port = lease.base
        prefill = [h for h in handles if h.role == "prefill"]
        decode = [h for h in handles if h.role == "decode"]
        cmd = commands.build_proxy_command(
            self.settings.proxy_command, port, [(httpx.URL(h.url).host, h.port, h.url) for h in prefill],
            [(httpx.URL(h.url).host, h.port, h.url) for h in decode], self.settings.defaults.api_key,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        log_path = self.log_path(f"{label}-proxy.log")
        proc = ServerProcess(
            "proxy", cmd.argv, child_env(cmd.env, environ), log_path, health_url=f"{url}{cmd.health_path}",
            api_key=self.settings.defaults.api_key, run_token=self.run_token,
        )  # fmt: skip
        processes.append(proc)
        api_key = self.settings.defaults.api_key
        return ServerHandle("proxy", 0, url, api_key, log_path, proc, None, ServerPorts(port, 0, 0))

    def start_proxy(
        self,
        label: str,
        handles: list[ServerHandle],
        processes: list[ServerProcess],
        port_leases: list[leases.PortLease],
        t0: float,
        environ: Mapping[str, str],
    ) -> ServerHandle:
        """Start the proxy alone and wait for it (attach mode, where the servers are already up); started again on
        another port when another process took the one leased for it, by the same rule as a cluster's servers
        (port_race.py). What it started and leased is appended to ``processes`` / ``port_leases`` once it runs."""

        def once(held: list[leases.PortLease]) -> ServerHandle:
            started: list[ServerProcess] = []
            try:
                watchdog = self.watch()
                proxy = self._prepare_proxy(label, handles, watchdog, started, held, environ)
                assert proxy.process is not None
                proxy.process.start([fd for lease in held for fd in lease.fds])
                watchdog.watch(proxy.process.pid or 0, proxy.process.pgid or 0)
                progress = StartProgress(self.report, self.settings.terminal)
                deadline = t0 + self.settings.startup_timeout
                proxy.ready_seconds = wait_all_ready([proxy.process], deadline, progress)["proxy"]
            except BaseException:
                self.cleanup(label, started, None, held)  # each attempt undoes its own (port_race's contract)
                raise
            processes.extend(started)
            port_leases.extend(held)
            return proxy

        return port_race.start_retrying(once, label=label, fixed_port=None, report=self.report)

    def respawn(self, processes: list[ServerProcess], inherit_fds: Sequence[int], old: ServerProcess) -> ServerProcess:
        """One server of a running cluster started again (``ServerHandle.restart``): stopped first if it still runs,
        a fresh copy (same argv, env, ports, log) started in its place with the cluster's lease fds, watched by the
        watchdog instead of the old one, and waited for as at a start. The cluster's teardown stops the new one,
        whatever happens next.

        :raises ServerStartupError: it did not come up again (killed first, as a failed start is).
        """
        old.stop(self.settings.shutdown_timeout)  # idempotent: a killed server returns its report at once
        watchdog = self.watch()
        if old.pgid is not None:
            watchdog.unwatch(old.pgid)
        fresh = old.respawned()
        processes[processes.index(old)] = fresh
        fresh.start(inherit_fds)
        watchdog.watch(fresh.pid or 0, fresh.pgid or 0)
        with self.restart_clock():
            deadline = time.monotonic() + self.settings.startup_timeout
            wait_all_ready([fresh], deadline, StartProgress(self.report, self.settings.terminal))
        return fresh

    # ------------------------------------------------------------------ stop

    def disown(self, launched: LaunchedCluster) -> None:
        """Forget a cluster a reuse keeper now owns: no stop, no lease release, no watchdog sweep of its servers.

        Our lease fds are closed without unlocking (the servers and the keeper hold theirs); the watchdog forgets
        its groups and drops its copies of the fds.
        """
        for s in launched.cluster.servers:
            s.close()
        for p in launched.processes:
            if self.supervisors.watchdog is not None and p.pgid is not None:
                self.supervisors.watchdog.unwatch(p.pgid)
            p.disown()
        held = [*(launched.gpu_plan.leases if launched.gpu_plan is not None else ()), *launched.port_leases]
        names = [f"{launched.label}-gpus", *(f"{launched.label}-ports-{lease.base}" for lease in launched.port_leases)]
        for lease in held:
            lease.disown()
        if self.supervisors.watchdog is not None:
            for name in names:
                self.supervisors.watchdog.drop(name)

    def teardown(self, launched: LaunchedCluster) -> None:
        """Stop a cluster this launcher started (its clients first, then everything `cleanup` undoes)."""
        for s in launched.cluster.servers:
            s.close()
        self.cleanup(launched.label, launched.processes, launched.gpu_plan, launched.port_leases)

    def cleanup(
        self,
        label: str,
        processes: list[ServerProcess],
        gpu_plan: GpuPlan | None,
        port_leases: list[leases.PortLease],
    ) -> None:
        """Stop processes in parallel, then hand GPUs back behind the release gate, then ports. Best effort."""
        our_pids = tree_pids(self.run_token, (p.pid for p in processes))
        started = [p for p in processes if p.pid is not None]
        if started:
            with ThreadPoolExecutor(max_workers=len(started)) as pool:
                list(pool.map(lambda p: _safe_stop(p, self.settings.shutdown_timeout), started))
        for p in started:
            if self.supervisors.watchdog is not None and p.pgid is not None:
                try:
                    self.supervisors.watchdog.unwatch(p.pgid)
                except Exception:
                    log.exception("watchdog unwatch failed")
        if gpu_plan is not None:
            waited = self.gpus.release(gpu_plan, our_pids)
            if waited is not None:
                self.report(f"pdserve: {label}: GPUs {gpu_plan.keys} released after a {waited:.2f}s gate")
        for lease in port_leases:
            lease.release()
        if self.supervisors.watchdog is not None:
            for name in [f"{label}-gpus", *(f"{label}-ports-{lease.base}" for lease in port_leases)]:
                try:
                    self.supervisors.watchdog.drop(name)
                except Exception:
                    log.debug("watchdog drop %s failed", name, exc_info=True)


def child_env(delta: Mapping[str, str | None], environ: Mapping[str, str]) -> dict[str, str]:
    """A server's (or the proxy's) whole environment: ``environ``, the copy taken when its cluster's start was
    decided (``start_env.start_environ``: what was checked and fingerprinted), with the server's ``delta`` applied
    (``None`` removes a variable), by the one rule of every child's environment (``common/child_env.py``); never
    ``os.environ`` as it is now. A variable no program can be given is an error.

    :raises EnvTooLarge: naming it."""
    return child_environ(delta, oversize="refuse", base=environ)


def _safe_stop(proc: ServerProcess, grace: float) -> StopReport | None:
    try:
        return proc.stop(grace)
    except Exception:
        log.exception("stopping %s failed", proc.name)
        return None
