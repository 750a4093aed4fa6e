"""The fixtures: ``pd_cluster`` and ``pd_cluster_factory`` (both session-scoped).

One `ClusterManager` per pytest process (per xdist worker): each worker leases its own GPUs and ports,
so workers never share a GPU, and the manager shares a running cluster between every test that asks
for an equal `ClusterSpec`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pytest

from pytest_pdserve.common import created
from pytest_pdserve.common.redaction import redact
from pytest_pdserve.config.setting_table import SETTINGS_BY_NAME
from pytest_pdserve.config.settings import PDSERVE_CONFIG, PDServeConfig, env_drift
from pytest_pdserve.errors import AttachError, ClusterUnavailable, LeaseTimeout, PathError
from pytest_pdserve.glue import last_user
from pytest_pdserve.glue.session_inventory import get_inventory
from pytest_pdserve.glue.timeout_pause import timeout_paused
from pytest_pdserve.machine.paths import LOG_DIR_MODE, ensure_dir

log = logging.getLogger(__name__)

# Loading the plugin imports none of httpx, prometheus_client, starlette (tests/project/test_imports.py holds it): the
# modules below import them, so this one imports them only for typing, and at run time where a cluster is needed.
if TYPE_CHECKING:
    from pytest_pdserve.cluster import PDCluster
    from pytest_pdserve.reuse.plugin import ReusePlugin
    from pytest_pdserve.running.manager import ClusterManager
    from pytest_pdserve.spec import ClusterSpec


class ClusterFactory(Protocol):
    """``pd_cluster_factory(spec=None, **spec_fields) -> PDCluster``; ``.stop(spec)`` frees one early."""

    def __call__(self, spec: ClusterSpec | None = None, /, **fields: Any) -> PDCluster: ...

    def stop(self, spec: ClusterSpec) -> None: ...


class PDSession:
    """What pdserve keeps for one pytest process between its hooks and fixtures, in one place (``session_of``): the
    cluster manager (built at the first cluster), this run's log directory and name, the running test, whether the
    factory exists, the session's salt token and whether the clients' options are set."""

    def __init__(self) -> None:
        self.manager: ClusterManager | None = None
        #: This run's own name under ``--pd-log-dir`` (:func:`run_log_name`) and its log directory (:func:`log_dir`).
        self.run_name: str | None = None
        self.run_logs: Path | None = None
        #: The running test (pytest-timeout's clock is paused for it while a cluster starts).
        self.current_item: pytest.Item | None = None
        #: ``pd_cluster_factory``'s request, once the factory exists (its manager listener with it).
        self.factory_request: pytest.FixtureRequest | None = None
        #: Per session: reruns never reuse a warm prefix cache.
        self.salt_token = os.urandom(8).hex()
        self.clients_configured = False


_SESSION = pytest.StashKey[PDSession]()


def session_of(config: pytest.Config) -> PDSession:
    """This pytest process's :class:`PDSession` (made at the first ask)."""
    return config.stash.setdefault(_SESSION, PDSession())


def worker_id(config: pytest.Config) -> str:
    """xdist worker id (``gw0``) or ``master``."""
    workerinput = getattr(config, "workerinput", None)
    return str(workerinput["workerid"]) if workerinput else "master"


def run_log_name(config: pytest.Config) -> str:
    """This run's own directory under ``--pd-log-dir``: two runs given the same log dir never share a file (their
    reports would carry each other's log tails). ``<time>-<pid>-<random>``, made by this run (``mkdir``, another
    name if taken: :func:`pytest_pdserve.common.created.make_unique_dir`), so two runs with the same pid in the same
    second (pytest as PID 1 in two containers) get two; xdist workers share their run's, by its id."""
    session = session_of(config)
    if session.run_name is None:
        workerinput = getattr(config, "workerinput", None)
        if workerinput and workerinput.get("testrunuid"):
            session.run_name = f"xdist-{workerinput['testrunuid']}"
        else:
            session.run_name = f"{created.run_stem()}-{os.urandom(4).hex()}"
    return session.run_name


