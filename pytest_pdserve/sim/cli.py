"""``vllm serve``-compatible command line of the simulator (stdlib only, imported before anything heavy).

Flag names, value types and argparse error wording follow vLLM 0.34 so that the plugin's command
builder can hand the simulator exactly the argv it hands ``vllm serve``. Errors that vLLM reports from
argparse (unknown flags, bad ``--kv-transfer-config`` JSON, bad choices) exit with status 2 and the
``vllm serve: error: ...`` wording; errors vLLM reports later, while building the engine config (an
unknown ``--attention-backend``), are raised as :class:`ValueError` by :func:`resolve_attention_backend`
and turned into a non-zero exit at startup by the server module.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from pytest_pdserve.config.bounds import ATTENTION_BACKENDS
from pytest_pdserve.rules import connectors
from pytest_pdserve.rules.connectors import REGISTERED
from pytest_pdserve.rules.versions import DEFAULT_VLLM_VERSION
from pytest_pdserve.sim import environment_table

PROG = "vllm serve"
"""Program name in usage and error lines, as vLLM prints it."""

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
"""vLLM's default ``model_tag`` when none is given."""

DEFAULT_MAX_MODEL_LEN = 2048
"""The synthetic model's ``max_position_embeddings`` (the tiny Llama of vllm-cpu.md has 2048)."""

KV_CONNECTORS: tuple[str, ...] = tuple(sorted(REGISTERED.at(DEFAULT_VLLM_VERSION) or ()))
"""Connector names the vLLM version the simulator reports registers (`pytest_pdserve.rules.connectors.REGISTERED`,
the table by version); any other name needs ``kv_connector_module_path``."""

NIXL_CONNECTORS = connectors.NIXL_CONNECTORS
"""Connectors the simulator implements as pull-mode NIXL."""

SIMULATED_CONNECTORS = NIXL_CONNECTORS | {"OffloadingConnector"}
"""Connectors the simulator implements, alone or as children of a ``MultiConnector``."""

KV_ROLES = connectors.KV_ROLES
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_ds_mla", "fp8_e4m3", "fp8_e5m2", "fp8_inc")
EXECUTOR_BACKENDS = ("external_launcher", "mp", "ray", "uni")
UVICORN_LOG_LEVELS = ("critical", "debug", "error", "info", "trace", "warning")
#: Every value ``--mamba-cache-mode`` ever took: which ones the reported version takes is `pytest_pdserve.rules.mamba`
#: (the simulator exits as vLLM's argparse does for the others).
MAMBA_CACHE_MODES = ("all", "align", "none")

_HUMAN_INT = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgGtT])?(i?[bB])?$")


