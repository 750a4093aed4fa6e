"""``--pd-export-env``: the session cluster, started before collection, described in environment variables.

vLLM's own P/D modules (``tests/v1/kv_connector/nixl_integration/test_*.py``) read ``PREFILL_PORT`` & co. at
import time, before any fixture exists. With ``--pd-export-env`` the plugin starts the session cluster (the
settings plus ``--pd-preset``: session_spec.py) in ``pytest_sessionstart``, through the same `ClusterManager` the
fixtures use (same start-up timeout, progress lines, watchdog and teardown at ``pytest_unconfigure``), and puts its
addresses into ``os.environ``; ``--pd-export-env-file=FILE`` also writes them as ``export`` lines.

One plugin object, :class:`ExportEnvPlugin`, registered by plugin.py's ``pytest_configure`` only when the option is
on (as pytest registers its last-failed plugin for ``--lf``): a run without it loads none of this module. Its hooks
are the whole feature: the start, the report header, the missing-extra hint on a module that cannot import, the KV
each module moved (kv_moved.py), ``--pd-require-kv-transfer``'s verdict and the terminal summary.

Under pytest-xdist every worker starts and exports its own cluster (workers import the modules, the
controller does not); the controller checks the preset and the export file before any worker starts, and starts
nothing. A worker never stops the run itself: its reason to stop, its verdict and its summary lines go to the
controller (worker_verdict.py).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib.metadata
import os
import re
import shlex
import urllib.parse
from collections.abc import Callable, Generator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pytest_pdserve.common.redaction import redact
from pytest_pdserve.config.settings import PDServeConfig
from pytest_pdserve.errors import ClusterSpecError, ClusterUnavailable, PDServeError
from pytest_pdserve.glue import kv_moved, worker_verdict
from pytest_pdserve.glue.session_spec import is_xdist_controller, session_proxy_port, session_spec

if TYPE_CHECKING:
    from pytest_pdserve.cluster import PDCluster
    from pytest_pdserve.metrics import MetricsSnapshot
    from pytest_pdserve.running.manager import ClusterManager
    from pytest_pdserve.spec import ClusterSpec

__all__ = ["PLUGIN_NAME", "VLLM_TESTS_EXTRA", "ExportEnvPlugin", "extra_modules", "variables"]

#: The name the plugin is registered under (``config.pluginmanager.get_plugin(PLUGIN_NAME)``).
PLUGIN_NAME = "pdserve-export-env"

#: ``fixtures.get_manager``: the session's cluster manager, built on first use.
GetManager = Callable[[pytest.Config, pytest.TempPathFactory], "ClusterManager"]


class Exported:
    """What ``--pd-export-env`` started and exported (held by :class:`ExportEnvPlugin`).

    Filled in two steps: described before the start (spec, preset, file), then what the started cluster exports."""

    def __init__(
        self, spec: ClusterSpec, *, notes: tuple[str, ...] = (), preset: str | None = None, file: Path | None = None
    ) -> None:
        self.spec = spec
        self.cluster: PDCluster | None = None
        self.variables: dict[str, str] = {}
        self.notes = notes
        self.file = file
        #: os.environ values before we exported (None: unset), restored at unconfigure.
        self.saved: dict[str, str | None] = {}
        self.baseline: dict[str, MetricsSnapshot] = {}
        #: The servers' metrics after the session's last test, before its teardown stopped them (kv_moved.py).
        self.final: dict[str, MetricsSnapshot] = {}
        self.preset = preset
        #: The preset's own variables (its script's), exported after the cluster's addresses.
        self.exports: dict[str, str] = {}
        #: ``--pd-proxy-port``, else the port the preset's module hard-codes; None: leased.
        self.proxy_port: int | None = None
        #: Per test module (its path as pytest shows it): KV moved into decode while it ran (tokens, NIXL bytes).
        self.moved: dict[str, tuple[float, float]] = {}
        #: The running module and its decode servers' metrics when it began.
        self.module_start: tuple[str, dict[str, MetricsSnapshot]] | None = None
        #: Modules with at least one passed test (only those must have moved KV).
        self.passed: set[str] = set()


#: pytest-pdserve's extra with what vLLM's own modules import (pyproject's [project.optional-dependencies] is the
#: one list; it is read back from the installed metadata).
VLLM_TESTS_EXTRA = "vllm-tests"
#: What the modules need that no extra of ours installs: test_accuracy.py runs lm_eval's gsm8k through the
#: "local-completions" API model, and lm_eval downloads the dataset when it runs.
_OUTSIDE_EXTRA = {"lm_eval": "pip install 'lm_eval[api]' (it also downloads the gsm8k dataset: network access)"}
#: How pytest reports a test module whose import failed for a missing module (its CollectError text).
#: A pattern, compiled (and cached by ``re``) at the first failed module of an exporting run, not when the plugin loads.
_NO_MODULE = r"ModuleNotFoundError: No module named '([\w.]+)'"


def variables(cluster: PDCluster, max_model_len: int | None, extra: Mapping[str, str]) -> dict[str, str]:
    """The variables vLLM's modules and scripts read, for one running cluster."""

    def host(url: str) -> str:
        return urllib.parse.urlsplit(url).hostname or ""

    p, d = cluster.prefill, cluster.decode
    out = {
        "PREFILL_HOST": host(p[0].url), "PREFILL_PORT": str(p[0].port),
        "DECODE_HOST": host(d[0].url), "DECODE_PORT": str(d[0].port),
        "PROXY_HOST": host(cluster.proxy.url), "PROXY_PORT": str(cluster.proxy.port),
        "PREFILL_HOSTS": ",".join(host(s.url) for s in p), "PREFILL_PORTS": ",".join(str(s.port) for s in p),
        "DECODE_HOSTS": ",".join(host(s.url) for s in d), "DECODE_PORTS": ",".join(str(s.port) for s in d),
        # test_accuracy.py / test_spec_decode_acceptance.py: TEST_MODEL; run_xpu_disagg / spec decode: the rest.
        "TEST_MODEL": cluster.model, "MODEL_NAME": cluster.model, "SERVER_HOST": host(d[0].url),
        "BLOCK_SIZE": str(cluster.block_size),
    }  # fmt: skip
    if max_model_len is not None:
        out["MAX_MODEL_LEN"] = str(max_model_len)
    out.update({k: v for k, v in extra.items() if k not in out})
    if extra.get("SLEEP_WAKE") == "1":
        out["SLEEP_WAKE_URLS"] = ",".join(s.url for s in (*p, *d))
    return out