def _new_run_dir(config: pytest.Config, parent: Path) -> Path:
    """Make this run's (this worker's) own log directory under ``parent`` (a new one, marked as pdserve's)."""
    worker = worker_id(config)
    if worker != "master":  # xdist-<run id>: the run's, made by whichever worker comes first; then gwN, this one's
        parent = ensure_dir(parent / run_log_name(config), LOG_DIR_MODE)
    name = run_log_name(config) if worker == "master" else worker
    try:
        ensure_dir(parent, LOG_DIR_MODE)
        try:
            return created.make_dir(parent / name, LOG_DIR_MODE, created.RUN_LOGS)
        except FileExistsError:  # taken (by another run, in another container?): never shared, another name
            path = created.make_unique_dir(parent, name if worker != "master" else created.run_stem(), LOG_DIR_MODE,
                                         created.RUN_LOGS)  # fmt: skip
    except OSError as exc:
        raise PathError(f"cannot create this run's log directory in {parent}: {exc.strerror or exc}") from None
    if worker == "master":
        session_of(config).run_name = path.name
    return path


def log_dir(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where server logs go: ``--pd-log-dir`` (kept for CI artifacts; in a directory of this run's own, see
    :func:`run_log_name`) or pytest's basetemp. The same path every call (created again if it was removed).

    Directories created here are private (0700: logs carry prompts) and marked as pdserve's (what pdserve creates in
    them may be removed by pdserve, nothing else: :mod:`pytest_pdserve.common.created`); an existing one keeps its mode.
    """
    session = session_of(config)
    if session.run_logs is None:
        cfg = config.stash[PDSERVE_CONFIG]
        if cfg.log_dir is not None:
            session.run_logs = _new_run_dir(config, cfg.log_dir)
        else:
            if (reuse := reuse_plugin(config)) is not None and (kept_logs := reuse.run_log_dir()) is not None:
                base = kept_logs
            else:
                base = tmp_path_factory.getbasetemp() / "pdserve-logs"
            session.run_logs = base / worker_id(config) if worker_id(config) != "master" else base
    return ensure_dir(session.run_logs, LOG_DIR_MODE, mark=created.RUN_LOGS)


def reuse_plugin(config: pytest.Config) -> ReusePlugin | None:
    """The reuse plugin (`reuse/plugin.py`), registered by pytest_configure when --pd-reuse is given; None: not
    given."""
    # Lazy: every module loaded costs each run (assertion rewriting included); only a run which builds a cluster
    # manager needs this one.
    from pytest_pdserve.reuse import PLUGIN_NAME

    plugin: ReusePlugin | None = config.pluginmanager.get_plugin(PLUGIN_NAME)
    return plugin


def make_reporter(config: pytest.Config, session_log: Path) -> Callable[[str], None]:
    """Progress lines to the terminal (around pytest's capture) and to ``pdserve.log``."""
    # Lazy: every module loaded costs each run; a reporter exists only once a cluster manager is built.
    from pytest_pdserve.common.logfile import open_append

    terminal = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")

    refused: list[str] = []  # why pdserve.log is not written (said once, on the terminal)

    def report(message: str) -> None:
        message = redact(message)  # e.g. an attached URL's password in the ready line
        log.info("%s", message)
        lines = [message]
        try:  # open_append: a FIFO planted as pdserve.log must not hang the run, nor a link make us write elsewhere
            with os.fdopen(open_append(session_log), "a", encoding="utf-8") as fh:
                fh.write(message + "\n")
        except OSError as exc:  # the session's own log: the run goes on without it
            if not refused:
                refused.append(exc.strerror or str(exc))
                lines.insert(0, f"pdserve: not writing the session log {session_log}: {refused[0]}")
        if terminal is None:
            return
        ctx = capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext()
        with ctx:
            for line in lines:
                terminal.write_line(line)

    return report


def writes_to_terminal(config: pytest.Config) -> bool:
    """Whether pytest's output goes to a terminal (a person watching) rather than to a log or a pipe (CI)."""
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    return bool(getattr(terminal, "isatty", False))  # a bool before pytest 9, a callable bool since


def build_manager(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> ClusterManager:
    """The session's cluster manager, built from the resolved settings (once per process)."""
    # Lazy: manager.py imports the launcher, the cluster objects, httpx and prometheus_client, which only a run
    # that needs a cluster pays. Lazy too: commands.py and engine.py load spec, presets, owned_flags and packaging,
    # which loading the plugin for a run that starts no cluster must not pay.
    from pytest_pdserve.config.cluster_settings import ClusterSettings
    from pytest_pdserve.engines.engine import engine_setup
    from pytest_pdserve.running.manager import ClusterManager

    cfg: PDServeConfig = config.stash[PDSERVE_CONFIG]
    inventory = get_inventory(config)
    logs = log_dir(config, tmp_path_factory)
    _configure_clients(config)
    settings = ClusterSettings.for_config(cfg, inventory, log_dir=logs, terminal=writes_to_terminal(config))
    reuse = reuse_plugin(config)
    manager = ClusterManager(
        settings,
        engine_setup=lambda name: engine_setup(
            name, vllm_argv=cfg.vllm_argv, vllm_executable=cfg.vllm_executable, platform=inventory.platform
        ),
        reporter=make_reporter(config, logs / "pdserve.log"), reuser=reuse.reuser() if reuse is not None else None,
        env_drift=lambda environ: env_drift(cfg, environ),  # a cluster's environment is read at its start
    )  # fmt: skip
    # A restart (ServerHandle.restart) waits like a start, bounded by --pd-startup-timeout: not billed to the test.
    manager.launcher.restart_clock = lambda: timeout_paused(session_of(config).current_item)
    return manager


def get_manager(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> ClusterManager:
    """The process-wide manager, created on first use and stopped at unconfigure."""
    session = session_of(config)
    if session.manager is None:
        # The build (its imports, the GPU inventory's probes) is the first cluster start's: seconds on a loaded
        # machine, not billed to the timer of whichever test asked first either.
        with timeout_paused(session.current_item):
            session.manager = build_manager(config, tmp_path_factory)
    return session.manager


def ensure_watchdog(config: pytest.Config) -> None:
    """Before each test: a watchdog that died (killed, OOM) is replaced while our clusters run."""
    manager = session_of(config).manager
    if manager is not None:
        manager.ensure_watchdog()


def stop_manager(config: pytest.Config) -> None:
    """Stop every cluster of this process (pytest_unconfigure; also the session fixture's teardown)."""
    manager = session_of(config).manager
    if manager is not None:
        manager.stop_all()


def _get_cluster(request: pytest.FixtureRequest, spec: ClusterSpec) -> PDCluster:
    config = request.config
    cfg = config.stash[PDSERVE_CONFIG]
    manager = get_manager(config, request.getfixturevalue("tmp_path_factory"))
    skip_reason = fail_reason = None
    item = session_of(config).current_item
    try:
        with timeout_paused(item):
            if cfg.attach_mode:
                cluster = manager.attached(spec)
            else:
                manager.check_accepted(spec)  # a spec vLLM refuses stops no other cluster to make room for it
                last_user.make_cpu_room(item, manager, spec)
                asker = last_user.current_asker(config, item)
                cluster = manager.get(spec, pin=False)
                last_user.note(config, manager, spec, asker, item)
        if cluster.health.died is None:
            return cluster
        # A server died under an earlier test: fail at once with that reason instead of timing out again.
        fail_reason = str(cluster.health.died)
    except ClusterUnavailable as exc:
        skip_reason = str(exc)
    except AttachError as exc:
        # The message names every URL that did not answer; pytest's traceback would only add noise.
        fail_reason = str(exc)
    except LeaseTimeout as exc:
        if cfg.gpu_wait != "skip":
            raise
        skip_reason = str(exc)
    # Outside the except blocks, so the outcome is not chained to the error ("During handling of ...").
    if skip_reason is not None:
        pytest.skip(skip_reason)
    pytest.fail(fail_reason or "unreachable", pytrace=False)


def stop_unused_clusters(item: pytest.Item) -> None:
    """After a test's teardown: stop the clusters no remaining test uses (glue/last_user.py)."""
    session = session_of(item.config)
    if session.factory_request is not None:  # the factory (and with it the manager's on_stop listener) exists
        with timeout_paused(item):  # bounded by --pd-shutdown-timeout, not billed to this test's timer
            last_user.stop_unused(item, session.manager)


def end_faults(item: pytest.Item) -> None:
    """After a test's teardown: no server it left down on purpose (``ServerHandle.pause``/``kill``) reaches the next
    test. A paused one is resumed; the cluster of any other (killed, or a restart that failed) is stopped, so its next
    user starts it afresh. Each is said in a progress line."""
    manager = session_of(item.config).manager
    if manager is None:
        return
    for cluster in manager.running():
        for server in cluster.servers:
            why = server.down
            if why is None:
                continue
            proc = server.process
            if proc is not None and proc.paused and proc.alive:
                server.resume()
                name = cluster.spec.name
                manager.report(f"pdserve: {server.name} of cluster {name}: resumed ({item.nodeid} left it paused)")
                continue
            why = f"{item.nodeid} left {server.name} down ({why})"
            manager.report(f"pdserve: stopping cluster {cluster.spec.name}: {why}")
            manager.stop(cluster.spec, why=why)
            break


def fail_if_cluster_died(item: pytest.Item) -> None:
    """Fail a test whose fixtures hold a cluster that died under an earlier test (session fixtures are cached,
    so this is checked per test, not when the fixture was made); the reason is the death's own message."""
    if session_of(item.config).manager is None:
        return  # no cluster was ever made in this process
    from pytest_pdserve.cluster import PDCluster  # lazy (httpx): loaded already, the manager imported it

    for value in getattr(item, "funcargs", {}).values():
        if isinstance(value, PDCluster) and value.health.died is not None:
            pytest.fail(str(value.health.died), pytrace=False)


class _Factory:
    """The object ``pd_cluster_factory`` yields: call it for a cluster, ``stop(spec)`` to free one early."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request
        self._listening = False

    def __call__(self, spec: ClusterSpec | None = None, /, **fields: Any) -> PDCluster:
        if spec is not None and fields:
            spec = spec.with_(**fields)
        elif spec is None:
            # Lazy: spec.py with presets and owned_flags is costly at import; the plugin loads this module
            # for every run, a cluster is asked for in few.
            from pytest_pdserve.spec import ClusterSpec

            spec = ClusterSpec(**fields)
        if not self._listening:
            # Whatever stops a cluster (this factory's stop, or the manager making room for another spec on the
            # GPUs it held), pytest must not hand the stopped one out again as the cached session `pd_cluster`.
            manager = get_manager(self._request.config, self._request.getfixturevalue("tmp_path_factory"))
            manager.on_stop.append(self._forget)
            self._listening = True
        return _get_cluster(self._request, spec)

    def _forget(self, stopped: PDCluster) -> None:
        forget_fixture_values(self._request, stopped)

    def stop(self, spec: ClusterSpec) -> None:
        """Stop the cluster for ``spec`` now (e.g. at the end of a module, to free GPUs or memory).

        The next request for it, ``pd_cluster`` included, starts a fresh one: a stopped cluster is never handed out.
        """
        manager = session_of(self._request.config).manager
        if manager is not None:
            manager.stop(spec)  # the manager's on_stop listener (above) makes pytest forget it


def forget_fixture_values(request: pytest.FixtureRequest, value: object) -> list[str]:
    """Make pytest run again, next time, every fixture that cached ``value``; returns their names.

    Not only ``pd_cluster``: a conftest fixture of any name that returns a factory cluster (vLLM's suites name
    theirs) is cached by pytest just the same, and handing its stopped cluster to the next test fails that test with
    "connection refused" (found under xdist with tests/conftest.py's ``real_pd_cluster``). pytest caches a fixture's
    value for its scope and has no public way to drop it, so this uses ``FixtureDef.finish`` (what pytest itself
    calls to tear a fixture down) through the fixture manager. Isolated here and tested
    (tests/glue/test_last_user.py, tests/promises/test_hostile_lifecycle.py): should pytest's internals change, it warns
    and the stopped cluster's own errors remain.
    """
    forgotten: list[str] = []
    try:
        manager: Any = request._fixturemanager
        every = getattr(manager, "_get_all_fixture_defs", None)  # newer pytest; older ones: a dict of lists
        defs = list(every()) if every is not None else [d for ds in manager._arg2fixturedefs.values() for d in ds]
        for fixturedef in defs:
            cached = fixturedef.cached_result
            if cached is not None and cached[0] is value:
                fixturedef.finish(request)  # a SubRequest at run time
                forgotten.append(fixturedef.argname)
    except Exception as exc:  # pytest internals moved: keep the stop, lose only the re-run
        log.warning("pdserve: could not make pytest forget a stopped cluster's fixture values: %r", exc)
    return forgotten


@pytest.fixture(scope="session")
def pd_cluster_factory(request: pytest.FixtureRequest) -> Iterator[ClusterFactory]:
    """Build or reuse a P/D cluster from a `ClusterSpec` (session-scoped).

    ``pd_cluster_factory(ClusterSpec(num_decode=2, decode_tp=2))`` or ``pd_cluster_factory(num_decode=2)``.
    Equal specs share one running cluster; a spec that needs GPUs another of our clusters holds stops
    that cluster first; ``pd_cluster_factory.stop(spec)`` stops one early. A cluster no remaining test uses is
    stopped after its last user (glue/last_user.py); everything else stops at session end.
    """
    session = session_of(request.config)
    session.factory_request = request
    yield _Factory(request)
    # The session's stop is bounded by --pd-shutdown-timeout, not by the timer of whichever test ran last.
    with timeout_paused(session.current_item):
        stop_manager(request.config)


@pytest.fixture(scope="session")
def pd_cluster(request: pytest.FixtureRequest) -> PDCluster:
    """A running 1 prefill x 1 decode NixlConnector cluster plus the P/D proxy (session-scoped).

    ``pd_cluster.client`` posts through the proxy; ``pd_cluster.prefill[0]`` / ``pd_cluster.decode[0]``
    reach each server (``.url``, ``.client``, ``.metrics()``, ``.log_path``). ``--pd-preset``,
    ``--pd-kv-connector-config`` and ``--pd-proxy-port`` shape it (the same cluster ``--pd-export-env`` exports).
    """
    # Lazy: only for this fixture (the session spec loads spec.py and presets when called, see _Factory).
    from pytest_pdserve.glue.session_spec import session_proxy_port, session_spec

    spec, preset = session_spec(request.config)
    port = session_proxy_port(request.config.stash[PDSERVE_CONFIG], preset)
    if port is not None:
        get_manager(request.config, request.getfixturevalue("tmp_path_factory")).proxy_ports.setdefault(spec, port)
    # Fetched, not a parameter: pytest resolves every parameter's fixture for each collected test that asks for
    # pd_cluster (most of a large collect-only's cost); fetched, it costs once.
    factory: ClusterFactory = request.getfixturevalue("pd_cluster_factory")
    return factory(spec)


def _configure_clients(config: pytest.Config) -> None:
    """The request timeout of every client the plugin hands out, and how its error says to raise it (once)."""
    # The options alone, not clients.py: that imports httpx, which neither collection nor a session whose tests
    # start no cluster should pay.
    from pytest_pdserve.common import client_options as clients

    session = session_of(config)
    if session.clients_configured:
        return
    session.clients_configured = True
    cfg = config.stash[PDSERVE_CONFIG]
    s = SETTINGS_BY_NAME["request_timeout"]
    clients.OPTIONS.request_timeout = cfg.request_timeout
    clients.OPTIONS.timeout_remedy = (
        f"; the limit ({cfg.request_timeout:g} s) came from {cfg.source_of('request_timeout')}:"
        f" raise it with {s.flag}, {s.env_var} or ini {s.ini_key}"
    )


#: This test's salt (``item.stash``), set around the test by :func:`salted_test`.
TEST_SALT = pytest.StashKey[str | None]()


@contextlib.contextmanager
def salted_test(item: pytest.Item) -> Iterator[None]:
    """Around each test (the plugin's ``pytest_runtest_protocol``): requests sent through the plugin's clients carry
    this test's vLLM ``cache_salt`` (``--pd-cache-salt=per-test``, the default) unless their body has one, so one
    test's prompts never warm the prefix cache for another; ``off``: none.

    A hook, not an autouse fixture: an autouse fixture joins the fixture closure of every collected test, which
    collection pays for each of them whether or not it ever uses a cluster.
    """
    config = item.config
    if PDSERVE_CONFIG not in config.stash:  # pytest --help & co.: no settings, no tests
        yield
        return
    # Not clients.py: a session whose tests start no cluster never imports httpx (common/client_options.py).
    from pytest_pdserve.common import client_options as clients

    _configure_clients(config)
    salt = None
    if config.stash[PDSERVE_CONFIG].cache_salt == "per-test":
        salt = clients.salt_for(item.nodeid, session_of(config).salt_token)
    item.stash[TEST_SALT] = salt
    with clients.salted(salt):
        yield


@pytest.fixture
def pd_cache_salt(request: pytest.FixtureRequest) -> str | None:
    """This test's vLLM ``cache_salt`` (``--pd-cache-salt=per-test``, the default), ``None`` with ``off``.

    The plugin's clients already send it (:func:`salted_test`); your own clients: ``extra_body={"cache_salt": ...}``.
    """
    salt: str | None = request.node.stash.get(TEST_SALT, None)
    return salt
