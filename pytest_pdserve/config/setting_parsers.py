"""Value parsers for the settings table: each turns one raw text (a flag, an env var, an ini value) into a value.

A parser raises :class:`SettingError` saying what would be accepted; :func:`pytest_pdserve.config.settings.resolve`
adds which setting it was and where the value came from. Numbers take ASCII digits only, and bounds exist where a
larger value only costs memory or time (the others live with ClusterSpec, in spec.py).
"""

from __future__ import annotations

import re
import shlex
import shutil
import urllib.parse
from collections.abc import Callable
from typing import Any

from pytest_pdserve.common.digits import is_int, parse_float, parse_int
from pytest_pdserve.common.locale_text import os_text_problem
from pytest_pdserve.config.bounds import ATTENTION_BACKEND_RE
from pytest_pdserve.errors import ClusterSpecError, ExtraArgsError, InventoryError, SettingError

# The parsers below that need the cluster-description modules (commands, connector, presets -> spec, owned_flags,
# vllm_compat, packaging) or the lease machinery (port_leases -> lockfiles -> proctree) import them when the setting
# is given: loading them would be most of the plugin's import cost (docs/benchmarks.md), and a run that gives none
# of these settings (the default) never needs them.

__all__ = [
    "MAX_GPU_INDEX",
    "MAX_SIMULATED_GPUS",
    "MAX_VALUE_BYTES",
    "api_key",
    "attention_backend",
    "boolean",
    "check_raw",
    "choice",
    "command",
    "extra_args",
    "gpu_ids",
    "kv_connector_config",
    "number",
    "port",
    "preset",
    "seconds",
    "simulate_gpus",
    "text",
    "url",
    "urls",
    "utilization",
]

#: Bounds where a larger value only costs memory or time.
MAX_SIMULATED_GPUS = 1024
MAX_GPU_INDEX = 1023
#: Raw setting values longer than this (bytes) are refused before parsing (argv elements must stay < 128 KiB).
MAX_VALUE_BYTES = 64 * 1024


def choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise SettingError(f"accepted values: {', '.join(choices)}")
        return value

    return parse


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SettingError("accepted values: 1/0, true/false, yes/no, on/off")


