"""The manager that shares P/D clusters between tests and stops them.

`ClusterManager` is pytest-free: the fixtures give it the session's `ClusterSettings` (every setting, the
inventory, the log directory: ``config/cluster_settings.py``), which it shares with its launcher and GPU planner,
and a reporter callback. It shares one cluster per equal `ClusterSpec`, remembers a spec that
failed to start (later tests fail at once with the same error), stops its least recently used clusters
when a new spec needs their GPUs, and stops everything at the end. Starting one cluster and cleaning up
after it is `launch.py`'s job; attach mode (servers someone else started) is `attach.py`'s; ``--pd-reuse`` (kept
clusters) is a `Reuser`'s, given by the reuse plugin (`reuse/handover.py`). The objects handed to tests
(`PDCluster`, `ServerHandle`) live in `cluster.py`.

The manager belongs to the pytest process that made it (``common/owner.py``): in a forked child its stops are
no-ops (the fixtures' finalizers, ``pytest_unconfigure``, the last-user stops, the hand-over to a keeper all go
through them) and a start is refused; a running cluster is still handed out, for the child to send requests to.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from pytest_pdserve.cluster import PDCluster
from pytest_pdserve.common.owner import Owner
from pytest_pdserve.config.cluster_settings import ClusterSettings
from pytest_pdserve.config.effective import AskedConfig, effective
from pytest_pdserve.engines.engine import SIM_DEFAULT_MODELS, EngineSetup
from pytest_pdserve.errors import ClusterStopped, ClusterUnavailable, ServerDied
from pytest_pdserve.machine.inventory import Inventory
from pytest_pdserve.running.attach import attach_mismatch, start_attached
from pytest_pdserve.running.launch import ClusterLauncher, LaunchedCluster, Reporter
from pytest_pdserve.running.start_env import Drift, start_environ
from pytest_pdserve.spec import ClusterSpec

__all__ = ["ClusterManager", "Reuser"]

log = logging.getLogger(__name__)


class Reuser(Protocol):
    """``--pd-reuse`` as the manager sees it (`reuse.handover.KeptClusters`); a run without it has none."""

    def find(
        self,
        spec: ClusterSpec,
        setup: EngineSetup,
        model: str,
        asked: AskedConfig,
        placement: Mapping[str, object],
        launcher: ClusterLauncher,
        environ: Mapping[str, str],
    ) -> LaunchedCluster | None:
        """A kept cluster for ``spec`` (``asked``: merged with the session) whose fingerprint (``environ``: what a
        fresh one's servers would inherit) is this one's, claimed and checked; None: the manager starts a fresh one
        (with ``environ``)."""
        ...

    def stop(self, running: LaunchedCluster) -> bool:
        """Stop a cluster :meth:`find` returned (through its keeper); False: not one of those."""
        ...

    def hand_over(self, running: Sequence[LaunchedCluster], launcher: ClusterLauncher) -> list[LaunchedCluster]:
        """The end of the run: keep or hand back what it can; returns the clusters the manager stops as usual."""
        ...


class ClusterManager:
    """Starts clusters on demand, shares equal specs, and stops everything at the end of the session."""

    def __init__(
        self,
        settings: ClusterSettings,
        *,
        engine_setup: Callable[[str], EngineSetup],
        reporter: Reporter | None = None,
        reuser: Reuser | None = None,
        env_drift: Drift | None = None,
    ) -> None:
        #: Every setting of the session's clusters (``ClusterSettings.for_config``), shared with the launcher.
        self.settings = settings
        self._engine_setup = engine_setup
        self._engines: dict[str, EngineSetup] = {}
        #: Each spec merged with the session (``effective.effective``), once per spec: see :meth:`asked`.
        self._asked: dict[ClusterSpec, AskedConfig] = {}
        #: Called with each cluster :meth:`stop` stops (the fixtures make pytest forget a cached ``pd_cluster``).
        self.on_stop: list[Callable[[PDCluster], None]] = []
        self.report = reporter or (lambda msg: log.info("%s", msg))
        self.launcher = ClusterLauncher(settings, self.report)
        self.run_token = self.launcher.run_token
        self._running: dict[ClusterSpec, LaunchedCluster] = {}
        self._failed: dict[ClusterSpec, BaseException] = {}
        #: Servers that died under a test, one per cluster (health.py), for the end-of-run summary.
        self.deaths: list[ServerDied] = []
        self._lock = threading.RLock()
        self._counter = 0
        #: ``--pd-proxy-port``: the proxy of these specs listens on the given port (leased like any other).
        self.proxy_ports: dict[ClusterSpec, int] = {}
        #: ``--pd-reuse``: keep clusters for the next run and attach to kept ones (reuse/); None: off.
        self.reuser = reuser
        #: Specs someone other than the fixtures asked for (see :meth:`get`): never stopped before the end.
        self.pinned: set[ClusterSpec] = set()
        #: What changed since pytest configured (``settings.env_drift``), checked at every start (start_env.py).
        self.env_drift = env_drift
        #: The process whose clusters these are: the only one that starts or stops them (common/owner.py).
        self.owner = Owner()

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
            # Neither refusal is remembered as the spec's failure: the parent may still start it, and the environment
            # may be put back (a monkeypatch undone).
            self.owner.refuse(f"start cluster {spec.name}")
            environ = start_environ(self.env_drift, own_servers=True)
            try:
                running = self._find_or_start(spec, environ)
            except ClusterUnavailable:
                raise
            except Exception as exc:
                # Remembered so every later test that needs this spec fails at once instead of restarting it.
                # (launch() already cleaned up, for BaseExceptions such as pytest-timeout's too.)
                self._failed[spec] = exc
                raise
            self._running[spec] = running
            return running.cluster

    @property
    def inventory(self) -> Inventory:
        """The platform and the GPUs this process sees (the settings')."""
        return self.settings.inventory

    @property
    def default_engine(self) -> str:
        """The engine of a spec that names none (``--pd-engine``, resolved)."""
        return self.settings.default_engine

    def asked(self, spec: ClusterSpec) -> AskedConfig:
        """``spec`` merged with the session (``effective.effective``): computed at its first start (or check) and
        kept, as both inputs are frozen; the acceptance check, a kept cluster's check and the start all use it.

        :raises OwnedFlagError, ClusterSpecError: the merge's refusals (not kept: raised again at each ask).
        """
        asked = self._asked.get(spec)
        if asked is None:
            asked = self._asked[spec] = effective(spec, self.settings.defaults)
        return asked

    def attached(self, spec: ClusterSpec) -> PDCluster:
        """Attach mode: the servers at ``settings.prefill_urls`` / ``settings.decode_urls`` (started by someone else).

        Starts no server and leases no GPU and no server port; the given proxy (``settings.proxy_url``) is
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
                self.owner.refuse("attach to the deployment and start its proxy")
                environ = start_environ(self.env_drift, own_servers=False)
                try:
                    self._running[key] = start_attached(self.settings, self.launcher, self.asked(key), environ)
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
        """Start the watchdog (or the guard) again if it died while clusters run (both sweep by run token); not in a
        forked child (they are the parent's)."""
        if not self.owner.here:
            return
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

    def stop(self, spec: ClusterSpec, why: str = "pd_cluster_factory.stop") -> PDCluster | None:
        """Stop one cluster (no-op if it is not running); returns the stopped cluster. Every ``on_stop`` listener
        hears of it, so whoever handed it out forgets it (a later ``get`` of the same spec starts a fresh one):
        the one rule for both doors, an explicit stop and making room for another spec. A no-op in a forked child
        (common/owner.py)."""
        if not self.owner.here:
            return None
        with self._lock:
            running = self._running.pop(spec, None)
        if running is None:
            return None
        running.cluster.health.stopped = ClusterStopped(spec.name, why)
        for listener in self.on_stop:
            listener(running.cluster)
        if self.reuser is None or not self.reuser.stop(running):  # a kept one: its keeper stops it
            self._teardown(running)
        return running.cluster

    def stop_all(self) -> None:
        """Stop every cluster (a reuser keeps or hands back what it can), then the watchdog. Safe to call twice; a
        no-op in a forked child, whose fixtures and ``pytest_unconfigure`` call it too (common/owner.py)."""
        if not self.owner.here:
            return
        with self._lock:
            items = list(self._running.values())
            self._running.clear()
        self.deaths += [r.cluster.health.died for r in items if r.cluster.health.died is not None]
        for running in self.reuser.hand_over(items, self.launcher) if self.reuser is not None else items:
            self.launcher.teardown(running)
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
        if self.settings.model is not None:
            return self.settings.model
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
            self.stop(victim.cluster.spec, why="its GPUs were needed for another spec")

    def check_accepted(self, spec: ClusterSpec) -> None:
        """Refuse ``spec`` before anything starts, builds or is leased when vLLM would refuse it or die at its start
        (pytest_pdserve/rules/): a configuration error, not a start to wait for.

        :raises VllmRefuses: with vLLM's reason.
        """
        self.launcher.check_accepted(spec, self.engine_for(spec), self.asked(spec))

    def _find_or_start(self, spec: ClusterSpec, environ: Mapping[str, str]) -> LaunchedCluster:
        """A kept cluster for ``spec`` when reusing (the reuser says why not), else a fresh one; both judged by, and
        a fresh one started with, the one ``environ`` (start_env.py)."""
        self.check_accepted(spec)  # before the model is built (tiny_model.py) or a kept cluster is claimed
        if self.reuser is not None:
            setup = self.engine_for(spec)
            model = self._resolve_model(spec, setup)
            placement = self._placement(spec)
            found = self.reuser.find(spec, setup, model, self.asked(spec), placement, self.launcher, environ)
            if found is not None:
                return found
        return self._start(spec, environ)

    def _placement(self, spec: ClusterSpec) -> dict[str, object]:
        """Where a cluster's servers run, as far as settings decide it (part of its reuse fingerprint)."""
        return {
            "gpus": [g.uuid or str(g.index) for g in self.inventory.gpus], "platform": self.inventory.platform,
            "prefill_gpu_ids": self.settings.prefill_gpu_ids, "decode_gpu_ids": self.settings.decode_gpu_ids,
            "share_gpus": self.settings.share_gpus, "proxy_port": self.proxy_ports.get(spec),
        }  # fmt: skip

    def _start(self, spec: ClusterSpec, environ: Mapping[str, str]) -> LaunchedCluster:
        self._counter += 1
        setup = self.engine_for(spec)
        return self.launcher.launch(
            spec, f"{spec.name}-{self._counter}", setup, self._resolve_model(spec, setup), self.asked(spec),
            make_room=self._make_room, environ=environ, proxy_port=self.proxy_ports.get(spec),
        )  # fmt: skip

    # ------------------------------------------------------------------ stop

    def _teardown(self, running: LaunchedCluster) -> None:
        if running.cluster.health.died is not None:
            self.deaths.append(running.cluster.health.died)  # for the terminal summary
        self.launcher.teardown(running)
