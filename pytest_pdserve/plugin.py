"""pytest11 entry point for pytest-pdserve: hooks only.

Imports stay light (stdlib + pytest + our pytest-free modules): loading the plugin imports none of httpx,
prometheus_client, starlette, uvicorn, torch or vllm (tests/project/test_imports.py holds it); the cluster machinery
loads when a test first needs a cluster.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from collections.abc import Generator
from typing import Any

import pytest

from pytest_pdserve.common import child_env
from pytest_pdserve.common.redaction import redact
from pytest_pdserve.config.setting_table import remedy
from pytest_pdserve.config.settings import PDSERVE_CONFIG, add_options, refuse_moved_values, resolve, settings_origin
from pytest_pdserve.engines.vllm_checkout import confcutdir_for
from pytest_pdserve.errors import PDServeError
from pytest_pdserve.glue import export_env, kv_moved, last_user, logs, worker_verdict

# the timeout hooks only observe pytest-timeout (optional hooks)
from pytest_pdserve.glue.fixtures import (
    CURRENT_ITEM,
    MANAGER,
    end_faults,
    ensure_watchdog,
    fail_if_cluster_died,
    get_manager,
    pd_cache_salt,
    pd_cluster,
    pd_cluster_factory,
    run_log_name,
    salted_test,
    stop_manager,
    stop_unused_clusters,
)
from pytest_pdserve.glue.markers import apply_skips, register_markers
from pytest_pdserve.glue.session_engine import bind as bind_session_engine
from pytest_pdserve.glue.session_engine import header_lines as session_engine_header
from pytest_pdserve.glue.session_engine import pd_engine
from pytest_pdserve.glue.session_engine import unbind as unbind_session_engine
from pytest_pdserve.glue.session_inventory import get_inventory, start_inventory_detection
from pytest_pdserve.glue.timeout_pause import pytest_timeout_cancel_timer, pytest_timeout_set_timer


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    """Register the ``pdserve`` option group and ini keys; refuse the spellings of values that moved.

    This runs before argparse parses the arguments (whose own error for ``--pd-reuse=MODE`` names no new
    spelling), so every place pytest takes arguments from is looked at here, in pytest's order.
    """
    add_options(parser)
    config = pluginmanager.get_plugin("pytestconfig")
    if not isinstance(config, pytest.Config):
        return
    with contextlib.suppress(ValueError):  # unbalanced quotes: pytest's own parse says so
        refuse_moved_values(shlex.split(os.environ.get("PYTEST_ADDOPTS", "")), "from PYTEST_ADDOPTS")
    ini_addopts: Any = []
    ini = None
    with contextlib.suppress(AttributeError, ValueError):  # registered before pytest read its ini: no addopts yet
        ini = config.inipath
        ini_addopts = config.getini("addopts") if ini is not None else []
    refuse_moved_values([str(a) for a in ini_addopts], f"from addopts in {ini}")
    refuse_moved_values([str(a) for a in config.invocation_params.args], "on the command line")


_CHECKOUT_NOTE = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    """Inside a vLLM checkout without torch/vllm: keep pytest from loading vLLM's tests/conftest.py."""
    given = early_config.invocation_params.args
    explicit = any(a == "--noconftest" or a.split("=", 1)[0] == "--confcutdir" for a in given)
    found = confcutdir_for(args, early_config.invocation_params.dir, explicit)
    if found is None:
        return
    target, message = found
    if explicit:
        # Loading vLLM's conftest may fail before any report header: say it now, on stderr.
        sys.stderr.write(message + "\n")
        return
    early_config.known_args_namespace.confcutdir = str(target)
    early_config.stash[_CHECKOUT_NOTE] = message


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Register markers, resolve the settings (usage error on bad input), register the reuse plugin when
    --pd-reuse is given, start GPU detection."""
    register_markers(config)
    child_env.enter_session(config.invocation_params.dir)  # where servers start, whatever a test chdir's to
    if config.getoption("help", False):
        return  # `pytest --help` must work even when a setting is bad
    cfg = config.stash[PDSERVE_CONFIG] = resolve(config)
    if cfg.reuse:  # its own plugin, loaded only when asked for (as pytest's cacheprovider registers LFPlugin)
        # Here, not at the top: a run without --pd-reuse (the default) never imports reuse/
        # (tests/reuse/test_reuse_layout.py).
        from pytest_pdserve.reuse import PLUGIN_NAME
        from pytest_pdserve.reuse.plugin import ReusePlugin

        try:
            reuse = ReusePlugin(cfg, os.environ)
        except PDServeError as exc:  # a reuse dir that is not ours: before any test, like every bad setting
            raise pytest.UsageError(
                f"pdserve: --pd-reuse: {exc} (reuse_dir from {cfg.source_of('reuse_dir')}; set {remedy('reuse_dir')})"
            ) from None
        config.pluginmanager.register(reuse, PLUGIN_NAME)
    export_env.session_preset_name(config)  # --pd-preset auto that finds nothing: a usage error, now
    start_inventory_detection(config)
    bind_session_engine(config)  # pytest_pdserve.session_engine() answers for this session from now on


def pytest_sessionstart(session: pytest.Session) -> None:
    """``--pd-export-env``: start the session cluster before collection and export its addresses."""
    if PDSERVE_CONFIG in session.config.stash:
        export_env.start(session.config, get_manager)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Engine / model / backend / extra args, then platform, inventory and log dir; attach mode adds the URLs first."""
    cfg = config.stash[PDSERVE_CONFIG]
    extra = shlex.join(cfg.vllm_serve_extra_args) if cfg.vllm_serve_extra_args else "none"
    if cfg.attach_mode:
        # No engine runs here: `engine sim (auto: ...)` would name one nothing starts. Say what we attach to; the
        # engine, backend and extra args are the deployment's own (the ready line shows what the servers report).
        proxy = cfg.proxy_url or "built-in (started here)"
        lines = [
            f"pdserve: attached (no servers started, no GPUs leased): prefill {' '.join(cfg.prefill_urls) or 'none'}; "
            f"decode {' '.join(cfg.decode_urls) or 'none'}; proxy {proxy}",
            f"pdserve: engine none started (the attached servers' own), model {cfg.model or 'as the servers serve'}",
        ]
    else:
        lines = [
            f"pdserve: engine {cfg.resolved_engine} ({cfg.engine_reason}), "
            f"model {cfg.model or 'engine default'}, attention backend {cfg.attention_backend or 'auto'}, "
            f"extra args {extra}"
        ]
    log_dir = str(cfg.log_dir) if cfg.log_dir is not None else "under basetemp"
    lines.append(f"pdserve: inventory {get_inventory(config).describe()}; log dir {log_dir}")
    if cfg.log_dir is not None and not export_env.is_xdist_controller(config):
        lines.append(f"pdserve: this run's logs: {cfg.log_dir / run_log_name(config)}")
    given = settings_origin(cfg)
    if given:
        lines.append(f"pdserve: settings given: {given}")
    lines += export_env.header_lines(config)
    lines += session_engine_header(config)
    if _CHECKOUT_NOTE in config.stash:
        lines.append(config.stash[_CHECKOUT_NOTE])
    return [redact(line) for line in lines]  # URL passwords, the API key


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """``--pd-export-env``: a vLLM module that cannot import openai & co. names the extra that installs them
    (changed here, before any ``pytest_collectreport`` hook, so xdist workers send the same text). A collection
    error's text is redacted too (a module that printed an exported secret at import), and a bad ``ClusterSpec`` at
    module level shows its message and the module's line, not the plugin's source."""
    report = yield
    if report.failed:
        # Lazy: only a failed collection needs it (a passing one never loads it; see pytest_runtest_makereport).
        from pytest_pdserve.glue import start_failure

        start_failure.rewrite_collect_report(report)
    export_env.name_missing_extra(collector.config, report)
    logs.redact_report(report)
    return report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip items whose ``cuda``/``rocm``/``gpus``/``distributed`` markers cannot be met."""
    apply_skips(config, items)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    """Remember the running test (to pause pytest-timeout while a cluster starts) and where logs end;
    after its fixtures, fail it at once if a cluster it got died under an earlier test."""
    item.config.stash[CURRENT_ITEM] = item
    ensure_watchdog(item.config)
    logs.record_offsets(item)
    yield
    fail_if_cluster_died(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """Once the test's fixtures are torn down: end the faults it left (a paused server resumed, a killed one's cluster
    stopped), then stop each cluster no remaining test uses (glue/last_user.py). Before them: the KV the test's module
    moved (the session's last teardown stops the clusters, the exported one included)."""
    kv_moved.module_boundary(item.config, item, nextitem, starting=False)
    try:
        return (yield)
    finally:
        end_faults(item)
        stop_unused_clusters(item)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: pytest.FixtureRequest) -> Generator[None, object, object]:
    """While a fixture's code runs, it is who asks for any cluster the factory hands out (glue/last_user.py)."""
    return (yield from last_user.fixture_setup(fixturedef, request))