#: The first line of every export file: a file without it is someone else's, never overwritten (a test module
#: named by mistake, a script).
FILE_HEADER = "# written by pytest-pdserve --pd-export-env\n"


def foreign_file(path: Path) -> str | None:
    """Why *path* must not be written as an export file (a link or other non-file, or a file pdserve did not
    write), or None."""
    # Lazy: every module loaded costs each run; logfile.py only for an export file.
    from pytest_pdserve.common.logfile import check_writable

    try:
        check_writable(path)  # the writer's own rule (logfile), asked before anything starts
    except OSError as exc:
        return f"cannot write the export file {path}: {exc.strerror}"
    try:
        with path.open("rb") as f:
            head = f.read(len(FILE_HEADER))
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if head and head != FILE_HEADER.encode():  # an empty file holds nothing to lose
        return "exists and was not written by pdserve (its first line is not the export header)"
    return None


def _export(exported: Exported) -> None:
    for key, value in exported.variables.items():
        exported.saved.setdefault(key, os.environ.get(key))
        os.environ[key] = value
    if exported.file is not None:
        exported.file.parent.mkdir(parents=True, exist_ok=True)
        # Asked again: the cluster took a while, and a file saved there meanwhile is not pdserve's either.
        problem = foreign_file(exported.file)
        if problem is not None:
            raise OSError(errno.EEXIST, f"{problem}; name a new file, or remove this one if it is yours")
        lines = [f"export {k}={shlex.quote(v)}" for k, v in exported.variables.items()]
        text = FILE_HEADER + "\n".join(lines) + "\n"
        # Lazy: see foreign_file (logfile.py only for an export file).
        from pytest_pdserve.common.logfile import write_replace

        # Replaced by rename, never written through: a link planted as FILE in a shared directory is refused.
        write_replace(exported.file, text.encode(), mode=0o644)


@functools.cache
def extra_modules(extra: str) -> frozenset[str]:
    """Import names of what pytest-pdserve's *extra* installs (empty where the package metadata is missing)."""
    # Lazy: packaging.requirements is slow to import; only a test module that failed to import asks.
    from packaging.requirements import Requirement

    try:
        lines = importlib.metadata.requires("pytest-pdserve") or []
    except importlib.metadata.PackageNotFoundError:
        return frozenset()
    names = set()
    for line in lines:
        req = Requirement(line)
        # Only this extra's lines: a platform marker (uvloop's) holds with or without the extra.
        if req.marker is not None and req.marker.evaluate({"extra": extra}) and not req.marker.evaluate({"extra": ""}):
            names.add(req.name.lower().replace("-", "_"))  # openai, regex, requests: import name = project name
    return frozenset(names)


