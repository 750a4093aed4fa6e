"""Settings resolved once into a frozen :class:`PDServeConfig`: option registration, precedence, cross-checks.

What settings exist, and how each derives its flag, ini key and env var, is the table in
:mod:`pytest_pdserve.config.setting_table`; how one raw value is parsed is :mod:`pytest_pdserve.config.setting_parsers`.

Precedence: command line > environment > ini > default. Layers are tested with ``is None``, and
an empty environment variable counts as unset (CI systems often export ``VAR=``). Every value is
parsed at ``pytest_configure``; a bad one stops the run with a usage error naming the value,
where it came from and what is accepted.

Read once, and held to it: the variables read here (every setting's, and the GPU visibility variables when the
inventory is detected from them) are kept with the configuration (``PDServeConfig.read_env``). A ``conftest.py``
in a sub-directory, a fixture or a test can change the environment later; :func:`env_drift` says which of those
variables would now resolve differently, and a cluster start refuses to go on with them (``running/start_env.py``):
the report header, every cluster and a kept cluster's fingerprint all use the configure-time value, so a later one
would be silently ignored for some and not others. A variable whose setting was given on the command line is not
held (the command line wins either way).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_pdserve.common import redaction
from pytest_pdserve.config.bounds import server_keepalive_problem
from pytest_pdserve.config.setting_parsers import check_raw

# The table's names are re-exported: settings.SETTINGS, settings.remedy, ... are where callers look.
from pytest_pdserve.config.setting_table import PATH_SETTINGS, SETTINGS, SETTINGS_BY_NAME, Setting, remedy
from pytest_pdserve.engines.locate import VLLM_MODULE_ENTRYPOINT, resolve_engine
from pytest_pdserve.errors import InventoryError, OwnedFlagError, PathError, SettingError
from pytest_pdserve.machine.inventory import Platform, parse_simulate_gpus
from pytest_pdserve.machine.paths import check_dir

__all__ = [
    "PDSERVE_CONFIG",
    "SETTINGS",
    "SETTINGS_BY_NAME",
    "PDServeConfig",
    "Setting",
    "VISIBILITY_VARS",
    "add_options",
    "env_drift",
    "remedy",
    "resolve",
    "resolve_engine",
    "settings_origin",
    "short_source",
]


@dataclass(frozen=True)
class PDServeConfig:
    """Every setting, resolved once at ``pytest_configure`` (``config.stash[PDSERVE_CONFIG]``)."""

    engine: str
    model: str | None
    attention_backend: str | None
    vllm_serve_extra_args: tuple[str, ...]
    prefill_gpu_ids: tuple[int, ...] | None
    decode_gpu_ids: tuple[int, ...] | None
    share_gpus: bool
    gpu_memory_utilization: float | None
    block_size: int | None
    max_model_len: int | None
    enforce_eager: bool
    seed: int
    startup_timeout: float
    shutdown_timeout: float
    log_dir: Path | None
    platform: str
    simulate_gpus: tuple[Platform, int] | None
    gpu_wait: str
    gpu_wait_timeout: float
    vllm_executable: str
    proxy_command: tuple[str, ...] | None
    api_key: str | None = field(repr=False)  # a repr lands in assertion messages and --showlocals output
    lease_dir: Path
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    proxy_url: str | None
    export_env: bool
    export_env_file: Path | None
    """Where ``export`` lines also go (absolute); giving it turns ``export_env`` on."""
    preset: str | None
    kv_connector_config: str | None
    proxy_port: int | None
    port_range: tuple[int, int] | None
    cache_salt: str
    request_timeout: float
    ready_check: bool
    require_kv_transfer: bool
    reuse: bool
    """Asked for (``--pd-reuse``, or a ``reuse_mode`` given); :func:`pytest_pdserve.reuse.dirs.reuse_decision` says
    whether it applies."""
    reuse_mode: str
    """``local`` (refused on CI) or ``force``."""
    reuse_ttl: float
    reuse_dir: Path | None
    resolved_engine: str
    """``vllm`` or ``sim``."""
    engine_reason: str
    """Why, e.g. ``auto: vllm executable found at /x/bin/vllm``."""
    vllm_argv: tuple[str, ...]
    """How to run vLLM's CLI: ``(path,)`` or ``(python, "-m", "vllm.entrypoints.cli.main")``."""
    sources: Mapping[str, str]
    """field -> ``--flag`` / ``$ENV`` / ``ini key`` / ``default``."""
    shadowed: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: types.MappingProxyType({}))
    """field -> the lower layers that also set it and lost (``$ENV``, ``ini key``), for the report header."""
    read_env: Mapping[str, str | None] = field(default_factory=lambda: types.MappingProxyType({}), repr=False)
    """Every environment variable read at configure -> its value then (None: unset); see :func:`env_drift`."""

    @property
    def attach_mode(self) -> bool:
        """True when the servers are given as URLs instead of being started."""
        return bool(self.prefill_urls or self.decode_urls or self.proxy_url)

    def source_of(self, name: str) -> str:
        """Where *name* came from, in words (``--pd-model``, ``environment variable X``, ...)."""
        return _describe_source(self.sources.get(name, "default"))


