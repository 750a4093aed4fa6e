"""pytest11 entry point for pytest-pdserve: hooks only.

Imports stay light (stdlib + pytest + our pytest-free modules): loading the plugin imports none of httpx,
prometheus_client, starlette, uvicorn, torch or vllm (tests/project/test_imports.py holds it); the cluster machinery
loads when a test first needs a cluster.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Generator
from typing import Any

import pytest

from pytest_pdserve.common import child_env
from pytest_pdserve.common.redaction import redact
from pytest_pdserve.config.setting_table import remedy
from pytest_pdserve.config.settings import PDSERVE_CONFIG, add_options, resolve, settings_origin
from pytest_pdserve.engines.vllm_checkout import confcutdir_for
from pytest_pdserve.errors import PDServeError
from pytest_pdserve.glue import last_user, logs, worker_verdict

# the timeout hooks only observe pytest-timeout (optional hooks)
from pytest_pdserve.glue.fixtures import (
    end_faults,
    ensure_watchdog,
    fail_if_cluster_died,
    get_manager,
    pd_cache_salt,
    pd_cluster,
    pd_cluster_factory,
    run_log_name,
    salted_test,
    session_of,
    stop_manager,
    stop_unused_clusters,
)
from pytest_pdserve.glue.markers import apply_skips, register_markers
from pytest_pdserve.glue.session_engine import bind as bind_session_engine
from pytest_pdserve.glue.session_engine import header_lines as session_engine_header
from pytest_pdserve.glue.session_engine import pd_engine
from pytest_pdserve.glue.session_engine import unbind as unbind_session_engine
from pytest_pdserve.glue.session_inventory import get_inventory, start_inventory_detection
from pytest_pdserve.glue.session_spec import is_xdist_controller, session_preset_name
from pytest_pdserve.glue.timeout_pause import pytest_timeout_cancel_timer, pytest_timeout_set_timer


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register the ``pdserve`` option group and ini keys."""
    add_options(parser)


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
    """Register markers, resolve the settings (usage error on bad input), register the plugin of each feature that is
    on (reuse/plugin.py for --pd-reuse, glue/export_env.py for --pd-export-env, glue/worker_verdict.py under
    xdist), start GPU detection."""
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
    if cfg.export_env:  # its own plugin too, registered only when on
        # Here, not at the top: a run without --pd-export-env (the default) never imports export_env.py.
        from pytest_pdserve.glue.export_env import PLUGIN_NAME as EXPORT_ENV
        from pytest_pdserve.glue.export_env import ExportEnvPlugin

        config.pluginmanager.register(ExportEnvPlugin(cfg, get_manager), EXPORT_ENV)
    worker_verdict.register(config)  # xdist: a worker's verdict and reason to stop reach the controller
    session_preset_name(config)  # --pd-preset auto that finds nothing: a usage error, now
    start_inventory_detection(config)
    bind_session_engine(config)  # pytest_pdserve.session_engine() answers for this session from now on


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
    if cfg.log_dir is not None and not is_xdist_controller(config):
        lines.append(f"pdserve: this run's logs: {cfg.log_dir / run_log_name(config)}")
    given = settings_origin(cfg)
    if given:
        lines.append(f"pdserve: settings given: {given}")
    lines += session_engine_header(config)
    if _CHECKOUT_NOTE in config.stash:
        lines.append(config.stash[_CHECKOUT_NOTE])
    return [redact(line) for line in lines]  # URL passwords, the API key


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """A collection error's text redacted (a module that printed an exported secret at import), and a bad
    ``ClusterSpec`` at module level shown as its message and the module's line, not the plugin's source."""
    report = yield
    if report.failed:
        # Lazy: only a failed collection needs it (a passing one never loads it; see pytest_runtest_makereport).
        from pytest_pdserve.glue import start_failure

        start_failure.rewrite_collect_report(report)
    logs.redact_report(report)
    return report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip items whose ``cuda``/``rocm``/``gpus``/``distributed`` markers cannot be met."""
    apply_skips(config, items)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    """Remember the running test (to pause pytest-timeout while a cluster starts) and where logs end;
    after its fixtures, fail it at once if a cluster it got died under an earlier test."""
    session_of(item.config).current_item = item
    ensure_watchdog(item.config)
    logs.record_offsets(item)
    yield
    fail_if_cluster_died(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    """Once the test's fixtures are torn down: end the faults it left (a paused server resumed, a killed one's cluster
    stopped), then stop each cluster no remaining test uses (glue/last_user.py)."""
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
    sections."""
    # Lazy: every module loaded costs each run; this one is needed only once a test runs: a
    # collection (--collect-only, an IDE's test discovery, the xdist controller) never loads it.
    from pytest_pdserve.glue import start_failure

    start_failure.report_as_message(call)
    report = yield
    logs.attach_sections(item, report)
    logs.redact_report(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    """The test's cache salt on the plugin's clients (fixtures.salted_test)."""
    with salted_test(item):
        return (yield)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Say which cluster died under the tests, once, at the end (each failing test has the full reason)."""
    manager = session_of(config).manager
    for death in manager.deaths if manager is not None else ():
        terminalreporter.write_line(redact(f"pdserve: {death.summary()}"), red=True, bold=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop every cluster this process started, even if the session fixture never finalised."""
    stop_manager(config)
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