@dataclass(frozen=True)
class KVTransferConfig:
    """The subset of vLLM's ``KVTransferConfig`` the simulator uses (validated like vLLM's pydantic model)."""

    kv_connector: str
    kv_role: str | None = None
    engine_id: str | None = None
    kv_buffer_device: str = "cuda"
    kv_connector_extra_config: Mapping[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str = "fail"
    kv_port: int = 14579
    raw: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_nixl(self) -> bool:
        """True when the config carries a NIXL connector (directly or inside a MultiConnector)."""
        if self.kv_connector in NIXL_CONNECTORS:
            return True
        if self.kv_connector == "MultiConnector":
            children = self.kv_connector_extra_config.get("connectors", [])
            return any(isinstance(c, Mapping) and c.get("kv_connector") in NIXL_CONNECTORS for c in children)
        return False

    def _children(self) -> list[Mapping[str, Any]]:
        if self.kv_connector != "MultiConnector":
            return [{"kv_connector": self.kv_connector, "kv_connector_extra_config": self.kv_connector_extra_config}]
        children = self.kv_connector_extra_config.get("connectors", [])
        return [c for c in children if isinstance(c, Mapping)] if isinstance(children, list) else []

    @property
    def offloading_extra_config(self) -> Mapping[str, Any] | None:
        """The ``kv_connector_extra_config`` of the OffloadingConnector (alone or in a MultiConnector), or None."""
        for child in self._children():
            if child.get("kv_connector") == "OffloadingConnector":
                extra = child.get("kv_connector_extra_config") or {}
                return extra if isinstance(extra, Mapping) else {}
        return None

    def unsimulated(self) -> list[str]:
        """Connector names in this config that the simulator does not implement (refused at startup)."""
        if self.kv_connector == "MultiConnector" and not self._children():
            return ["MultiConnector without kv_connector_extra_config.connectors"]
        return [
            str(c.get("kv_connector")) for c in self._children() if c.get("kv_connector") not in SIMULATED_CONNECTORS
        ]

    @property
    def kv_lease_duration(self) -> float:
        """Seconds the prefill side keeps a finished request's blocks for the decode side (default 30)."""
        value = self.kv_connector_extra_config.get("kv_lease_duration", 30)
        return float(value)


@dataclass(frozen=True)
class ServeArgs:
    """Parsed ``serve`` arguments (vLLM names, snake_case)."""

    model: str
    host: str | None = None
    port: int = 8000
    served_model_name: tuple[str, ...] = ()
    api_key: str | None = None
    kv_transfer_config: KVTransferConfig | None = None
    attention_backend: str | None = None
    block_size: int = 16
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    enable_lora: bool = False
    enable_prefix_caching: bool = True
    seed: int = 0
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    dtype: str = "auto"
    mamba_cache_mode: str | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_sleep_mode: bool = False
    disable_log_stats: bool = False
    disable_log_requests: bool = False
    uvicorn_log_level: str = "info"
    enable_prompt_tokens_details: bool = False
    kv_cache_dtype: str = "auto"
    distributed_executor_backend: str | None = None
    revision: str | None = None
    tokenizer: str | None = None
    #: ``--hf-overrides``: config values that change the weights the server computes with (sim/kvcontent.py).
    hf_overrides: Mapping[str, Any] | None = None
    non_default: Mapping[str, Any] = field(default_factory=dict)

    @property
    def served_name(self) -> str:
        """The model id clients use: the first ``--served-model-name``, else MODEL."""
        return self.served_model_name[0] if self.served_model_name else self.model

    @property
    def effective_max_model_len(self) -> int:
        """``--max-model-len`` or the tiny model's context length (the engine uses the served model's own)."""
        return self.max_model_len if self.max_model_len is not None else DEFAULT_MAX_MODEL_LEN


class _VllmArgumentParser(argparse.ArgumentParser):
    """argparse with vLLM's error path (usage + ``vllm serve: error: ...`` on stderr, exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def human_readable_int(value: str) -> int:
    """vLLM's ``human_readable_int``: ``25.6k`` = 25600, ``1K``/``1KiB`` = 1024, ``8GiB`` = 8 * 2**30."""
    match = _HUMAN_INT.match(value.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid value {value!r}: expected an integer, optionally with a k/K, m/M, g/G or t/T suffix"
        )
    number, suffix, binary_tail = match.groups()
    if suffix is None:
        if "." in number or binary_tail:
            raise argparse.ArgumentTypeError(f"invalid value {value!r}: a plain number must be an integer")
        return int(number)
    power = "kmgt".index(suffix.lower()) + 1
    binary = suffix.isupper() or bool(binary_tail and binary_tail.lower().startswith("i"))
    return int(float(number) * ((1024 if binary else 1000) ** power))


def parse_kv_transfer_config(value: str) -> KVTransferConfig:
    """argparse ``type=`` of ``--kv-transfer-config``: a JSON object checked like ``KVTransferConfig``."""
    try:
        data = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON {value!r}: {exc}") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"{value!r} must be a JSON object (got {type(data).__name__})")

    def fail(key: str, accepted: str) -> NoReturn:
        raise argparse.ArgumentTypeError(f"{key}={data.get(key)!r} in {value!r} is invalid: expected {accepted}")

    connector = data.get("kv_connector")
    if not isinstance(connector, str) or not connector:
        fail("kv_connector", 'a connector name string, e.g. "NixlConnector"')
    role = data.get("kv_role")
    if role is not None and role not in KV_ROLES:
        fail("kv_role", " | ".join(KV_ROLES))
    engine_id = data.get("engine_id")
    if engine_id is not None and not isinstance(engine_id, str):
        fail("engine_id", "a string")
    buffer_device = data.get("kv_buffer_device", "cuda")
    if not isinstance(buffer_device, str):
        fail("kv_buffer_device", "a device type string (cuda, cpu, xpu)")
    extra = data.get("kv_connector_extra_config", {})
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        fail("kv_connector_extra_config", "a JSON object")
    policy = data.get("kv_load_failure_policy", "fail")
    if policy not in KV_LOAD_FAILURE_POLICIES:
        fail("kv_load_failure_policy", " | ".join(KV_LOAD_FAILURE_POLICIES))
    kv_port = data.get("kv_port", 14579)
    if not isinstance(kv_port, int) or isinstance(kv_port, bool):
        fail("kv_port", "an integer")
    lease = extra.get("kv_lease_duration", 30)
    if not isinstance(lease, (int, float)) or isinstance(lease, bool) or lease <= 0:
        raise argparse.ArgumentTypeError(
            f"kv_connector_extra_config.kv_lease_duration={lease!r} in {value!r} is invalid: expected seconds > 0"
        )
    return KVTransferConfig(
        kv_connector=connector,
        kv_role=role,
        engine_id=engine_id,
        kv_buffer_device=buffer_device,
        kv_connector_extra_config=extra,
        kv_load_failure_policy=policy,
        kv_port=kv_port,
        raw=data,
    )


def resolve_attention_backend(value: str | None) -> str | None:
    """vLLM's ``AttentionConfig.validate_backend_before``: case-insensitive member name, ``auto`` -> None.

    :raises ValueError: with vLLM's exact wording for an unknown name.
    """
    if value is None or value.lower() == "auto":
        return None
    name = value.upper()
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"Unknown attention backend: '{value}'. Valid options are: {', '.join(ATTENTION_BACKENDS)}")
    return name


