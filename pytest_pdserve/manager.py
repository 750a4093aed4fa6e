"""The manager that shares P/D clusters between tests and stops them.

`ClusterManager` is pytest-free: the fixtures give it the resolved settings, the inventory, a log
directory and a reporter callback. It shares one cluster per equal `ClusterSpec`, remembers a spec that
failed to start (later tests fail at once with the same error), stops its least recently used clusters
when a new spec needs their GPUs, and stops everything at the end. Starting one cluster and cleaning up
after it is `launch.py`'s job; attach mode (servers someone else started) is `attach.py`'s. The objects
handed to tests (`PDCluster`, `ServerHandle`) live in `cluster.py`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pytest_pdserve import reuse
from pytest_pdserve.attach import attach_mismatch, start_attached
from pytest_pdserve.cluster import SIM_DEFAULT_MODELS, EngineSetup, PDCluster, Reused
from pytest_pdserve.commands import SessionDefaults
from pytest_pdserve.errors import ClusterUnavailable, ServerDied
from pytest_pdserve.gpu_plan import GpuPlanner
from pytest_pdserve.inventory import Inventory
from pytest_pdserve.launch import ClusterLauncher, LaunchedCluster, Reporter
from pytest_pdserve.lockfiles import want_file
from pytest_pdserve.port_leases import DEFAULT_PORT_RANGE
from pytest_pdserve.reuse import ReuseOptions
from pytest_pdserve.spec import ClusterSpec

__all__ = ["ClusterManager"]

log = logging.getLogger(__name__)


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
        port_range: tuple[int, int] | None = None,
        reporter: Reporter | None = None,
        reuse: ReuseOptions | None = None,
        terminal: bool = True,
    ) -> None:
        self._engine_setup = engine_setup
        self._engines: dict[str, EngineSetup] = {}
        self.default_engine = default_engine
        self.defaults = defaults
        self.inventory = inventory
        self.model = model
        self.report = reporter or (lambda msg: log.info("%s", msg))
        self.gpus = GpuPlanner(
            inventory, lease_dir, gpu_wait=gpu_wait, gpu_wait_timeout=gpu_wait_timeout,
            prefill_gpu_ids=prefill_gpu_ids, decode_gpu_ids=decode_gpu_ids, share_gpus=share_gpus,
            gpu_memory_utilization=defaults.gpu_memory_utilization, report=self.report,
        )  # fmt: skip
        self.launcher = ClusterLauncher(
            defaults=defaults, inventory=inventory, gpus=self.gpus, log_dir=log_dir, lease_dir=lease_dir,
            startup_timeout=startup_timeout, shutdown_timeout=shutdown_timeout, proxy_command=proxy_command,
            report=self.report, port_range=port_range or DEFAULT_PORT_RANGE, terminal=terminal,
        )  # fmt: skip
        self.run_token = self.launcher.run_token
        self._running: dict[ClusterSpec, LaunchedCluster] = {}
        self._failed: dict[ClusterSpec, BaseException] = {}
        #: Servers that died under a test, one per cluster (health.py), for the end-of-run summary.
        self.deaths: list[ServerDied] = []
        self._lock = threading.RLock()
        self._counter = 0
        #: ``--pd-proxy-port``: the proxy of these specs listens on the given port (leased like any other).
        self.proxy_ports: dict[ClusterSpec, int] = {}
        #: ``--pd-reuse``: keep clusters for the next run and attach to kept ones (reuse.py); None: off.
        self.reuse = reuse
        #: Kept clusters this run attached to, for the end-of-run summary.
        self.reused: list[Reused] = []
        #: Specs someone other than the fixtures asked for (see :meth:`get`): never stopped before the end.
        self.pinned: set[ClusterSpec] = set()

    # ------------------------------------------------------------------ public

    def get(self, spec: ClusterSpec, *, pin: bool = True) -> PDCluster:
        """The running cluster for ``spec``, starting it if needed.

        A spec that failed to start fails again at once (same error) instead of restarting for every test.
        ``pin``: keep it up to the end (``--pd-export-env``'s session cluster); the fixtures pass False for the
        clusters they hand out, which they stop once no remaining test uses them (glue/last_user.py).
        """
        with self._lock:
            if pin:
                self.pinned.add(spec)
            if spec in self._running:
                self.ensure_watchdog()
                running = self._running[spec]
                running.last_used = time.monotonic()
                return running.cluster
            if spec in self._failed:
                # Same error, fresh traceback: re-raising the object would grow its traceback test after test.
                raise self._failed[spec].with_traceback(None)
            try:
                running = self._reuse_or_start(spec) if self.reuse is not None else self._start(spec)
            except ClusterUnavailable:
                raise
            except Exception as exc:
                # Remembered so every later test that needs this spec fails at once instead of restarting it.
                # (launch() already cleaned up, for BaseExceptions such as pytest-timeout's too.)
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
                    self._running[key] = start_attached(cfg, self.launcher, self.defaults)
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

    def ensure_watchdog(self) -> None:
        """Start the watchdog (or the guard) again if it died while clusters run (both sweep by run token)."""
        with self._lock:
            if self._running:
                self.launcher.watch()

    def running(self) -> list[PDCluster]:
        """Clusters that are up now."""
        return [r.cluster for r in self._running.values()]

    def is_running(self, spec: ClusterSpec) -> bool:
        """Whether a cluster for ``spec`` is up now."""
        with self._lock:
            return spec in self._running

    def stop(self, spec: ClusterSpec) -> PDCluster | None:
        """Stop one cluster (no-op if it is not running); returns the stopped cluster, so that whoever handed
        it out can forget it (a later ``get`` of the same spec starts a fresh one)."""
        with self._lock:
            running = self._running.pop(spec, None)
        if running is None:
            return None
        if running.claim is not None:  # a kept cluster: the test wants it gone (GPUs, memory), not handed back
            running.claim.stop()
        else:
            self._teardown(running)
        return running.cluster

    def stop_all(self) -> None:
        """Stop every cluster (a reuse run keeps its healthy ones instead), then the watchdog. Safe to call twice."""
        with self._lock:
            items = list(self._running.values())
            self._running.clear()
        keep = []
        for running in items:
            if running.claim is not None:  # a kept cluster we claimed: hand it back (or have it stopped if it died)
                if running.cluster.health.died is not None:
                    self.deaths.append(running.cluster.health.died)
                    running.claim.stop()
                else:
                    running.claim.release()
                for s in running.cluster.servers:
                    s.close()
            elif self._keepable(running):
                keep.append(running)
            else:
                self._teardown(running)
        if keep:
            self._keep(keep)
        self.launcher.close()

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

    def _make_room(self, need: int) -> None:
        """Stop our own least recently used clusters whose GPUs a new spec needs (the factory's contract)."""
        while self._running:
            held = sum(r.held_gpus for r in self._running.values())
            if self.inventory.count - held >= need:
                return
            victim = min(self._running.values(), key=lambda r: r.last_used)
            self.report(f"pdserve: stopping cluster {victim.cluster.spec.name} to free its GPUs for another spec")
            self.stop(victim.cluster.spec)

    def _reuse_or_start(self, spec: ClusterSpec) -> LaunchedCluster:
        """A kept cluster with this spec's fingerprint, claimed and checked; else a fresh one (saying why)."""
        assert self.reuse is not None
        setup = self.engine_for(spec)
        model = self._resolve_model(spec, setup)
        wanted = reuse.fingerprint(
            spec=spec, defaults=self.defaults, setup=setup, model=model, placement=self._placement(spec),
            proxy_command=self.launcher.proxy_command, environ=os.environ,
        )  # fmt: skip
        claim, why = reuse.find_reusable(self.reuse.directory, wanted, spec.name, self.report, ttl=self.reuse.ttl)
        if claim is not None:
            try:
                running = reuse.adopt(
                    claim, spec, api_key=self.defaults.api_key,
                    max_model_len=spec.max_model_len or self.defaults.max_model_len, report=self.report,
                )  # fmt: skip
            except Exception as exc:
                claim.stop()
                why = f"kept cluster {claim.kept.id} failed its check ({exc}); stopped it"
            else:
                self.report(running.cluster.describe())
                assert running.cluster.reused is not None
                self.reused.append(running.cluster.reused)
                return running
        if why is not None:
            self.report(f"pdserve: {spec.name}: starting a fresh cluster: {why}")
        running = self._start(spec)
        running.fingerprint = wanted
        return running

    def _placement(self, spec: ClusterSpec) -> dict[str, object]:
        """Where a cluster's servers run, as far as settings decide it (part of its reuse fingerprint)."""
        return {
            "gpus": [g.uuid or str(g.index) for g in self.inventory.gpus], "platform": self.inventory.platform,
            "prefill_gpu_ids": self.gpus.prefill_gpu_ids, "decode_gpu_ids": self.gpus.decode_gpu_ids,
            "share_gpus": self.gpus.share_gpus, "proxy_port": self.proxy_ports.get(spec),
        }  # fmt: skip

    def _keepable(self, running: LaunchedCluster) -> bool:
        """A cluster this reuse run started, whose servers all still run."""
        return (
            self.reuse is not None
            and running.fingerprint is not None
            and running.cluster.health.died is None
            and bool(running.processes)
            and all(p.returncode is None and p.pid is not None for p in running.processes)
        )

    def _keep(self, items: list[LaunchedCluster]) -> None:
        """Hand ``items`` to a new keeper; if it cannot take them, stop them as usual."""
        assert self.reuse is not None
        orders = []
        for r in items:
            assert r.fingerprint is not None
            plan = r.gpu_plan
            held = [*(plan.leases if plan is not None else ()), *r.port_leases]
            locks = [(fd, str(path)) for lease in held for fd, path in lease.locks]
            # Each lease has a want file: a run waiting for one of its GPUs or its fixed proxy port says so there.
            want = [str(want_file(Path(path))) for _, path in locks]
            # On real CUDA the keeper unlocks a GPU only once nvidia-smi lists none of the kept servers on it.
            gated = self.gpus.gated_keys(plan) if plan is not None else None
            orders.append((reuse.cluster_state(r, r.fingerprint, self.run_token, release_gate=gated), locks, want))
        try:
            pid = reuse.keep(
                orders, reuse_dir=self.reuse.directory, ttl=self.reuse.ttl, grace=self.launcher.orphan_grace(),
                run_token=self.run_token,
            )  # fmt: skip
        except reuse.ReuseError as exc:
            self.report(f"pdserve: reuse: {exc}; stopping the clusters instead")
            for r in items:
                self._teardown(r)
            return
        for r in items:
            self.launcher.disown(r)
        ids = ", ".join(str(state["id"]) for state, _, _ in orders)
        self.report(
            f"pdserve: reuse: kept {ids} for the next --pd-reuse run (keeper pid {pid}; stops after "
            f"{self.reuse.ttl:g}s idle; `pdserve ls`, `pdserve stop --all`)"
        )

    def _start(self, spec: ClusterSpec) -> LaunchedCluster:
        self._counter += 1
        setup = self.engine_for(spec)
        return self.launcher.launch(
            spec, f"{spec.name}-{self._counter}", setup, self._resolve_model(spec, setup),
            make_room=self._make_room, proxy_port=self.proxy_ports.get(spec), pd_ready_check=self.pd_ready_check,
        )  # fmt: skip

    # ------------------------------------------------------------------ stop

    def _teardown(self, running: LaunchedCluster) -> None:
        if running.cluster.health.died is not None:
            self.deaths.append(running.cluster.health.died)  # for the terminal summary
        self.launcher.teardown(running)
