"""Settings: one declaration per setting, resolved once into a frozen :class:`PDServeConfig`.

Each :class:`Setting` derives its command-line flag (``--pd-<kebab>``), ini key
(``pdserve_<snake>``) and environment variable (``PDSERVE_<UPPER>``) from its name, with explicit
overrides where vLLM's scripts already use a name (``ATTENTION_BACKEND``,
``VLLM_SERVE_EXTRA_ARGS``, ``PREFILL_GPU_ID``, ...).

Precedence: command line > environment > ini > default. Layers are tested with ``is None``, and
an empty environment variable counts as unset (CI systems often export ``VAR=``). Every value is
parsed at ``pytest_configure``; a bad one stops the run with a usage error naming the value,
where it came from and what is accepted.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import shutil
import sys
import threading
import types
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from pytest_pdserve import owned_flags, redaction
from pytest_pdserve.commands import proxy_placeholder_problems
from pytest_pdserve.errors import OwnedFlagError
from pytest_pdserve.extra_args import ExtraArgsError, parse_extra_args
from pytest_pdserve.inventory import (
    Inventory,
    InventoryError,
    Platform,
    detect_inventory,
    parse_simulate_gpus,
    simulated_inventory,
)
from pytest_pdserve.leases import DEFAULT_LEASE_DIR
from pytest_pdserve.paths import PathError, check_dir
from pytest_pdserve.spec import ATTENTION_BACKEND_RE, MAX_BLOCK_SIZE, MAX_MODEL_LEN

__all__ = [
    "PDSERVE_CONFIG",
    "SETTINGS",
    "PDServeConfig",
    "Setting",
    "add_options",
    "get_inventory",
    "remedy",
    "resolve",
    "resolve_engine",
    "settings_origin",
    "short_source",
    "start_inventory_detection",
]

VLLM_MODULE_ENTRYPOINT = ("-m", "vllm.entrypoints.cli.main")
"""``python -m`` target used when the vllm package is importable but no ``vllm`` script is found."""
#: Bounds where a larger value only costs memory or time (the others live with ClusterSpec, in spec.py).
MAX_SIMULATED_GPUS = 1024
MAX_GPU_INDEX = 1023
#: Raw setting values longer than this (bytes) are refused before parsing (argv elements must stay < 128 KiB).
MAX_VALUE_BYTES = 64 * 1024


class SettingError(ValueError):
    """A raw setting value is invalid; the message says what would be accepted."""


# --------------------------------------------------------------------------- value parsers


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise SettingError(f"accepted values: {', '.join(choices)}")
        return value

    return parse


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SettingError("accepted values: 1/0, true/false, yes/no, on/off")


_INT = re.compile(r"[0-9]+")
_FLOAT = re.compile(r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def _number(
    kind: type[int] | type[float], low: float, high: float, *, open_low: bool = False, what: str = ""
) -> Callable[[str], Any]:
    """One number parser: ASCII digits only (``int()`` also takes ``'1_000'`` and ``'١٢'``), then a range.

    Upper bounds exist where a larger value only costs memory or time.
    """  # fmt: skip
    low_text = f"> {low:g}" if open_low else f">= {low:g}"
    if kind is int:
        expected = f"expected a whole number from {int(low)} to {int(high)}{what} (digits 0-9 only)"
    else:
        expected = f"expected a number{what} {low_text} and <= {high:g}"

    def parse(text: str) -> Any:
        value_text = text.strip()
        if not (_INT if kind is int else _FLOAT).fullmatch(value_text):
            raise SettingError(expected)
        value = kind(value_text)
        if value < low or (open_low and value == low) or value > high:
            raise SettingError(expected)
        return value

    return parse


_seconds = _number(float, 0, 86400, open_low=True, what=" of seconds")
_utilization = _number(float, 0, 1, open_low=True, what=" (a fraction in (0, 1], e.g. 0.2)")


def _text(what: str, max_len: int = 4096) -> Callable[[str], str]:
    """A non-empty, single-line text value (a model name, a path...)."""

    def parse(text: str) -> str:
        value = text.strip()
        if not value:
            raise SettingError(f"expected {what}, got an empty value")
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise SettingError(f"expected {what}; it contains a control character (newline, tab...)")
        if len(value) > max_len:
            raise SettingError(f"expected {what} of at most {max_len} characters, got {len(value)}")
        return value

    return parse


_API_KEY = re.compile(r"[\x21-\x7e]{1,1024}")


def _api_key(text: str) -> str:
    # It goes into an HTTP header (Authorization: Bearer KEY): printable ASCII, no spaces.
    value = text.strip()
    if not _API_KEY.fullmatch(value):
        raise SettingError("expected 1-1024 printable ASCII characters without spaces (it is sent as an HTTP header)")
    return value


def _gpu_ids(text: str) -> tuple[int, ...]:
    pieces = [p.strip() for p in text.split(",")]
    accepted = f"expected GPU indices >= 0 (at most {MAX_GPU_INDEX}) separated by commas, e.g. 0 or 0,1"
    if not pieces or any(not _INT.fullmatch(p) or int(p) > MAX_GPU_INDEX for p in pieces):
        raise SettingError(accepted)
    ids = tuple(int(p) for p in pieces)
    if len(set(ids)) != len(ids):
        raise SettingError(f"an index is repeated; {accepted}")
    return ids


def _attention_backend(text: str) -> str:
    value = text.strip()
    if not ATTENTION_BACKEND_RE.fullmatch(value):
        raise SettingError("expected a vLLM attention backend name such as FLASH_ATTN, TRITON_ATTN or auto")
    return value


def _extra_args(text: str) -> tuple[str, ...]:
    try:
        return parse_extra_args(text)
    except ExtraArgsError as exc:
        raise SettingError(str(exc)) from None


def _command(text: str) -> tuple[str, ...]:
    try:
        argv = tuple(shlex.split(text))
    except ValueError as exc:
        raise SettingError(f"cannot split it as a shell command ({exc}); balance the quotes") from None
    if not argv:
        raise SettingError("expected a command line, e.g. 'python my_proxy.py --port {port}'")
    problems = proxy_placeholder_problems(argv)
    if problems:
        raise SettingError("; ".join(problems))
    program = argv[0]
    if program != "{python}" and shutil.which(program) is None:
        raise SettingError(f"the program {program!r} is not an executable file, nor on PATH")
    return argv


def _url(text: str) -> str:
    value = text.strip()
    expected = "expected an http:// or https:// URL with a host, e.g. http://127.0.0.1:8100"
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in value):
        raise SettingError(f"{expected}; it contains a space or control character")
    try:
        parsed = urllib.parse.urlsplit(value)
        hostname = parsed.hostname  # raises ValueError for a malformed [IPv6] host
    except ValueError as exc:
        raise SettingError(f"{expected} ({exc})") from None
    if parsed.scheme not in ("http", "https") or not hostname:
        raise SettingError(expected)
    try:
        port = parsed.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise SettingError("the port is not a number in 1-65535")
    return value.rstrip("/")


def _urls(text: str) -> tuple[str, ...]:
    return tuple(_url(p) for p in re.split(r"[,\s]+", text) if p)


def _simulate(text: str) -> str:
    # Cross-checked against the platform in resolve(); here only the shape, digits and the bound.
    count = text.strip().rpartition(":")[2].strip()
    if not _INT.fullmatch(count):
        raise SettingError("use N, cuda:N or rocm:N with N a whole number >= 0 (digits 0-9 only)")
    if int(count) > MAX_SIMULATED_GPUS:
        raise SettingError(f"at most {MAX_SIMULATED_GPUS} GPUs can be simulated")
    try:
        parse_simulate_gpus(text)
    except InventoryError as exc:
        raise SettingError(str(exc)) from None
    return text.strip()


def _export_env(text: str) -> str | None:
    # "" = export into the environment only; a path = also write `export` lines there; None = off.
    value = text.strip()
    if value.lower() in ("1", "true", "yes", "on"):
        return ""
    if value.lower() in ("0", "false", "no", "off"):
        return None
    return value


def _preset(text: str) -> str:
    from pytest_pdserve.presets import PRESETS

    value = text.strip()
    if value not in PRESETS and value != "auto":
        raise SettingError(f"accepted values: auto (from the module names), {', '.join(PRESETS)}")
    return value


def _kv_connector_config(text: str) -> str:
    from pytest_pdserve.connector import parse_kv_connector_config
    from pytest_pdserve.errors import ClusterSpecError

    try:
        parse_kv_connector_config(text)
    except ClusterSpecError as exc:
        raise SettingError(str(exc)) from None
    return text.strip()


def _port(text: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        value = 0
    if not 1 <= value <= 65535:
        raise SettingError("expected a port number in 1-65535, e.g. 8192")
    return value


# --------------------------------------------------------------------------- the table

Kind = Literal["value", "bool", "append", "optional"]


@dataclass(frozen=True)
class Setting:
    """One setting: its name, parser and default; flag, ini key and env var derive from the name."""

    name: str
    help: str
    parse: Callable[[str], Any]
    default: Any
    kind: Kind = "value"
    cli: str | None = None
    env: str | None = None
    ini: str | None = None
    metavar: str | None = None
    #: Never shown in an error, the header or a log (the API key).
    secret: bool = False

    @property
    def flag(self) -> str:
        """Command-line flag, ``--pd-<kebab>`` unless overridden."""
        return self.cli or f"--pd-{self.name.replace('_', '-')}"

    @property
    def env_var(self) -> str:
        """Environment variable, ``PDSERVE_<UPPER>`` unless overridden."""
        return self.env or f"PDSERVE_{self.name.upper()}"

    @property
    def ini_key(self) -> str:
        """Ini key, ``pdserve_<snake>`` unless overridden."""
        return self.ini or f"pdserve_{self.name}"

    @property
    def dest(self) -> str:
        """argparse destination (unique across pytest's namespace)."""
        return f"pdserve_{self.name}"

    @property
    def remedy(self) -> str:
        """Every way to set it, for error messages: ``--pd-x / PDSERVE_X / pdserve_x``."""
        flags = f"{self.flag} / --no-{self.flag[2:]}" if self.kind == "bool" else self.flag
        return f"{flags} / {self.env_var} / {self.ini_key}"


SETTINGS: tuple[Setting, ...] = (
    Setting("engine", "Server engine: vllm, sim (built-in simulator) or auto (vllm when installed)",
            _choice("vllm", "sim", "auto"), "auto", metavar="ENGINE"),
    Setting("model", "Model served by prefill and decode (default: the engine's test model)",
            _text("a model name or path"), None, metavar="MODEL"),
    Setting("attention_backend", "vLLM --attention-backend for both servers (P and D must match)",
            _attention_backend, None, cli="--attention-backend", env="ATTENTION_BACKEND",
            metavar="BACKEND"),
    Setting("vllm_serve_extra_args",
            "Extra vllm serve arguments, comma form '--a,1,--b' or shell form \"--a 1 --b 'x y'\" "
            "(write --vllm-serve-extra-args=VALUE when VALUE starts with --)",
            _extra_args, (), cli="--vllm-serve-extra-args", env="VLLM_SERVE_EXTRA_ARGS", metavar="ARGS"),
    Setting("prefill_gpu_ids", "GPU indices (in the visible list) for the prefill server, e.g. 0 or 0,1 "
            "(default: leased)", _gpu_ids, None, env="PREFILL_GPU_ID", metavar="IDS"),
    Setting("decode_gpu_ids", "GPU indices (in the visible list) for the decode server (default: leased)",
            _gpu_ids, None, env="DECODE_GPU_ID", metavar="IDS"),
    Setting("share_gpus", "Run every server of a cluster on one GPU, started one after another, each with "
            "--gpu-memory-utilization 0.4 unless given (TP 1 only)", _bool, False, kind="bool"),
    Setting("gpu_memory_utilization", "vLLM --gpu-memory-utilization, a fraction in (0, 1]",
            _utilization, None, env="GPU_MEMORY_UTILIZATION", metavar="FRACTION"),
    Setting("block_size", "vLLM --block-size", _number(int, 1, MAX_BLOCK_SIZE), None, metavar="N"),
    Setting("max_model_len", "vLLM --max-model-len", _number(int, 1, MAX_MODEL_LEN), None, metavar="N"),
    Setting("enforce_eager", "Pass --enforce-eager to vLLM (default: on)", _bool, True, kind="bool"),
    Setting("seed", "vLLM --seed", _number(int, 0, 2**32 - 1), 0, metavar="N"),
    Setting("startup_timeout", "Seconds a server may take to become ready", _seconds, 1200.0,
            metavar="SECONDS"),
    Setting("shutdown_timeout", "Seconds between SIGTERM and SIGKILL when stopping a server",
            _number(float, 0, 3600, open_low=True, what=" of seconds"), 30.0, metavar="SECONDS"),
    Setting("log_dir", "Directory for server logs (default: under pytest's basetemp)", _text("a directory"),
            None, metavar="DIR"),
    Setting("platform", "GPU platform: auto (detect), cuda, rocm or cpu",
            _choice("auto", "cuda", "rocm", "cpu"), "auto", metavar="PLATFORM"),
    Setting("simulate_gpus", "Simulate N GPUs (N, cuda:N or rocm:N) for marker skips and leasing on CPU CI",
            _simulate, None, metavar="SPEC"),
    Setting("gpu_wait", "When no GPU is free: wait for one, or skip the test", _choice("wait", "skip"),
            "wait", metavar="MODE"),
    Setting("gpu_wait_timeout", "Seconds to wait for a free GPU", _seconds, 1800.0, metavar="SECONDS"),
    Setting("vllm_executable", "vllm executable: a path, or a name looked up next to python and on PATH",
            _text("an executable name or path"), "vllm", metavar="PATH"),
    Setting("proxy_command", "P/D proxy command (shell-quoted argv template; default: built-in proxy)",
            _command, None, metavar="COMMAND"),
    Setting("api_key", "API key the servers require (given to them as VLLM_API_KEY, never on argv)", _api_key,
            None, metavar="KEY", secret=True),
    Setting("lease_dir", "Machine-wide directory for GPU and port lease files", _text("a directory"),
            DEFAULT_LEASE_DIR, metavar="DIR"),
    Setting("prefill_urls", "Attach to a running prefill server instead of starting one (repeatable)",
            _urls, (), kind="append", cli="--pd-prefill-url", metavar="URL"),
    Setting("decode_urls", "Attach to a running decode server instead of starting one (repeatable)",
            _urls, (), kind="append", cli="--pd-decode-url", metavar="URL"),
    Setting("proxy_url", "Attach to a running P/D proxy", _url, None, cli="--pd-proxy-url", metavar="URL"),
    Setting("export_env", "Start the session cluster before collection and export PREFILL_HOST/PORT, "
            "DECODE_HOST/PORT, PROXY_HOST/PORT, TEST_MODEL, BLOCK_SIZE, ... for vLLM's own test modules "
            "(=FILE also writes them as export lines)", _export_env, None, kind="optional", metavar="FILE"),
    Setting("preset", "Server configuration of one of vLLM's nixl_integration scripts for the session cluster: "
            "vllm-edge-case, vllm-mamba-prefix-cache, vllm-multi-connector-edge-case, "
            "vllm-multi-connector-accuracy, vllm-accuracy, vllm-xpu-disagg, or auto (from the module names)", _preset,
            None, metavar="NAME"),
    Setting("kv_connector_config", "Connector of the session cluster, JSON: kv_connector (NixlConnector, or "
            "MultiConnector with kv_connector_extra_config.connectors), kv_buffer_device, "
            "kv_connector_extra_config; pdserve sets kv_role", _kv_connector_config, None, metavar="JSON"),
    Setting("proxy_port", "Port the session cluster's proxy listens on (leased; for modules that hard-code "
            "8192)", _port, None, metavar="N"),
    Setting("cache_salt", "Prefix-cache isolation: per-test (requests sent through the plugin carry the test's own "
            "vLLM cache_salt) or off (tests share one prefix cache)", _choice("per-test", "off"), "per-test",
            metavar="MODE"),
    Setting("request_timeout", "Seconds one request through the plugin's clients may take", _seconds, 600.0,
            metavar="SECONDS"),
    Setting("ready_check", "Hand out a cluster only after a request through the proxy moved KV into every decode "
            "server (P/D-ready, not only HTTP-ready)", _bool, True, kind="bool"),
)  # fmt: skip

SETTINGS_BY_NAME: Mapping[str, Setting] = {s.name: s for s in SETTINGS}
_PATH_SETTINGS = ("log_dir", "lease_dir")


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
    export_env: str | None
    """None: off; "": export into os.environ; a path: also write `export` lines there."""
    preset: str | None
    kv_connector_config: str | None
    proxy_port: int | None
    cache_salt: str
    request_timeout: float
    ready_check: bool
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
        elif s.kind == "optional":  # `--flag` alone or `--flag=VALUE`
            group.addoption(s.flag, dest=s.dest, default=None, nargs="?", const="1", metavar=s.metavar,
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


def _raw(config: pytest.Config, s: Setting, environ: Mapping[str, str]) -> tuple[Any, str]:
    """(raw value, source) for *s*: the first of :func:`_layers`, else the default."""
    layers = _layers(config, s, environ)
    return layers[0] if layers else (s.default, "default")


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


def resolve_engine(
    engine: str,
    vllm_executable: str,
    *,
    which: Callable[[str], str | None] = shutil.which,
    has_module: Callable[[str], bool] | None = None,
    python: str = sys.executable,
) -> tuple[str, str, tuple[str, ...]]:
    """Decide the engine without importing vllm.

    :returns: ``(resolved_engine, reason, vllm_argv)``; vllm_argv is empty when vLLM is not found.
    """
    if engine == "sim":
        return "sim", "sim: requested", ()
    argv: tuple[str, ...] = ()
    found = ""
    exe = Path(vllm_executable).expanduser()
    if os.sep in vllm_executable or exe.is_absolute():
        if exe.is_file() and os.access(exe, os.X_OK):
            argv, found = (str(exe.resolve()),), f"vllm executable {exe}"
    else:
        beside = Path(python).parent / vllm_executable
        if beside.is_file() and os.access(beside, os.X_OK):
            argv, found = (str(beside),), f"vllm executable found at {beside}"
        elif (on_path := which(vllm_executable)) is not None:
            argv, found = (on_path,), f"vllm executable found at {on_path}"
    if not argv:
        check = has_module or _has_module
        if check("vllm"):
            argv, found = (python, *VLLM_MODULE_ENTRYPOINT), f"vllm package importable by {python}"
    if engine == "vllm":
        return "vllm", f"vllm: requested; {found}" if found else "vllm: requested", argv
    if argv:
        return "vllm", f"auto: {found}", argv
    return "sim", "auto: no vllm executable on PATH or next to python; using the simulator", ()


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


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
            _check_raw(raw)
            values[s.name] = s.parse(raw)
        except SettingError as exc:
            raise _usage(s, raw, source, str(exc)) from None
    # Secrets are registered before anything can print them (the header, errors, log headers).
    redaction.register(values["api_key"], *(redaction.url_password(u) for u in _all_urls(values)))
    _check_extra_args(values, sources)
    for name in _PATH_SETTINGS:
        if sources[name] != "default" and values[name] is not None:
            path = Path(values[name]).expanduser()
            values[name] = path if path.is_absolute() else _base_dir(config, sources[name]) / path
            try:
                check_dir(values[name])  # the rule lives in paths.py: a file, or nowhere to write, is a usage error
            except PathError as exc:
                raise _usage(SETTINGS_BY_NAME[name], str(values[name]), sources[name], str(exc)) from None
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
    return PDServeConfig(
        **values,
        resolved_engine=resolved,
        engine_reason=reason,
        vllm_argv=argv,
        sources=types.MappingProxyType(sources),
        shadowed=types.MappingProxyType(shadowed),
    )


def _all_urls(values: Mapping[str, Any]) -> list[str]:
    return [*values["prefill_urls"], *values["decode_urls"], *([values["proxy_url"]] if values["proxy_url"] else [])]


def _check_raw(raw: Any) -> None:
    """What no setting accepts: NUL bytes, undecodable bytes, huge values."""
    text = raw if isinstance(raw, str) else str(raw)
    if "\x00" in text:
        raise SettingError("it contains a NUL byte")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise SettingError("it is not valid UTF-8 (undecodable bytes in the environment?)") from None
    if size > MAX_VALUE_BYTES:
        raise SettingError(f"it is {size} bytes long; the limit is {MAX_VALUE_BYTES}")


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


def remedy(name: str) -> str:
    """How to set setting *name*: ``--pd-x / PDSERVE_X / pdserve_x`` (derived from its declaration)."""
    return SETTINGS_BY_NAME[name].remedy


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
    from pytest_pdserve.gpu_plan import shared_utilization_problem

    problem = shared_utilization_problem(util, 2)  # the default cluster: 1 prefill + 1 decode
    if problem is not None:
        s = SETTINGS_BY_NAME["gpu_memory_utilization"]
        why = "--pd-share-gpus" if values["share_gpus"] else "the same prefill and decode GPU ids"
        raise _usage(s, util, sources["gpu_memory_utilization"], f"with {why}, {problem}")


# --------------------------------------------------------------------------- inventory (lazy)


class _InventoryHolder:
    """Detects the inventory once, in a background thread started at configure time.

    nvidia-smi takes tens of milliseconds to seconds; running it while pytest loads conftests keeps
    that off the critical path, and callers that never ask for the inventory never wait for it.
    A crash in detection is kept and raised to every caller: turning it into a CPU inventory would
    skip every GPU test and leave CI green on a broken GPU machine.
    """

    def __init__(self, detect: Callable[[], Inventory], what: str) -> None:
        self._detect = detect
        self._what = what
        self._result: Inventory | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pdserve-inventory", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._detect()
        except Exception as exc:  # re-raised by get(), in the caller's thread
            self._error = exc

    def get(self) -> Inventory:
        self._thread.join()
        if self._error is not None:
            raise pytest.UsageError(
                f"pdserve: GPU detection ({self._what}) crashed: {_where_raised(self._error)}. Fix the GPU "
                "stack (nvidia-smi / amd-smi must answer), or set --pd-platform=cpu (PDSERVE_PLATFORM=cpu) "
                "to run without GPUs"
            ) from self._error
        assert self._result is not None
        return self._result


def _where_raised(exc: BaseException) -> str:
    """``TypeError: msg (at inventory.py:123 in parse_x)``: the error and the innermost frame that raised it."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return f"{type(exc).__name__}: {exc}"
    code = tb.tb_frame.f_code
    return f"{type(exc).__name__}: {exc} (at {Path(code.co_filename).name}:{tb.tb_lineno} in {code.co_name})"


_INVENTORY = pytest.StashKey[_InventoryHolder]()


def start_inventory_detection(config: pytest.Config) -> None:
    """Begin detecting the inventory for *config* (idempotent); needs PDSERVE_CONFIG set."""
    if _INVENTORY in config.stash:
        return
    cfg = config.stash[PDSERVE_CONFIG]
    if cfg.simulate_gpus is not None:
        plat, count = cfg.simulate_gpus
        src = cfg.sources["simulate_gpus"]
        where = f"{src}={plat}:{count}" if src.startswith("--") else f"{_describe_source(src)}={plat}:{count}"
        inv = simulated_inventory(plat, count, f"simulated via {where}")
        config.stash[_INVENTORY] = _InventoryHolder(lambda: inv, "simulated")
    else:
        platform = cfg.platform
        config.stash[_INVENTORY] = _InventoryHolder(lambda: detect_inventory(platform), f"platform {platform}")
    if (cfg.prefill_gpu_ids is not None or cfg.decode_gpu_ids is not None) and not cfg.attach_mode:
        get_inventory(config)  # explicit GPU ids are checked against the inventory now, at configure time


def get_inventory(config: pytest.Config) -> Inventory:
    """The platform and GPU inventory for this session (detected at most once, cached).

    :raises pytest.UsageError: detection crashed, or an explicit GPU id is not in the inventory.
    """
    start_inventory_detection(config)
    inventory = config.stash[_INVENTORY].get()
    cfg = config.stash[PDSERVE_CONFIG]
    if (cfg.prefill_gpu_ids is not None or cfg.decode_gpu_ids is not None) and not cfg.attach_mode:
        from pytest_pdserve.gpu_plan import explicit_ids_problem

        problem = explicit_ids_problem(inventory, cfg.prefill_gpu_ids, cfg.decode_gpu_ids)
        if problem is not None:
            given = " and ".join(
                f"{cfg.source_of(n)}={','.join(map(str, getattr(cfg, n)))}"
                for n in ("prefill_gpu_ids", "decode_gpu_ids") if getattr(cfg, n) is not None
            )  # fmt: skip
            raise pytest.UsageError(f"pdserve: {problem} (given by {given})")
    return inventory