def _json_object(value: str) -> dict[str, Any]:
    """A JSON object flag (vLLM's dict-typed fields: ``--hf-overrides``)."""
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r} is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"{value!r} is not a JSON object")
    return parsed


def _port(value: str) -> int:
    number = int(value)
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {value!r}: expected 0..65535")
    return number


_EPILOG = """\
The model: a local checkpoint directory is read (config.json: layers, KV heads, head size, dtype, context;
tokenizer.json, which needs 'pip install tokenizers'); known names (Qwen/Qwen3-0.6B, ...) have their shapes built in;
any other name gets the tiny Llama's shape and the built-in tokenizer.

Environment (read at startup; a bad value exits with status 2 and names the variable):
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``serve`` parser, named ``vllm serve`` like vLLM's."""
    p = _VllmArgumentParser(
        prog=PROG,
        usage=f"{PROG} [model_tag] [options]",
        description=(
            "Start pdserve-sim, a simulator of vLLM's OpenAI-compatible server (vLLM's flag names; flags vLLM has "
            "and the simulator does not model are accepted with no effect, as noted)."
        ),
        epilog=_EPILOG + environment_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        help=f"model name or local checkpoint directory (default {DEFAULT_MODEL}); see 'The model' below",
    )
    p.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    p.add_argument("--host", default=None, help="address to bind (default: all interfaces)")
    p.add_argument("--port", type=_port, default=8000, help="HTTP port (default: %(default)s)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--served-model-name", nargs="+", default=None, help="model id(s) clients use (default: MODEL)")
    p.add_argument(
        "--kv-transfer-config",
        type=parse_kv_transfer_config,
        default=None,
        metavar="JSON",
        help="KV connector: NixlConnector (pull), OffloadingConnector (cpu_bytes_to_use) or a MultiConnector of them",
    )
    p.add_argument(
        "--attention-backend",
        default=None,
        help="vLLM AttentionBackendEnum name (default: CPU_ATTN, FLASH_ATTN with PDSERVE_SIM_GPU=1)",
    )
    p.add_argument(
        "--block-size", type=int, default=None, help="tokens per KV block (default: vLLM's for its version, 64 on 0.34)"
    )
    p.add_argument(
        "--max-model-len",
        type=human_readable_int,
        default=None,
        help="context length (default: the model's; 1k/1K suffixes)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="KV cache share: 1 GiB at the default %(default)s, scaled linearly",
    )
    p.add_argument(
        "--enable-lora", action=argparse.BooleanOptionalAction, default=False, help="LoRA adapters may be loaded"
    )
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False, help="accepted (no effect)")
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="block prefix cache (default: on)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling (greedy output never depends on it)")
    p.add_argument(
        "--trust-remote-code", action=argparse.BooleanOptionalAction, default=False, help="accepted (no effect)"
    )
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="reported in kv_transfer_params")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="reported in kv_transfer_params")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="accepted; the simulator is DP rank 0")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="sizes KV bytes; auto: the checkpoint's, float32 served as bfloat16",
    )
    p.add_argument(
        "--mamba-cache-mode",
        choices=MAMBA_CACHE_MODES,
        default=None,
        help="all | align | none as the reported vLLM version takes them (0.33: a deprecated no-op)",
    )
    p.add_argument("--max-num-seqs", type=int, default=None, help="accepted (no effect)")
    p.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None, help="accepted (no effect)")
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=human_readable_int,
        default=None,
        help="KV cache size; blocks = bytes / (block size x KV bytes per token)",
    )
    p.add_argument(
        "--enable-sleep-mode",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="accepted; /sleep etc. exist in dev mode",
    )
    p.add_argument("--disable-log-stats", action="store_true", default=False, help="accepted (no effect)")
    p.add_argument(
        "--disable-log-requests", action="store_true", default=False, help="no per-request and access log lines"
    )
    p.add_argument("--enable-log-requests", action="store_true", default=False, help=argparse.SUPPRESS)
    p.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="info", help="uvicorn's log level")
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        default=False,
        help="usage.prompt_tokens_details.cached_tokens",
    )
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="KV element size (fp8*: 1 byte)")
    p.add_argument(
        "--distributed-executor-backend", choices=EXECUTOR_BACKENDS, default=None, help="accepted (no effect)"
    )
    p.add_argument("--revision", default=None, help="accepted (no effect)")
    p.add_argument(
        "--hf-overrides",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="model config values to override; changes the weights the KV is computed with",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="a tokenizer.json (or its directory) to tokenize with; needs 'pip install tokenizers'",
    )
    return p


