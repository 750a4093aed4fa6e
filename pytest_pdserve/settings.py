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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from pytest_pdserve.extra_args import ExtraArgsError, find_flag, parse_extra_args
from pytest_pdserve.inventory import (
    Inventory,
    InventoryError,
    Platform,
    detect_inventory,
    parse_simulate_gpus,
    simulated_inventory,
)

__all__ = [
    "PDSERVE_CONFIG",
    "SETTINGS",
    "PDServeConfig",
    "Setting",
    "add_options",
    "get_inventory",
    "resolve",
    "resolve_engine",
    "start_inventory_detection",
]

DEFAULT_LEASE_DIR = Path("/tmp/pytest-pdserve/leases")
VLLM_MODULE_ENTRYPOINT = ("-m", "vllm.entrypoints.cli.main")
"""``python -m`` target used when the vllm package is importable but no ``vllm`` script is found."""


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


def _str(text: str) -> str:
    return text.strip()


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SettingError("accepted values: 1/0, true/false, yes/no, on/off")


def _positive_int(text: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise SettingError("expected a whole number > 0") from None
    if value <= 0:
        raise SettingError("expected a whole number > 0")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise SettingError("expected a whole number >= 0") from None
    if value < 0:
        raise SettingError("expected a whole number >= 0")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise SettingError("expected a number of seconds > 0") from None
    if not value > 0 or value == float("inf"):
        raise SettingError("expected a number of seconds > 0")
    return value


def _utilization(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise SettingError("expected a fraction in (0, 1], e.g. 0.2") from None
    if not 0 < value <= 1:
        raise SettingError("expected a fraction in (0, 1], e.g. 0.2")
    return value


def _gpu_ids(text: str) -> tuple[int, ...]:
    pieces = [p.strip() for p in text.split(",")]
    accepted = "expected GPU indices >= 0 separated by commas, e.g. 0 or 0,1"
    if not pieces or any(not p.isdigit() for p in pieces):
        raise SettingError(accepted)
    ids = tuple(int(p) for p in pieces)
    if len(set(ids)) != len(ids):
        raise SettingError(f"an index is repeated; {accepted}")
    return ids


_BACKEND_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


def _attention_backend(text: str) -> str:
    value = text.strip()
    if not _BACKEND_RE.match(value):
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
    return argv


def _url(text: str) -> str:
    value = text.strip()
    parsed = urllib.parse.urlsplit(value)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise SettingError("expected an http:// or https:// URL with a host, e.g. http://127.0.0.1:8100")
    try:
        parsed.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise SettingError("the port is not a number in 0-65535") from None
    return value.rstrip("/")


def _urls(text: str) -> tuple[str, ...]:
    return tuple(_url(p) for p in re.split(r"[,\s]+", text) if p)


def _simulate(text: str) -> str:
    # Cross-checked against the platform in resolve(); here only the shape.
    try:
        parse_simulate_gpus(text)
    except InventoryError as exc:
        raise SettingError(str(exc)) from None
    return text.strip()


# --------------------------------------------------------------------------- the table

Kind = Literal["value", "bool", "append"]


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


SETTINGS: tuple[Setting, ...] = (
    Setting("engine", "Server engine: vllm, sim (built-in simulator) or auto (vllm when installed)",
            _choice("vllm", "sim", "auto"), "auto", metavar="ENGINE"),
    Setting("model", "Model served by prefill and decode (default: the engine's test model)", _str, None,
            metavar="MODEL"),
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
    Setting("gpu_memory_utilization", "vLLM --gpu-memory-utilization, a fraction in (0, 1]",
            _utilization, None, env="GPU_MEMORY_UTILIZATION", metavar="FRACTION"),
    Setting("block_size", "vLLM --block-size", _positive_int, None, metavar="N"),
    Setting("max_model_len", "vLLM --max-model-len", _positive_int, None, metavar="N"),
    Setting("enforce_eager", "Pass --enforce-eager to vLLM (default: on)", _bool, True, kind="bool"),
    Setting("seed", "vLLM --seed", _seed, 0, metavar="N"),
    Setting("startup_timeout", "Seconds a server may take to become ready", _seconds, 1200.0,
            metavar="SECONDS"),
    Setting("shutdown_timeout", "Seconds between SIGTERM and SIGKILL when stopping a server", _seconds,
            30.0, metavar="SECONDS"),
    Setting("log_dir", "Directory for server logs (default: under pytest's basetemp)", _str, None,
            metavar="DIR"),
    Setting("platform", "GPU platform: auto (detect), cuda, rocm or cpu",
            _choice("auto", "cuda", "rocm", "cpu"), "auto", metavar="PLATFORM"),
    Setting("simulate_gpus", "Simulate N GPUs (N, cuda:N or rocm:N) for marker skips and leasing on CPU CI",
            _simulate, None, metavar="SPEC"),
    Setting("gpu_wait", "When no GPU is free: wait for one, or skip the test", _choice("wait", "skip"),
            "wait", metavar="MODE"),
    Setting("gpu_wait_timeout", "Seconds to wait for a free GPU", _seconds, 1800.0, metavar="SECONDS"),
    Setting("vllm_executable", "vllm executable: a path, or a name looked up next to python and on PATH",
            _str, "vllm", metavar="PATH"),
    Setting("proxy_command", "P/D proxy command (shell-quoted argv template; default: built-in proxy)",
            _command, None, metavar="COMMAND"),
    Setting("api_key", "API key the servers require (vLLM --api-key)", _str, None, metavar="KEY"),
    Setting("lease_dir", "Machine-wide directory for GPU and port lease files", _str, DEFAULT_LEASE_DIR,
            metavar="DIR"),
    Setting("prefill_urls", "Attach to a running prefill server instead of starting one (repeatable)",
            _urls, (), kind="append", cli="--pd-prefill-url", metavar="URL"),
    Setting("decode_urls", "Attach to a running decode server instead of starting one (repeatable)",
            _urls, (), kind="append", cli="--pd-decode-url", metavar="URL"),
    Setting("proxy_url", "Attach to a running P/D proxy", _url, None, cli="--pd-proxy-url", metavar="URL"),
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
    api_key: str | None
    lease_dir: Path
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    proxy_url: str | None
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


def _raw(config: pytest.Config, s: Setting, environ: Mapping[str, str]) -> tuple[Any, str]:
    """(raw value, source) for *s*: CLI > env > ini > default, each layer tested with ``is None``."""
    cli: Any = config.getoption(s.dest)
    if cli is not None:
        return (",".join(cli) if isinstance(cli, list) else cli), s.flag
    env = environ.get(s.env_var)
    if env is not None and env.strip():
        return env, f"${s.env_var}"
    ini: Any = config.getini(s.ini_key)
    if ini is not None and _ini_text(ini).strip():
        return _ini_text(ini), f"ini {s.ini_key}"
    return s.default, "default"


def _usage(setting: Setting, raw: Any, source: str, why: str) -> pytest.UsageError:
    return pytest.UsageError(f"pdserve: {raw!r} from {_describe_source(source)} is not a valid "
                             f"{setting.name}: {why}")  # fmt: skip


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
    for s in SETTINGS:
        raw, source = _raw(config, s, env)
        sources[s.name] = source
        if source == "default" or isinstance(raw, bool):
            values[s.name] = raw
            continue
        try:
            values[s.name] = s.parse(raw)
        except SettingError as exc:
            raise _usage(s, raw, source, str(exc)) from None
    for name in _PATH_SETTINGS:
        if sources[name] != "default" and values[name] is not None:
            path = Path(values[name]).expanduser()
            values[name] = path if path.is_absolute() else _base_dir(config, sources[name]) / path
    _check_attention_backend(values, sources)
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
    )


def _check_attention_backend(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    backend = values["attention_backend"]
    if backend is None:
        return
    extra: Sequence[str] = values["vllm_serve_extra_args"]
    clash = find_flag(extra, "--attention-backend") or find_flag(extra, "--attention-config.backend")
    if clash is None:
        return
    raise pytest.UsageError(
        f"pdserve: the attention backend is given twice: {backend!r} from "
        f"{_describe_source(sources['attention_backend'])} and {clash!r} inside the extra args from "
        f"{_describe_source(sources['vllm_serve_extra_args'])}; give it in one place only "
        "(--attention-backend / ATTENTION_BACKEND, or the extra args)"
    )


# --------------------------------------------------------------------------- inventory (lazy)


class _InventoryHolder:
    """Detects the inventory once, in a background thread started at configure time.

    nvidia-smi takes tens of milliseconds to seconds; running it while pytest loads conftests keeps
    that off the critical path, and callers that never ask for the inventory never wait for it.
    """

    def __init__(self, detect: Callable[[], Inventory]) -> None:
        self._detect = detect
        self._result: Inventory | None = None
        self._thread = threading.Thread(target=self._run, name="pdserve-inventory", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._detect()
        except Exception as exc:  # detection must never break the session
            self._result = Inventory("cpu", (), None, f"GPU detection failed: {exc!r}")

    def get(self) -> Inventory:
        self._thread.join()
        assert self._result is not None
        return self._result


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
        config.stash[_INVENTORY] = _InventoryHolder(lambda: inv)
        return
    platform = cfg.platform
    config.stash[_INVENTORY] = _InventoryHolder(lambda: detect_inventory(platform))


def get_inventory(config: pytest.Config) -> Inventory:
    """The platform and GPU inventory for this session (detected at most once, cached)."""
    start_inventory_detection(config)
    return config.stash[_INVENTORY].get()