def pytest_collection_finish(session: pytest.Session) -> None:
    """The items in the order they run: what "the remaining tests" are (glue/last_user.py)."""
    last_user.collection_finished(session)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A start error as its message alone; what each server and the proxy logged during a failed test as report
    sections; passed modules noted for ``--pd-require-kv-transfer``."""
    # Lazy: every module loaded costs each run; this one is needed only once a test runs: a
    # collection (--collect-only, an IDE's test discovery, the xdist controller) never loads it.
    from pytest_pdserve.glue import start_failure

    start_failure.report_as_message(call)
    report = yield
    logs.attach_sections(item, report)
    kv_moved.test_passed(item.config, report)
    logs.redact_report(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    """The test's cache salt on the plugin's clients (fixtures.salted_test); with ``--pd-export-env``: the KV each test
    module moved from prefill to decode (kv_moved.module_boundary)."""
    kv_moved.module_boundary(item.config, item, nextitem, starting=True)
    try:
        with salted_test(item):
            return (yield)
    finally:
        kv_moved.module_boundary(item.config, item, nextitem, starting=False)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """``--pd-require-kv-transfer`` (on under ``--pd-preset``): a module that passed without moving KV from prefill
    to decode fails the session (the terminal summary names it)."""
    config = session.config
    if PDSERVE_CONFIG not in config.stash:
        return
    vacuous = kv_moved.require_kv_transfer(config) and bool(kv_moved.vacuous_modules(config))
    # An xdist worker's summary and exit status reach no one: its controller prints them and ends the run with it.
    worker_verdict.send(config, lambda: [*export_env.summary_lines(config), *kv_moved.module_lines(config)], vacuous)
    ended = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
    if session.exitstatus in ended and vacuous:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    relayed = worker_verdict.exit_status(config)  # the workers' (xdist's controller): a usage error over a failure
    if relayed and session.exitstatus in (*ended, pytest.ExitCode.TESTS_FAILED):
        session.exitstatus = pytest.ExitCode(max(relayed, 1 if session.exitstatus else 0))


def pytest_collection(session: pytest.Session) -> bool | None:
    """An xdist worker whose session cluster did not start imports no module and collects nothing (after xdist's
    own hook, which announces the collection; glue/worker_verdict.py)."""
    if worker_verdict.stopped(session.config) is None:
        return None
    session.items = []
    session.testscollected = 0
    session.config.hook.pytest_collection_finish(session=session)
    return True


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """xdist's controller: keep what a worker's session cluster concluded (glue/worker_verdict.py)."""
    worker_verdict.receive(node.config, node)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Say which cluster died under the tests, once, at the end (each failing test has the full reason); with
    ``--pd-export-env``, what the session cluster's caches did (a vacuous pass shows hits 0)."""
    manager = config.stash.get(MANAGER, None)
    for death in manager.deaths if manager is not None else ():
        terminalreporter.write_line(redact(f"pdserve: {death.summary()}"), red=True, bold=True)
    for line in export_env.summary_lines(config):
        terminalreporter.write_line(redact(line))
    for line in kv_moved.module_lines(config):
        terminalreporter.write_line(redact(line), red="no KV moved" in line and kv_moved.require_kv_transfer(config))
    for line in worker_verdict.lines(config):
        terminalreporter.write_line(line, red=worker_verdict.exit_status(config) != 0)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop every cluster this process started, even if the session fixture never finalised."""
    stop_manager(config)
    export_env.restore(config)
    unbind_session_engine(config)
    child_env.leave_session(config.invocation_params.dir)


__all__ = [
    "pd_cache_salt",
    "pd_cluster",
    "pd_cluster_factory",
    "pd_engine",
    "pytest_timeout_cancel_timer",
    "pytest_timeout_set_timer",
]
