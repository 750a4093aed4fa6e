"""``--pd-export-env``: the session cluster, started before collection, described in environment variables.

vLLM's own P/D modules (``tests/v1/kv_connector/nixl_integration/test_*.py``) read ``PREFILL_PORT`` & co. at
import time, before any fixture exists. With ``--pd-export-env`` the plugin starts the session cluster (the
settings plus ``--pd-preset``) in ``pytest_sessionstart``, through the same `ClusterManager` the fixtures use
(same start-up timeout, progress lines, watchdog and teardown at ``pytest_unconfigure``), and puts its
addresses into ``os.environ``; ``--pd-export-env-file=FILE`` also writes them as ``export`` lines.

Under pytest-xdist every worker starts and exports its own cluster (workers import the modules, the
controller does not); the controller starts nothing.
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
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pytest_pdserve.config.settings import PDSERVE_CONFIG, PDServeConfig, short_source
from pytest_pdserve.errors import ClusterSpecError, ClusterUnavailable, PDServeError
from pytest_pdserve.glue import worker_verdict
from pytest_pdserve.glue.session_inventory import get_inventory

# The cluster-description modules (spec.py, presets.py, owned_flags.py, connector.py: costly at import) are
# imported by the functions that describe the session cluster: the plugin loads this module for every run, and a
# run without --pd-preset / --pd-export-env / pd_cluster never describes one.
if TYPE_CHECKING:
    from pytest_pdserve.cluster import PDCluster
    from pytest_pdserve.config.presets import PresetResult
    from pytest_pdserve.metrics import MetricsDelta, MetricsSnapshot
    from pytest_pdserve.running.manager import ClusterManager
    from pytest_pdserve.spec import ClusterSpec

#: ``fixtures.get_manager``: the session's cluster manager, built on first use.
GetManager = Callable[[pytest.Config, pytest.TempPathFactory], "ClusterManager"]

#: Session settings that, when given explicitly, beat the preset's value (the spec field is cleared, so the
#: command builder falls back to the session setting).
_SESSION_WINS = ("model", "attention_backend", "block_size", "max_model_len", "gpu_memory_utilization")


class Exported:
    """What ``--pd-export-env`` started and exported (``config.stash[EXPORTED]``).

    A plain class, not a dataclass: defining a dataclass costs at import (per field), paid by every run that loads
    the plugin, and only an exporting run makes one."""

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
        #: Per test module (its path as pytest shows it): KV moved into decode while it ran (tokens, NIXL bytes).
        self.moved: dict[str, tuple[float, float]] = {}
        #: The running module and its decode servers' metrics when it began.
        self.module_start: tuple[str, dict[str, MetricsSnapshot]] | None = None
        #: Modules with at least one passed test (only those must have moved KV).
        self.passed: set[str] = set()


EXPORTED = pytest.StashKey[Exported]()

#: pytest-pdserve's extra with what vLLM's own modules import (pyproject's [project.optional-dependencies] is the
#: one list; it is read back from the installed metadata).
VLLM_TESTS_EXTRA = "vllm-tests"
#: What the modules need that no extra of ours installs: test_accuracy.py runs lm_eval's gsm8k through the
#: "local-completions" API model, and lm_eval downloads the dataset when it runs.
_OUTSIDE_EXTRA = {"lm_eval": "pip install 'lm_eval[api]' (it also downloads the gsm8k dataset: network access)"}
#: How pytest reports a test module whose import failed for a missing module (its CollectError text).
#: A pattern, compiled (and cached by ``re``) at the first failed module of an exporting run, not when the plugin loads.
_NO_MODULE = r"ModuleNotFoundError: No module named '([\w.]+)'"


def _user_over_preset(preset: ClusterSpec, cfg: PDServeConfig) -> tuple[ClusterSpec, list[str]]:
    """The preset's values as defaults the user's own settings override, as the scripts do: they append
    ``"${EXTRA_ARGS[@]}"`` last, so CI's ``VLLM_SERVE_EXTRA_ARGS`` (and ``ATTENTION_BACKEND``) beat their fixed
    flags. A session setting given explicitly, or a ``once`` flag (``--max-model-len``, ...) in the session's extra
    args, clears the preset's field; each override is returned as a report-header note. Two of the user's own
    sources that disagree are still refused, by `effective.effective` (``--max-model-len is given twice``).
    """
    # Lazy: ~14 M instructions at import (see the top); a preset is in use, so spec.py has loaded it already.
    from pytest_pdserve.config import owned_flags
    from pytest_pdserve.spec import ClusterSpec

    cleared: dict[str, None] = {}
    notes = []
    for name in _SESSION_WINS:
        if cfg.sources.get(name, "default") != "default" and getattr(preset, name) is not None:
            cleared[name] = None
            notes.append(f"{name} {getattr(cfg, name)!r} from {short_source(cfg.sources[name])} overrides the "
                         f"preset's {getattr(preset, name)!r}")  # fmt: skip
    source = short_source(cfg.sources.get("vllm_serve_extra_args", "VLLM_SERVE_EXTRA_ARGS"))
    for hit in owned_flags.match(cfg.vllm_serve_extra_args):
        field_name = hit.owned.spec_field
        if hit.owned.policy != "once" or field_name is None or field_name in cleared:
            continue
        if getattr(preset, field_name) != getattr(ClusterSpec(), field_name):
            cleared[field_name] = None
            notes.append(f"{hit.shown!r} from {source} overrides the preset's {field_name}="
                         f"{getattr(preset, field_name)!r}")  # fmt: skip
    return preset.with_(**cleared), notes


def session_spec(config: pytest.Config) -> tuple[ClusterSpec, PresetResult | None]:
    """The session cluster's spec: ``--pd-preset`` (if any), explicit session settings over it, then the
    session connector (``--pd-kv-connector-config``). ``pd_cluster`` and ``--pd-export-env`` both use it."""
    # Lazy: the cluster-description modules, ~40 M instructions at import (see the top), loaded when a session
    # cluster is first described.
    from pytest_pdserve.config.connector import parse_kv_connector_config
    from pytest_pdserve.config.presets import resolve as resolve_preset
    from pytest_pdserve.spec import ClusterSpec

    cfg: PDServeConfig = config.stash[PDSERVE_CONFIG]
    result = None
    spec = ClusterSpec()
    name = session_preset_name(config)
    if name is not None:
        result = resolve_preset(
            name, spec_type=ClusterSpec, engine=cfg.resolved_engine, platform=get_inventory(config).platform
        )
        spec, overridden = _user_over_preset(result.spec, cfg)
        result = replace(result, notes=(*result.notes, *overridden))
    if cfg.kv_connector_config is not None:
        spec = spec.with_(**parse_kv_connector_config(cfg.kv_connector_config))
    return spec, result


def session_preset_name(config: pytest.Config) -> str | None:
    """``--pd-preset``'s name; for ``auto``, the preset of the vLLM modules this run collects, from its paths
    (``config.args``: the command line's, else ``testpaths``, else the current directory).

    Checked at configure time (``pytest_configure`` calls it), so a bad ``auto`` stops the run before any test.

    :raises pytest.UsageError: ``auto`` finds no vLLM module (it would silently run the defaults: block size 128
        where the module's script runs 16), or modules that need different presets.
    """
    cfg: PDServeConfig = config.stash[PDSERVE_CONFIG]
    if cfg.preset != "auto":
        return cfg.preset
    # Lazy: presets.py, ~10 M instructions at import (see the top), only for --pd-preset auto.
    from pytest_pdserve.config.presets import AUTO, PRESETS, auto_preset

    base = config.invocation_params.dir if config.args_source != pytest.Config.ArgsSource.TESTPATHS else config.rootpath
    where = f"--pd-preset auto (from {cfg.source_of('preset')})"
    try:
        name = auto_preset(config.args, base)
    except ClusterSpecError as exc:
        raise pytest.UsageError(f"pdserve: {where}: {exc}") from None
    if name is None:
        paths = " ".join(config.args) if len(config.args) <= 5 else " ".join(config.args[:5]) + " ..."
        raise pytest.UsageError(
            f"pdserve: {where} found none of vLLM's P/D modules ({', '.join(AUTO)}) in {paths}; name the preset "
            f"(--pd-preset=NAME, one of {', '.join(PRESETS)}) or the module to run"
        )
    return name


def session_proxy_port(cfg: PDServeConfig, result: PresetResult | None) -> int | None:
    """``--pd-proxy-port``, else the port the preset's module hard-codes (8192), else None (leased)."""
    if cfg.proxy_port is not None:
        return cfg.proxy_port
    return result.proxy_port if result is not None else None


def is_xdist_controller(config: pytest.Config) -> bool:
    return config.pluginmanager.hasplugin("dsession") and not hasattr(config, "workerinput")


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


def start(config: pytest.Config, get_manager: GetManager) -> None:
    """``pytest_sessionstart``: start the session cluster and export it (a no-op without ``--pd-export-env``).

    ``get_manager`` is the fixtures' ``get_manager`` (the plugin passes it: fixtures.py imports this module for
    the session spec, so this one does not import fixtures.py). A cluster that cannot start stops the run with
    one message (``pytest.exit``), before any module is imported; pytest_unconfigure still stops whatever was started.
    """
    cfg: PDServeConfig = config.stash[PDSERVE_CONFIG]
    if not cfg.export_env:
        return
    where = cfg.source_of("export_env" if cfg.sources.get("export_env", "default") != "default" else "export_env_file")
    try:
        spec, result = session_spec(config)
    except ClusterSpecError as exc:
        return _refuse(config, f"pdserve: preset {cfg.preset!r} (from {cfg.source_of('preset')}): {exc}")
    exported = Exported(spec, notes=result.notes if result else (), preset=result.name if result else None)
    if cfg.export_env_file is not None:
        problem = foreign_file(cfg.export_env_file)
        if problem is not None:
            return _refuse(
                config,
                f"pdserve: export_env_file {cfg.export_env_file} (from {cfg.source_of('export_env_file')}) {problem}; "
                "name a new file, or remove this one if it is yours",
            )
        exported.file = cfg.export_env_file
    if is_xdist_controller(config):  # checked here, before any worker starts: each starts and exports its own
        return None
    config.stash[EXPORTED] = exported
    tmp_path_factory: pytest.TempPathFactory = getattr(config, "_tmp_path_factory")  # noqa: B009 - set by pytest
    manager = get_manager(config, tmp_path_factory)
    port = session_proxy_port(cfg, result)
    if port is not None:
        manager.proxy_ports[spec] = port
    failure = None
    try:
        cluster = manager.attached(spec, cfg) if cfg.attach_mode else manager.get(spec)
    except (ClusterUnavailable, PDServeError) as exc:
        failure = str(exc)
    if failure is not None:
        return _stop_run(config, f"pdserve: the session cluster for {where} did not start: {failure}")
    exported.cluster = cluster
    max_len = spec.max_model_len if spec.max_model_len is not None else cfg.max_model_len
    exported.variables = variables(cluster, max_len, result.exports if result else {})
    try:
        _export(exported)
    except OSError as exc:
        return _stop_run(config, f"pdserve: cannot write the export file {exported.file} (from {where}): "
                         f"{exc.strerror or exc}")  # fmt: skip
    with contextlib.suppress(Exception):  # the summary's hit counts are a report, never a failure
        exported.baseline = {s.name: s.metrics() for s in (*cluster.prefill, *cluster.decode)}


def _stop_run(config: pytest.Config, message: str) -> None:
    """Stop the run with one message, before any module is imported; an xdist worker hands it to the controller
    instead (``worker_verdict.stop``: its exit would be a crash, restarted by xdist)."""
    if not worker_verdict.stop(config, message, pytest.ExitCode.TESTS_FAILED):
        pytest.exit(message, returncode=1)


def _refuse(config: pytest.Config, message: str) -> None:
    """A usage error; an xdist worker hands it to the controller instead (``worker_verdict.stop``)."""
    if not worker_verdict.stop(config, message, pytest.ExitCode.USAGE_ERROR):
        raise pytest.UsageError(message)


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


def name_missing_extra(config: pytest.Config, report: pytest.CollectReport) -> None:
    """A module collected in an ``--pd-export-env`` session that failed to import one of what vLLM's modules need:
    add to its error the command that installs it, instead of leaving a bare ``ModuleNotFoundError``."""
    if not report.failed or EXPORTED not in config.stash:
        return
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


def restore(config: pytest.Config) -> None:
    """``pytest_unconfigure``: put the environment back as it was (in-process pytester runs share it)."""
    exported = config.stash.get(EXPORTED, None)
    if exported is None:
        return
    for key, value in exported.saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    exported.saved.clear()


def header_lines(config: pytest.Config) -> list[str]:
    """Report-header lines: what was exported (and where), the preset and what it adapted."""
    exported = config.stash.get(EXPORTED, None)
    if exported is None or exported.cluster is None:
        return []
    # Lazy: presets.py (see the top); a session cluster was exported, so it is loaded already.
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


def summary_lines(config: pytest.Config) -> list[str]:
    """Terminal-summary lines: each server's prefix-cache hits and KV received during the session.

    So a module that passed without exercising the cache (e.g. vLLM's test_edge_cases.py at a block size
    larger than its prompts) shows ``hits 0`` instead of looking like a real pass.
    """
    exported = config.stash.get(EXPORTED, None)
    if exported is None or exported.cluster is None or not exported.baseline:
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
        hits = delta_or_zero(delta, "vllm:prefix_cache_hits_total")
        external = delta_or_zero(delta, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        parts.append(f"{server.name} prefix-cache hits {hits:g} tokens, external_kv_transfer {external:g} tokens")
    return [f"pdserve: during this session: {'; '.join(parts)}"] if parts else []


def delta_or_zero(delta: MetricsDelta, name: str, **labels: str) -> float:
    """A counter's delta, 0 when the server does not export it (yet)."""
    value = delta.get(name, **labels)
    return 0.0 if value is None else value