def number(
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
        try:
            value = parse_int(text) if kind is int else parse_float(text)
        except ValueError:
            raise SettingError(expected) from None
        if value < low or (open_low and value == low) or value > high:
            raise SettingError(expected)
        return value

    return parse


seconds = number(float, 0, 86400, open_low=True, what=" of seconds")
utilization = number(float, 0, 1, open_low=True, what=" (a fraction in (0, 1], e.g. 0.2)")


def text(what: str, max_len: int = 4096) -> Callable[[str], str]:
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


def api_key(text: str) -> str:
    # It goes into an HTTP header (Authorization: Bearer KEY): 1-1024 printable ASCII characters, no spaces. Checked
    # without a regex: compiling one at import costs every run that loads the plugin, and few give a key.
    value = text.strip()
    if not (1 <= len(value) <= 1024 and all("\x21" <= c <= "\x7e" for c in value)):
        raise SettingError("expected 1-1024 printable ASCII characters without spaces (it is sent as an HTTP header)")
    return value


def gpu_ids(text: str) -> tuple[int, ...]:
    pieces = [p.strip() for p in text.split(",")]
    accepted = f"expected GPU indices >= 0 (at most {MAX_GPU_INDEX}) separated by commas, e.g. 0 or 0,1"
    if not pieces or any(not is_int(p) or int(p) > MAX_GPU_INDEX for p in pieces):
        raise SettingError(accepted)
    ids = tuple(parse_int(p) for p in pieces)
    if len(set(ids)) != len(ids):
        raise SettingError(f"an index is repeated; {accepted}")
    return ids


def attention_backend(text: str) -> str:
    value = text.strip()
    if not ATTENTION_BACKEND_RE.fullmatch(value):
        raise SettingError("expected a vLLM attention backend name such as FLASH_ATTN, TRITON_ATTN or auto")
    return value


def extra_args(text: str) -> tuple[str, ...]:
    # Lazy: every module loaded costs each run (assertion rewriting included); extra_args.py only when given.
    from pytest_pdserve.config.extra_args import parse_extra_args

    try:
        return parse_extra_args(text)
    except ExtraArgsError as exc:
        raise SettingError(str(exc)) from None


def command(text: str) -> tuple[str, ...]:
    try:
        argv = tuple(shlex.split(text))
    except ValueError as exc:
        raise SettingError(f"cannot split it as a shell command ({exc}); balance the quotes") from None
    if not argv:
        raise SettingError("expected a command line, e.g. 'python my_proxy.py --port {port}'")
    # Lazy: commands.py pulls in spec, presets, owned_flags and packaging (~75 M instructions, see the top).
    from pytest_pdserve.config.commands import proxy_placeholder_problems

    problems = proxy_placeholder_problems(argv)
    if problems:
        raise SettingError("; ".join(problems))
    program = argv[0]
    if program != "{python}" and shutil.which(program) is None:
        raise SettingError(f"the program {program!r} is not an executable file, nor on PATH")
    return argv


def url(text: str) -> str:
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


def urls(text: str) -> tuple[str, ...]:
    return tuple(url(p) for p in re.split(r"[,\s]+", text) if p)


def simulate_gpus(text: str) -> str:
    # Cross-checked against the platform in resolve(); here only the shape, digits and the bound.
    count = text.strip().rpartition(":")[2].strip()
    if not is_int(count):
        raise SettingError("use N, cuda:N or rocm:N with N a whole number >= 0 (digits 0-9 only)")
    if int(count) > MAX_SIMULATED_GPUS:
        raise SettingError(f"at most {MAX_SIMULATED_GPUS} GPUs can be simulated")
    # Lazy: inventory.py costs each run that loads it; only --pd-simulate-gpus needs it here.
    from pytest_pdserve.machine.inventory import parse_simulate_gpus

    try:
        parse_simulate_gpus(text)
    except InventoryError as exc:
        raise SettingError(str(exc)) from None
    return text.strip()


def preset(text: str) -> str:
    # Lazy: presets.py builds tables at import; only --pd-preset needs it.
    from pytest_pdserve.config.presets import PRESETS

    value = text.strip()
    if value not in PRESETS and value != "auto":
        raise SettingError(f"accepted values: auto (from the module names), {', '.join(PRESETS)}")
    return value


def kv_connector_config(text: str) -> str:
    # Lazy: connector.py imports spec.py (with presets and owned_flags), which a run without this setting never needs.
    from pytest_pdserve.config.connector import parse_kv_connector_config

    try:
        parse_kv_connector_config(text)
    except ClusterSpecError as exc:
        raise SettingError(str(exc)) from None
    return text.strip()


def port(text: str) -> int:
    try:
        value = parse_int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 65535:
        raise SettingError("expected a port number in 1-65535, e.g. 8192 (digits 0-9 only)")
    return value


def port_range(text: str) -> tuple[int, int]:
    # Lazy: port_leases.py loads lockfiles and proctree, which a run without this setting loads only to lease ports.
    from pytest_pdserve.machine.port_leases import parse_port_range

    try:
        return parse_port_range(text)
    except ValueError as exc:
        raise SettingError(str(exc)) from None


def check_raw(raw: Any) -> None:
    """What no setting accepts: NUL bytes, undecodable bytes, huge values."""
    text = raw if isinstance(raw, str) else str(raw)
    if "\x00" in text:
        raise SettingError("it contains a NUL byte")
    problem = os_text_problem(text)  # the locale's doing names the locale (common/locale_text.py)
    if problem is not None:
        raise SettingError(problem)
    size = len(text.encode("utf-8"))
    if size > MAX_VALUE_BYTES:
        raise SettingError(f"it is {size} bytes long; the limit is {MAX_VALUE_BYTES}")