def _start(config: pytest.Config, cfg: PDServeConfig, get_manager: GetManager, exported: Exported) -> None:
    """Start the session cluster and export it. A cluster that cannot start stops the run with one message
    (:func:`_stop_run`), before any module is imported; pytest_unconfigure still stops whatever was started."""
    where = cfg.source_of("export_env" if cfg.sources.get("export_env", "default") != "default" else "export_env_file")
    spec = exported.spec
    tmp_path_factory: pytest.TempPathFactory = getattr(config, "_tmp_path_factory")  # noqa: B009 - set by pytest
    manager = get_manager(config, tmp_path_factory)
    if exported.proxy_port is not None:
        manager.proxy_ports[spec] = exported.proxy_port
    failure = None
    try:
        cluster = manager.attached(spec) if cfg.attach_mode else manager.get(spec)
    except (ClusterUnavailable, PDServeError) as exc:
        failure = str(exc)
    if failure is not None:
        return _stop_run(config, f"pdserve: the session cluster for {where} did not start: {failure}")
    exported.cluster = cluster
    max_len = spec.max_model_len if spec.max_model_len is not None else cfg.max_model_len
    exported.variables = variables(cluster, max_len, exported.exports)
    try:
        _export(exported)
    except OSError as exc:
        return _stop_run(config, f"pdserve: cannot write the export file {exported.file} (from {where}): "
                         f"{exc.strerror or exc}")  # fmt: skip
    with contextlib.suppress(Exception):  # the summary's hit counts are a report, never a failure
        exported.baseline = {s.name: s.metrics() for s in (*cluster.prefill, *cluster.decode)}


def _describe(config: pytest.Config, cfg: PDServeConfig) -> Exported | None:
    """What the session cluster is (preset, settings) and where its file goes; a usage error (:func:`_refuse`:
    None) for a bad preset or an export file pdserve did not write."""
    try:
        spec, result = session_spec(config)
    except ClusterSpecError as exc:
        _refuse(config, f"pdserve: preset {cfg.preset!r} (from {cfg.source_of('preset')}): {exc}")
        return None
    exported = Exported(spec, notes=result.notes if result else (), preset=result.name if result else None)
    exported.exports = dict(result.exports) if result else {}
    exported.proxy_port = session_proxy_port(cfg, result)
    if cfg.export_env_file is not None:
        problem = foreign_file(cfg.export_env_file)
        if problem is not None:
            _refuse(
                config,
                f"pdserve: export_env_file {cfg.export_env_file} (from {cfg.source_of('export_env_file')}) {problem}; "
                "name a new file, or remove this one if it is yours",
            )
            return None
        exported.file = cfg.export_env_file
    return exported


def _stop_run(config: pytest.Config, message: str) -> None:
    """Stop the run with one message, before any module is imported; an xdist worker hands it to the controller
    instead (``worker_verdict.stop``: its exit would be a crash, restarted by xdist)."""
    if not worker_verdict.stop(config, message, pytest.ExitCode.TESTS_FAILED):
        pytest.exit(message, returncode=1)


def _refuse(config: pytest.Config, message: str) -> None:
    """A usage error; an xdist worker hands it to the controller instead (``worker_verdict.stop``)."""
    if not worker_verdict.stop(config, message, pytest.ExitCode.USAGE_ERROR):
        raise pytest.UsageError(message)


def _missing_extra(report: pytest.CollectReport) -> None:
    """A module that failed to import one of what vLLM's modules need: add to its error the command that installs
    it, instead of leaving a bare ``ModuleNotFoundError``."""
    match = re.search(_NO_MODULE, str(report.longrepr))
    if match is None:
        return
    top = match.group(1).split(".", 1)[0]
    if top in extra_modules(VLLM_TESTS_EXTRA):
        what = ", ".join(sorted(extra_modules(VLLM_TESTS_EXTRA)))
        remedy = f"pip install 'pytest-pdserve[{VLLM_TESTS_EXTRA}]' (installs {what})"
    elif top in _OUTSIDE_EXTRA:
        remedy = _OUTSIDE_EXTRA[top]
    else:
        return
    report.longrepr = (
        f"{report.longrepr}\n\npdserve: {report.nodeid} needs {top!r}, which vLLM's nixl_integration modules "
        f"import and this environment lacks: {remedy}"
    )


def _restore(exported: Exported) -> None:
    """Put the environment back as it was (in-process pytester runs share it)."""
    for key, value in exported.saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    exported.saved.clear()