PDSERVE_CONFIG = pytest.StashKey[PDServeConfig]()


# --------------------------------------------------------------------------- options


def add_options(parser: pytest.Parser) -> None:
    """Register every setting as a flag in the ``pdserve`` group and as an ini key."""
    group = parser.getgroup("pdserve", "vLLM prefill/decode (P/D) servers (pytest-pdserve)")
    for s in SETTINGS:
        tail = f" [env {s.env_var}, ini {s.ini_key}]"
        if s.kind == "bool":
            group.addoption(s.flag, dest=s.dest, default=None, action=argparse.BooleanOptionalAction,
                            help=s.help + tail)  # fmt: skip
        elif s.kind == "append":
            group.addoption(s.flag, dest=s.dest, default=None, action="append", metavar=s.metavar,
                            help=s.help + tail)  # fmt: skip
        else:
            group.addoption(s.flag, dest=s.dest, default=None, metavar=s.metavar, help=s.help + tail)
        parser.addini(s.ini_key, f"{s.help} ({s.flag})", type=_ini_type(s), default=None)


def _ini_type(s: Setting) -> Any:
    """A list type for repeatable settings; scalars accept TOML's native types where pytest can.

    Values are stringified (:func:`_ini_text`) and parsed like environment values either way.
    """
    if s.kind == "append":
        return "linelist"
    if pytest.version_tuple >= (9, 2):
        return str | int | float | bool  # a TOML `pdserve_seed = 7` stays legal
    return "string"


# --------------------------------------------------------------------------- resolution


def _describe_source(source: str) -> str:
    if source.startswith("$"):
        return f"environment variable {source[1:]}"
    if source.startswith("ini "):
        return f"ini key {source[4:]}"
    return source


def _ini_text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def settings_origin(cfg: PDServeConfig) -> str:
    """Every setting not at its default: ``name=value (source; lost: lower sources)``, for the report header.

    A value given in several layers names the ones that lost (``$PDSERVE_SEED`` under ``--pd-seed``), so a CI
    variable that silently has no effect is visible. Secrets show as ``***``.
    """
    parts = []
    for s in SETTINGS:
        source = cfg.sources.get(s.name, "default")
        if source == "default":
            continue
        value = getattr(cfg, s.name)
        shown = (
            "***"
            if s.secret
            else (
                shlex.join(value)
                if isinstance(value, tuple) and value and all(isinstance(v, str) for v in value)
                else str(value)
            )
        )
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        lost = cfg.shadowed.get(s.name, ())
        parts.append(f"{s.name}={shown} ({source}{'; lost: ' + ', '.join(lost) if lost else ''})")
    return ", ".join(parts)