def parse_serve_args(argv: Sequence[str]) -> ServeArgs:
    """Parse the arguments after ``serve``; argparse errors exit 2 like ``vllm serve``."""
    parser = build_parser()
    ns = parser.parse_args(list(argv))
    model = ns.model_tag if ns.model_tag is not None else ns.model_flag
    if model is None:
        model = DEFAULT_MODEL
    defaults = vars(parser.parse_args([]))
    non_default = {k: v for k, v in vars(ns).items() if v != defaults.get(k) and k not in {"model_tag", "model_flag"}}
    return ServeArgs(
        model=model,
        host=ns.host,
        port=ns.port,
        served_model_name=tuple(ns.served_model_name or ()),
        # vLLM: "--api-key option from CLI takes precedence over VLLM_API_KEY" (serve/middleware/register.py).
        api_key=ns.api_key if ns.api_key is not None else (os.environ.get("VLLM_API_KEY") or None),
        kv_transfer_config=ns.kv_transfer_config,
        attention_backend=ns.attention_backend,
        # Until the server knows its backend: vLLM's default is per version and backend (rules.block_size).
        block_size=ns.block_size if ns.block_size is not None else 16,
        max_model_len=ns.max_model_len,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        enforce_eager=ns.enforce_eager,
        enable_lora=ns.enable_lora,
        enable_prefix_caching=ns.enable_prefix_caching,
        seed=ns.seed,
        trust_remote_code=ns.trust_remote_code,
        tensor_parallel_size=ns.tensor_parallel_size,
        pipeline_parallel_size=ns.pipeline_parallel_size,
        data_parallel_size=ns.data_parallel_size,
        dtype=ns.dtype,
        mamba_cache_mode=ns.mamba_cache_mode,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        kv_cache_memory_bytes=ns.kv_cache_memory_bytes,
        enable_sleep_mode=ns.enable_sleep_mode,
        disable_log_stats=ns.disable_log_stats,
        disable_log_requests=ns.disable_log_requests and not ns.enable_log_requests,
        uvicorn_log_level=ns.uvicorn_log_level,
        enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
        kv_cache_dtype=ns.kv_cache_dtype,
        distributed_executor_backend=ns.distributed_executor_backend,
        revision=ns.revision,
        tokenizer=ns.tokenizer,
        hf_overrides=ns.hf_overrides,
        non_default=non_default,
    )