def _header_lines(exported: Exported) -> list[str]:
    """Report-header lines: what was exported (and where), the preset and what it adapted."""
    if exported.cluster is None:
        return []
    # Lazy: presets.py is costly at import; a session cluster was exported, so it is loaded already.
    from pytest_pdserve.config.presets import describe_config

    lines = []
    if exported.preset is not None:
        lines.append(f"pdserve: preset {exported.preset}: {describe_config(exported.spec)}, block size "
                     f"{exported.cluster.block_size}")  # fmt: skip
    lines += [f"pdserve: preset {exported.preset}: {note}" for note in exported.notes]
    where = f" (also written to {exported.file})" if exported.file is not None else ""
    shown = " ".join(f"{k}={v}" for k, v in exported.variables.items())
    lines.append(f"pdserve: exported{where}: {shown}")
    return lines


def _summary_lines(exported: Exported) -> list[str]:
    """Terminal-summary lines: each server's prefix-cache hits and KV received during the session.

    So a module that passed without exercising the cache (e.g. vLLM's test_edge_cases.py at a block size
    larger than its prompts) shows ``hits 0`` instead of looking like a real pass.
    """
    if exported.cluster is None or not exported.baseline:
        return []
    parts = []
    for server in (*exported.cluster.prefill, *exported.cluster.decode):
        base = exported.baseline.get(server.name)
        try:
            after = exported.final.get(server.name) or server.metrics()
            delta = after - base if base is not None else None
        except Exception:
            delta = None
        if delta is None:
            continue
        hits = kv_moved.delta_or_zero(delta, "vllm:prefix_cache_hits_total")
        external = kv_moved.delta_or_zero(delta, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        parts.append(f"{server.name} prefix-cache hits {hits:g} tokens, external_kv_transfer {external:g} tokens")
    return [f"pdserve: during this session: {'; '.join(parts)}"] if parts else []


class ExportEnvPlugin:
    """``--pd-export-env`` for one pytest process: what it exported (None until the session starts, and on an xdist
    controller, which starts nothing), and its hooks."""

    def __init__(self, cfg: PDServeConfig, get_manager: GetManager) -> None:
        self.cfg = cfg
        #: ``fixtures.get_manager`` (plugin.py passes it: fixtures.py imports session_spec.py, not this module).
        self.get_manager = get_manager
        self.exported: Exported | None = None

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        """Start the session cluster before collection and export its addresses. xdist's controller only checks the
        preset and the export file, before any worker starts: each worker starts and exports its own."""
        config = session.config
        exported = _describe(config, self.cfg)
        if exported is None or is_xdist_controller(config):
            return
        self.exported = exported
        _start(config, self.cfg, self.get_manager, exported)

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        return [redact(line) for line in _header_lines(self.exported)] if self.exported is not None else []

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
        """A vLLM module that cannot import openai & co. names the extra that installs them (changed here, before
        any ``pytest_collectreport`` hook, so xdist workers send the same text)."""
        report = yield
        if report.failed and self.exported is not None:
            _missing_extra(report)
        return report

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, object, object]:
        """The KV each test module moved from prefill to decode (kv_moved.module_boundary)."""
        kv_moved.module_boundary(self.exported, item, nextitem, starting=True)
        try:
            return (yield)
        finally:
            kv_moved.module_boundary(self.exported, item, nextitem, starting=False)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
        """The KV the test's module moved, measured before the teardown: the session's last one stops the clusters,
        the exported one included."""
        kv_moved.module_boundary(self.exported, item, nextitem, starting=False)
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        """The modules with a passed test (only those must have moved KV)."""
        report = yield
        kv_moved.test_passed(self.exported, report)
        return report

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """``--pd-require-kv-transfer`` (on under ``--pd-preset``): a module that passed without moving KV from
        prefill to decode fails the session (the terminal summary names it). An xdist worker's summary and exit
        status reach no one: it hands both to its controller (worker_verdict.py), which prints them and ends the
        run with it."""
        vacuous = kv_moved.require_kv_transfer(self.cfg, self.exported) and bool(
            kv_moved.vacuous_modules(self.exported)
        )
        worker_verdict.hand_over(session.config, self._summary, vacuous)
        if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED) and vacuous:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _summary(self) -> list[str]:
        """The terminal summary's lines (:meth:`pytest_terminal_summary`)."""
        if self.exported is None:
            return []
        required = kv_moved.require_kv_transfer(self.cfg, self.exported)
        return [*_summary_lines(self.exported), *kv_moved.module_lines(self.exported, required)]

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        """What the session cluster's caches did (a vacuous pass shows hits 0) and the KV each module moved."""
        if self.exported is None:
            return
        for line in _summary_lines(self.exported):
            terminalreporter.write_line(redact(line))
        required = kv_moved.require_kv_transfer(self.cfg, self.exported)
        for line in kv_moved.module_lines(self.exported, required):
            terminalreporter.write_line(redact(line), red="no KV moved" in line and required)

    def pytest_unconfigure(self) -> None:
        if self.exported is not None:
            _restore(self.exported)