def _layers(config: pytest.Config, s: Setting, environ: Mapping[str, str]) -> list[tuple[Any, str]]:
    """Every (raw value, source) that sets *s*, in precedence order: CLI > env > ini (``is None`` tests)."""
    found: list[tuple[Any, str]] = []
    cli: Any = config.getoption(s.dest)
    if cli is not None:
        found.append(((",".join(cli) if isinstance(cli, list) else cli), s.flag))
    env = environ.get(s.env_var)
    if env is not None and env.strip():
        found.append((env, f"${s.env_var}"))
    ini: Any = config.getini(s.ini_key)
    if ini is not None and _ini_text(ini).strip():
        found.append((_ini_text(ini), f"ini {s.ini_key}"))
    return found


def _usage(setting: Setting, raw: Any, source: str, why: str) -> pytest.UsageError:
    short = f"{raw[:200]}..." if isinstance(raw, str) and len(raw) > 200 else raw
    shown = "the value" if setting.secret else redaction.redact(repr(short))
    return pytest.UsageError(f"pdserve: {shown} from {_describe_source(source)} is not a valid "
                             f"{setting.name}: {why} (set {setting.remedy})")  # fmt: skip


def _base_dir(config: pytest.Config, source: str) -> Path:
    """Relative ini paths are relative to the ini file; others to where pytest was invoked."""
    if source.startswith("ini ") and config.inipath is not None:
        return config.inipath.parent
    return config.invocation_params.dir


