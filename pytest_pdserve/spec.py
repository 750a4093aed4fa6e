"""`ClusterSpec`: what a test asks for, as a frozen, hashable value.

Equal specs share one running cluster (see `manager.ClusterManager`), so every field is immutable and
mappings are stored as sorted tuples. Build specs with keyword arguments; `env` and
`kv_connector_extra_config` accept plain dicts and are frozen on construction.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pytest_pdserve.common.locale_text import os_text_problem
from pytest_pdserve.config import owned_flags, presets

# Shared with the session settings (config/bounds.py: the settings table loads them without this module).
from pytest_pdserve.config.bounds import (
    ATTENTION_BACKEND_RE,
    MAX_BLOCK_SIZE,
    MAX_MODEL_LEN,
    server_keepalive_problem,
)
from pytest_pdserve.config.extra_args import parse_extra_args
from pytest_pdserve.errors import ClusterSpecError, ExtraArgsError
from pytest_pdserve.rules import connectors

#: vLLM's P/D scripts default to 128-token blocks (PREFILL_BLOCK_SIZE / DECODE_BLOCK_SIZE / BLOCK_SIZE), and
#: vLLM's CPU backend only supports 128, so one default keeps the arithmetic identical on every engine.
DEFAULT_BLOCK_SIZE = 128

KV_CONNECTORS = ("NixlConnector", "MultiConnector")
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")
MAMBA_CACHE_MODES = ("all", "align", "none")

MAX_TP = 64
MAX_SERVERS = 64
#: Linux rejects a single argv element or env string of 128 KiB or more (MAX_ARG_STRLEN) with a raw OSError.
MAX_ARG_BYTES = 128 * 1024 - 1
#: All extra args of one spec together (Linux refuses an argv + env over ARG_MAX, 2 MiB, with a raw OSError).
MAX_ARGS_TOTAL_BYTES = 1 << 20
#: Cluster names become log file names: no path separators, no leading dot.
NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+ -]{0,79}")


def argv_text_problem(value: str) -> str | None:
    """Why *value* cannot be one argv element or env string of a child process (None when it can)."""
    if "\x00" in value:
        return "it contains a NUL byte"
    problem = os_text_problem(value)  # the locale's doing names the locale (common/locale_text.py)
    if problem is not None:
        return problem
    size = len(value.encode("utf-8"))
    if size > MAX_ARG_BYTES:
        return f"it is {size} bytes long; the limit for one argument is {MAX_ARG_BYTES}"
    return None


def _freeze_env(env: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> tuple[tuple[str, str], ...]:
    items = env.items() if isinstance(env, Mapping) else (env or ())
    frozen = []
    for key, value in items:
        if not isinstance(key, str) or not key or "=" in key or argv_text_problem(key) is not None:
            raise ClusterSpecError(f"env key {key!r} is not a valid environment variable name")
        if not isinstance(value, str):
            raise ClusterSpecError(f"env value for {key} must be a string, got {type(value).__name__} {value!r}")
        if (problem := argv_text_problem(f"{key}={value}")) is not None:
            raise ClusterSpecError(f"env value for {key} cannot be passed to a server: {problem}")
        frozen.append((key, value))
    return tuple(sorted(frozen))


def _freeze_args(args: Iterable[str] | str | None, what: str) -> tuple[str, ...]:
    if args is None:
        return ()
    if isinstance(args, str):
        # A string here is almost always a mistake (it would become one argv element per character).
        raise ClusterSpecError(f"{what} must be a list of argv elements, not the string {args!r}")
    out = tuple(args)
    for a in out:
        if not isinstance(a, str):
            raise ClusterSpecError(f"{what} must hold strings, got {a!r}")
        if (problem := argv_text_problem(a)) is not None:
            raise ClusterSpecError(f"{what} element {a[:60]!r} cannot be passed to a server: {problem}")
    total = sum(len(a.encode("utf-8")) + 1 for a in out)
    if total > MAX_ARGS_TOTAL_BYTES:
        raise ClusterSpecError(f"{what} is {total} bytes in all; the limit is {MAX_ARGS_TOTAL_BYTES}")
    return out


def refuse_children(extra: Mapping[str, Any], where: str) -> None:
    """What every vLLM version refuses in a MultiConnector's children (a child without ``kv_role``), refused when
    the spec is built, in vLLM's words (`pytest_pdserve.rules.connectors`). pdserve sets the outer ``kv_role`` per
    server; each child keeps its own, as vLLM builds it (``kv_both`` in vLLM's scripts).

    :raises ClusterSpecError: naming the child.
    """
    config = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": dict(extra)}
    for refusal in connectors.any_version_refusals(config):
        child = (refusal.where or "").replace("kv_transfer_config.", f"{where}.", 1)
        raise ClusterSpecError(
            f"{child}: vLLM refuses it at start ({refusal.message}); give each MultiConnector child its own "
            f"kv_role (vLLM's scripts give kv_both). vLLM's rule: {refusal.source}"
        )


def _check_int(spec: ClusterSpec, attr: str, high: int, *, optional: bool) -> None:
    value = getattr(spec, attr)
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
        none = " or None" if optional else ""
        raise ClusterSpecError(f"ClusterSpec.{attr} must be a whole number from 1 to {high}{none}, got {value!r}")


def json_object(text: str, what: str, example: str = "") -> dict[str, Any]:
    """``text`` parsed as a JSON object; `ClusterSpecError` naming ``what`` (and an ``example``) otherwise."""
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        raise ClusterSpecError(f"{what} is not JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise ClusterSpecError(f"{what} must be a JSON object{f' such as {example}' if example else ''}")
    return parsed


@dataclass(frozen=True)
class ClusterSpec:
    """A P/D topology plus the per-cluster settings that make it different from the session defaults.

    ``None`` means "use the session setting" (CLI > env > ini > default), so a spec only states what it changes.
    """

    num_prefill: int = 1
    num_decode: int = 1
    #: "vllm" or "sim" to override --pd-engine for this cluster (the contract tests run both).
    engine: str | None = None
    prefill_tp: int = 1
    decode_tp: int = 1
    model: str | None = None
    #: Which tiny model to build when ``model`` is None and the engine is real vLLM: "llama" or "nemotronh".
    model_kind: str = "llama"
    attention_backend: str | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool | None = None
    mamba_cache_mode: str | None = None
    trust_remote_code: bool = False
    kv_connector: str = "NixlConnector"
    kv_buffer_device: str | None = None
    kv_load_failure_policy: str | None = None
    #: A dict or JSON text; stored as JSON text (so the spec stays hashable).
    kv_connector_extra_config: str | Mapping[str, Any] | None = None
    extra_args: tuple[str, ...] = ()
    prefill_extra_args: tuple[str, ...] = ()
    decode_extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    prefill_env: tuple[tuple[str, str], ...] = ()
    decode_env: tuple[tuple[str, str], ...] = ()
    #: This cluster's ``VLLM_SERVE_EXTRA_ARGS`` instead of the session's (None: the session's). A string is split
    #: as the variable is (comma or shell form).
    vllm_serve_extra_args: tuple[str, ...] | None = None
    #: ``--enforce-eager`` for this cluster (None: the session's ``--pd-enforce-eager``).
    enforce_eager: bool | None = None
    #: ``--seed`` for this cluster (None: the session's ``--pd-seed``).
    seed: int | None = None
    #: Free-form label shown in logs and the ready line.
    name: str = field(default="pd", compare=False)

    def __post_init__(self) -> None:
        for attr in ("num_prefill", "num_decode"):
            _check_int(self, attr, MAX_SERVERS, optional=False)
        for attr in ("prefill_tp", "decode_tp"):
            _check_int(self, attr, MAX_TP, optional=False)
        _check_int(self, "block_size", MAX_BLOCK_SIZE, optional=True)
        _check_int(self, "max_model_len", MAX_MODEL_LEN, optional=True)
        util = self.gpu_memory_utilization
        if util is not None and not (isinstance(util, (int, float)) and not isinstance(util, bool) and 0 < util <= 1):
            raise ClusterSpecError(f"ClusterSpec.gpu_memory_utilization must be in (0, 1], got {util!r}")
        if not (self.enforce_eager is None or isinstance(self.enforce_eager, bool)):
            raise ClusterSpecError(f"ClusterSpec.enforce_eager must be True, False or None, got {self.enforce_eager!r}")
        seed = self.seed
        if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**32):
            raise ClusterSpecError(f"ClusterSpec.seed must be a whole number from 0 to 2**32 - 1 or None, got {seed!r}")
        for attr in ("trust_remote_code",):
            if not isinstance(getattr(self, attr), bool):
                raise ClusterSpecError(f"ClusterSpec.{attr} must be True or False, got {getattr(self, attr)!r}")
        if not (self.enable_prefix_caching is None or isinstance(self.enable_prefix_caching, bool)):
            raise ClusterSpecError(
                f"ClusterSpec.enable_prefix_caching must be True, False or None, got {self.enable_prefix_caching!r}"
            )
        backend = self.attention_backend
        if backend is not None and not (isinstance(backend, str) and ATTENTION_BACKEND_RE.fullmatch(backend)):
            raise ClusterSpecError(
                f"ClusterSpec.attention_backend {backend!r} is not a vLLM attention backend name such as "
                "FLASH_ATTN or TRITON_ATTN"
            )
        model = self.model
        if model is not None and not (isinstance(model, str) and model.strip() and argv_text_problem(model) is None):
            raise ClusterSpecError(f"ClusterSpec.model must be a non-empty model name or path, got {model!r}")
        if self.kv_connector not in KV_CONNECTORS:
            raise ClusterSpecError(
                f"ClusterSpec.kv_connector {self.kv_connector!r} is not supported; use one of {KV_CONNECTORS}"
            )
        policy = self.kv_load_failure_policy
        if policy is not None and policy not in KV_LOAD_FAILURE_POLICIES:
            raise ClusterSpecError(
                f"ClusterSpec.kv_load_failure_policy {policy!r} is not one of {KV_LOAD_FAILURE_POLICIES}"
            )
        if self.mamba_cache_mode is not None and self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ClusterSpecError(
                f"ClusterSpec.mamba_cache_mode {self.mamba_cache_mode!r} is not one of {MAMBA_CACHE_MODES}"
            )
        if self.engine not in (None, "vllm", "sim"):
            raise ClusterSpecError(f"ClusterSpec.engine {self.engine!r} is not 'vllm', 'sim' or None")
        if self.model_kind not in ("llama", "nemotronh"):
            raise ClusterSpecError(f"ClusterSpec.model_kind {self.model_kind!r} is not 'llama' or 'nemotronh'")
        if not (isinstance(self.name, str) and NAME_RE.fullmatch(self.name)):
            raise ClusterSpecError(
                f"ClusterSpec.name {self.name!r} must be 1-80 letters, digits, '_', '.', '+', '-' or spaces, not "
                "starting with '.', '-' or a space (it becomes part of the log file names)"
            )
        device = self.kv_buffer_device
        if device is not None and not (isinstance(device, str) and ATTENTION_BACKEND_RE.fullmatch(device)):
            raise ClusterSpecError(f"ClusterSpec.kv_buffer_device {device!r} is not a device name such as cpu or cuda")
        extra = self.kv_connector_extra_config
        if extra is not None and not isinstance(extra, str):
            if not isinstance(extra, Mapping):
                what = "ClusterSpec.kv_connector_extra_config"
                raise ClusterSpecError(f"{what} must be a dict or JSON text, got {extra!r}")
            try:
                text = json.dumps(extra, sort_keys=True, allow_nan=False)
            except (TypeError, ValueError) as exc:
                what = "ClusterSpec.kv_connector_extra_config"
                raise ClusterSpecError(f"{what} is not JSON-serialisable: {exc}") from None
            object.__setattr__(self, "kv_connector_extra_config", text)
        elif isinstance(extra, str):
            json_object(extra, "ClusterSpec.kv_connector_extra_config")
        if self.kv_connector == "MultiConnector" and self.kv_connector_extra_config is not None:
            refuse_children(self.extra_config() or {}, "ClusterSpec")
        for attr in ("env", "prefill_env", "decode_env"):
            object.__setattr__(self, attr, _freeze_env(getattr(self, attr)))
        for attr in ("extra_args", "prefill_extra_args", "decode_extra_args"):
            object.__setattr__(self, attr, _freeze_args(getattr(self, attr), f"ClusterSpec.{attr}"))
        session_args = self.vllm_serve_extra_args
        if session_args is not None:
            if isinstance(session_args, str):  # as VLLM_SERVE_EXTRA_ARGS is written: comma or shell form
                try:
                    session_args = parse_extra_args(session_args)
                except ExtraArgsError as exc:
                    raise ClusterSpecError(f"ClusterSpec.vllm_serve_extra_args: {exc}") from None
            frozen = _freeze_args(session_args, "ClusterSpec.vllm_serve_extra_args")
            object.__setattr__(self, "vllm_serve_extra_args", frozen)
        for attr in ("extra_args", "prefill_extra_args", "decode_extra_args", "vllm_serve_extra_args"):
            owned_flags.refuse(getattr(self, attr) or (), f"ClusterSpec.{attr}")
        for attr in ("env", "prefill_env", "decode_env"):
            owned_flags.check_env(dict(getattr(self, attr)), f"ClusterSpec.{attr}")
            if (problem := server_keepalive_problem(dict(getattr(self, attr)))) is not None:
                raise ClusterSpecError(f"ClusterSpec.{attr}: {problem}")

    @property
    def num_gpus(self) -> int:
        """GPUs the whole topology needs when every server has its own."""
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    def extra_config(self) -> dict[str, Any] | None:
        """`kv_connector_extra_config` as a dict."""
        extra = self.kv_connector_extra_config  # always JSON text after __post_init__
        if extra is None:
            return None
        return dict(json.loads(extra if isinstance(extra, str) else json.dumps(extra)))

    def with_(self, **changes: Any) -> ClusterSpec:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    @classmethod
    def hybrid_ssm(cls, **overrides: Any) -> ClusterSpec:
        """The hybrid-SSM (Mamba) prefix-cache setup of vLLM's ``run_mamba_prefix_cache_test.sh``.

        Env ``VLLM_SSM_CONV_STATE_LAYOUT=DS`` and ``VLLM_KV_CACHE_LAYOUT=HND`` on both servers, block size 128,
        ``--trust-remote-code`` and prefix caching on. No ``--mamba-cache-mode``: with prefix caching every vLLM
        version's default is the mode its own script asks for (0.26: ``all`` on NemotronH; 0.32 on: ``align``;
        `pytest_pdserve.rules.mamba`). A ``mamba_cache_mode`` given is passed as given; one the version refuses
        (``all`` from 0.32) is refused before the start in vLLM's words. vLLM for CPU 0.32 reads ``HND`` as its alias
        ``LBHNC`` (the ready line says so).
        """
        base: dict[str, Any] = {
            "model_kind": "nemotronh",
            "block_size": 128,
            "trust_remote_code": True,
            "enable_prefix_caching": True,
            "env": {"VLLM_SSM_CONV_STATE_LAYOUT": "DS", "VLLM_KV_CACHE_LAYOUT": "HND"},
            "name": "hybrid-ssm",
        }
        base.update(overrides)
        return cls(**base)

    @classmethod
    def preset(cls, name: str, /, *, engine: str = "sim", platform: str = "cpu", **overrides: Any) -> ClusterSpec:
        """The server configuration of one of vLLM's nixl_integration scripts (``"vllm-edge-case"``, ...).

        ``engine``/``platform`` say where it runs (vLLM's CPU backend gets a block size it can take); the
        environment variables the script honours are read from ``os.environ``. See `pytest_pdserve.config.presets`.
        """
        return presets.resolve(name, spec_type=cls, engine=engine, platform=platform, **overrides).spec