def resolve(config: pytest.Config, environ: Mapping[str, str] | None = None) -> PDServeConfig:
    """Resolve every setting; raise :class:`pytest.UsageError` naming the first bad value."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    shadowed: dict[str, tuple[str, ...]] = {}
    for s in SETTINGS:
        layers = _layers(config, s, env)
        raw, source = layers[0] if layers else (s.default, "default")
        sources[s.name] = source
        if len(layers) > 1:
            shadowed[s.name] = tuple(src for _, src in layers[1:])
        if source == "default" or isinstance(raw, bool):
            values[s.name] = raw
            continue
        try:
            check_raw(raw)
            values[s.name] = s.parse(raw)
        except SettingError as exc:
            raise _usage(s, raw, source, str(exc)) from None
    _implied_flags(values, sources)
    # Secrets are registered before anything can print them (the header, errors, log headers).
    redaction.register(
        values["api_key"],
        *(redaction.url_password(u) for u in _all_urls(values)),
        *redaction.secrets_in(values["vllm_serve_extra_args"], env),  # an --hf-token, $HF_TOKEN servers inherit
    )
    _check_extra_args(values, sources)
    for name in PATH_SETTINGS:
        if sources[name] != "default" and values[name] is not None:
            path = Path(values[name]).expanduser()
            values[name] = path if path.is_absolute() else _base_dir(config, sources[name]) / path
            try:
                check_dir(values[name])  # the rule lives in paths.py: a file, or nowhere to write, is a usage error
            except PathError as exc:
                raise _usage(SETTINGS_BY_NAME[name], str(values[name]), sources[name], str(exc)) from None
    if values["export_env_file"] is not None:  # a file, not a directory: no check_dir (export_env.py checks it)
        path = Path(values["export_env_file"]).expanduser()
        values["export_env_file"] = path if path.is_absolute() else _base_dir(config, sources["export_env_file"]) / path
    _check_gpu_sharing(values, sources)
    if values["simulate_gpus"] is not None:
        try:
            values["simulate_gpus"] = parse_simulate_gpus(values["simulate_gpus"], values["platform"])
        except InventoryError as exc:
            s = SETTINGS_BY_NAME["simulate_gpus"]
            why = f"{exc} (platform from {_describe_source(sources['platform'])})"
            raise _usage(s, values["simulate_gpus"], sources["simulate_gpus"], why) from None
    resolved, reason, argv = resolve_engine(values["engine"], values["vllm_executable"])
    attach = bool(values["prefill_urls"] or values["decode_urls"] or values["proxy_url"])
    if not attach and (problem := server_keepalive_problem(env)) is not None:
        # The servers inherit pytest's environment (ClusterSpec.env is checked by the same rule in spec.py).
        raise pytest.UsageError(f"pdserve: {problem} (from the environment pytest runs in, which the servers inherit)")
    # An explicitly named executable must exist; an explicit engine=vllm must find vLLM somehow.
    explicit_exe = sources["vllm_executable"] != "default" and values["engine"] != "sim"
    missing_exe = not argv or argv[1:] == VLLM_MODULE_ENTRYPOINT
    if not attach and ((explicit_exe and missing_exe) or (values["engine"] == "vllm" and not argv)):
        which_src = "vllm_executable" if explicit_exe else "engine"
        raise _usage(
            SETTINGS_BY_NAME[which_src], values[which_src], sources[which_src],
            f"no vllm executable {values['vllm_executable']!r} (looked next to {sys.executable} and on "
            "PATH) and the vllm package is not importable; install vLLM, point --pd-vllm-executable / "
            "PDSERVE_VLLM_EXECUTABLE at it, or use --pd-engine sim",
        )  # fmt: skip
    read = [s.env_var for s in SETTINGS]
    if values["simulate_gpus"] is None and values["platform"] != "cpu":
        read += VISIBILITY_VARS  # the inventory is detected from them (session_inventory.py passes this copy)
    return PDServeConfig(
        **values,
        resolved_engine=resolved,
        engine_reason=reason,
        vllm_argv=argv,
        sources=types.MappingProxyType(sources),
        shadowed=types.MappingProxyType(shadowed),
        read_env=types.MappingProxyType({name: env.get(name) for name in read}),
    )


#: What the GPU inventory is detected from (machine/inventory.py), besides the tools' own output.
VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


def env_drift(cfg: PDServeConfig, environ: Mapping[str, str]) -> str | None:
    """Which variables read at configure would resolve differently in ``environ`` now, in words; None: none.

    A setting's variable counts unless its flag was given (the command line beats it either way); empty and unset
    are the same value, as at configure. A visibility variable counts as it is (``CUDA_VISIBLE_DEVICES=`` hides
    every GPU).
    """
    changed = []
    for name, then in cfg.read_env.items():
        now = environ.get(name)
        setting = _SETTING_BY_ENV.get(name)
        if setting is not None:
            if cfg.sources.get(setting.name, "").startswith("--"):
                continue
            then, now = (v if v is not None and v.strip() else None for v in (then, now))
        if then == now:
            continue
        if setting is not None and setting.secret:
            shown = "a value" if now is not None else "unset"
            changed.append(f"{name} (secret) is {shown} now, not the one pytest configured with")
        else:
            changed.append(f"{name}={_shown(now)} now, {_shown(then)} when pytest configured")
        if setting is not None:
            changed[-1] += f" (setting {setting.name}; also {setting.flag} / ini {setting.ini_key})"
    if not changed:
        return None
    return (
        f"the environment changed after pytest configured: {'; '.join(changed)}. pdserve reads these once, before "
        "any sub-directory conftest.py, fixture or test runs, and the report header, every cluster and a kept "
        "cluster's fingerprint use that value; set them before pytest starts (the shell, PYTEST_ADDOPTS or the "
        "ini file, or at the top of the rootdir conftest.py, which pytest imports before it configures), or give "
        "the flag"
    )


def _shown(value: str | None) -> str:
    if value is None:
        return "unset"
    return redaction.redact(repr(value if len(value) <= 200 else value[:200] + "..."))


_SETTING_BY_ENV: Mapping[str, Setting] = {s.env_var: s for s in SETTINGS}


#: A value that needs its flag turns it on when given: ``--pd-export-env-file=F`` means ``--pd-export-env``.
_IMPLIES = {s.implied_by: s.name for s in SETTINGS if s.implied_by is not None}


def _implied_flags(values: dict[str, Any], sources: Mapping[str, str]) -> None:
    """A file or mode given turns its flag on; with the flag explicitly off, the two disagree: a usage error."""
    for given, flag in _IMPLIES.items():
        if sources[given] == "default":
            continue
        if sources[flag] != "default" and values[flag] is False:
            s = SETTINGS_BY_NAME[flag]
            raise pytest.UsageError(
                f"pdserve: {s.name} is off (from {_describe_source(sources[flag])}) but {given} is given (from "
                f"{_describe_source(sources[given])}), which needs it on; drop one (set {s.remedy})"
            )
        values[flag] = True


def _all_urls(values: Mapping[str, Any]) -> list[str]:
    return [*values["prefill_urls"], *values["decode_urls"], *([values["proxy_url"]] if values["proxy_url"] else [])]


def short_source(source: str) -> str:
    """``VLLM_SERVE_EXTRA_ARGS (env)``, ``pdserve_x (ini)``, ``--flag (command line)``."""
    if source.startswith("$"):
        return f"{source[1:]} (env)"
    if source.startswith("ini "):
        return f"{source[4:]} (ini)"
    return f"{source} (command line)" if source.startswith("-") else source


def _check_extra_args(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """The owned-flags table applied to the session's extra args: refused flags, and ``once`` flags that a
    setting gives too (the same rule `effective.effective` applies per cluster)."""
    extra: Sequence[str] = values["vllm_serve_extra_args"]
    if not extra:
        return  # no flag to refuse, and each setting gives its flag once: nothing can fail (the default run)
    # Lazy: owned_flags.py builds its table and dataclasses at import, needed only when extra args are given.
    from pytest_pdserve.config import owned_flags

    where = short_source(sources["vllm_serve_extra_args"])
    given: dict[str, list[owned_flags.Given]] = {}
    for owned in owned_flags.OWNED_FLAGS:
        if owned.policy == "once" and owned.setting is not None and values[owned.setting] is not None:
            given[owned.flag] = [owned_flags.Given(short_source(sources[owned.setting]), repr(values[owned.setting]))]
    try:
        owned_flags.refuse(extra, where)
        owned_flags.check_once(given, [(where, extra)])
    except OwnedFlagError as exc:
        raise pytest.UsageError(f"pdserve: {exc}") from None


def _check_gpu_sharing(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """--pd-share-gpus excludes explicit ids; a memory fraction must fit the default cluster's shared GPU."""
    p_ids, d_ids = values["prefill_gpu_ids"], values["decode_gpu_ids"]
    if values["share_gpus"] and (p_ids is not None or d_ids is not None):
        given = " and ".join(_describe_source(sources[n]) for n in ("prefill_gpu_ids", "decode_gpu_ids")
                             if values[n] is not None)  # fmt: skip
        raise pytest.UsageError(
            f"pdserve: --pd-share-gpus (from {_describe_source(sources['share_gpus'])}) and explicit GPU ids "
            f"(from {given}) both say where servers run; use one: the same ids on both sides share a GPU too"
        )
    util = values["gpu_memory_utilization"]
    shares = values["share_gpus"] or bool(set(p_ids or ()) & set(d_ids or ()))
    if util is None or not shares:
        return
    # Lazy: gpu_plan.py (and the lease machinery) loaded only when GPUs are shared.
    from pytest_pdserve.machine.gpu_plan import shared_utilization_problem

    problem = shared_utilization_problem(util, 2)  # the default cluster: 1 prefill + 1 decode
    if problem is not None:
        s = SETTINGS_BY_NAME["gpu_memory_utilization"]
        why = "--pd-share-gpus" if values["share_gpus"] else "the same prefill and decode GPU ids"
        raise _usage(s, util, sources["gpu_memory_utilization"], f"with {why}, {problem}")
