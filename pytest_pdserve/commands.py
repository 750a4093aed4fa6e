"""The command builder: a `ClusterSpec` plus session settings -> the argv and env of each `vllm serve`.

argv is always a list (never a shell string), so a hostile value in the extra args stays one element.
Order follows vLLM's own P/D scripts: fixed flags first, then the session's ``VLLM_SERVE_EXTRA_ARGS``, then
the spec's extra args, then the role's, so a later (more specific) flag wins in vLLM's argparse.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pytest_pdserve import vllm_compat
from pytest_pdserve.spec import DEFAULT_BLOCK_SIZE, ClusterSpec

Role = Literal["prefill", "decode"]

#: vLLM's default for VLLM_NIXL_SIDE_CHANNEL_HOST is "localhost", which may resolve to ::1 while the
#: listener binds IPv4 (toy_proxy_server.py's comment: "localhost binds to IPv6 which is blocked on CI").
SIDE_CHANNEL_HOST = "127.0.0.1"
#: vLLM scans upwards from VLLM_PORT for its internal ports (TCPStore, ZMQ); a private window per server
#: stops two engines from racing for the same port (vLLM PR #49129, issue #43206).
VLLM_PORT_WINDOW = 16


@dataclass(frozen=True)
class EngineInfo:
    """Which server program runs: real vLLM or the simulator, and the vLLM version whose flags we speak."""

    name: Literal["vllm", "sim"]
    argv_prefix: tuple[str, ...]
    version: vllm_compat.Version
    #: Interpreter that owns the vLLM install (builds the tiny model); None for the simulator.
    python: str | None = None


@dataclass(frozen=True)
class ServerPorts:
    """Every port one server binds, all leased beforehand."""

    http: int
    side_channel: int
    vllm_port: int


@dataclass(frozen=True)
class ServerCommand:
    """What to run for one server."""

    role: Role
    index: int
    argv: tuple[str, ...]
    #: Only the variables pdserve sets; `None` removes a variable inherited from pytest's environment.
    env: Mapping[str, str | None]

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


@dataclass(frozen=True)
class SessionDefaults:
    """The session settings the builder needs (a narrow view of PDServeConfig, so this module stays pytest-free)."""

    attention_backend: str | None = None
    vllm_serve_extra_args: tuple[str, ...] = ()
    gpu_memory_utilization: float | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    enforce_eager: bool = True
    seed: int = 0
    api_key: str | None = None
    platform: str = "cpu"


def kv_transfer_config(spec: ClusterSpec, role: Role, engine: EngineInfo, platform: str) -> str:
    """The ``--kv-transfer-config`` JSON for one role, compact, with keys in vLLM's documented order."""
    producer, consumer = vllm_compat.kv_roles(engine.version)
    config: dict[str, object] = {
        "kv_connector": spec.kv_connector,
        "kv_role": producer if role == "prefill" else consumer,
    }
    buffer_device = spec.kv_buffer_device
    if buffer_device is None and platform == "cpu" and engine.name == "vllm":
        # vLLM's NIXL supports only a "cpu" KV buffer on the CPU platform (nixl/utils.py _NIXL_SUPPORTED_DEVICE).
        buffer_device = "cpu"
    if buffer_device is not None:
        config["kv_buffer_device"] = buffer_device
    if spec.kv_load_failure_policy is not None:
        config["kv_load_failure_policy"] = spec.kv_load_failure_policy
    extra = spec.extra_config()
    if extra is not None:
        config["kv_connector_extra_config"] = extra
    return json.dumps(config, separators=(",", ":"))


def build_server_command(
    *,
    spec: ClusterSpec,
    role: Role,
    index: int,
    model: str,
    ports: ServerPorts,
    engine: EngineInfo,
    defaults: SessionDefaults,
    gpu_env: Mapping[str, str | None],
    platform_env: Mapping[str, str] | None = None,
    platform_args: tuple[str, ...] = (),
    host: str = "127.0.0.1",
) -> ServerCommand:
    """Build one server's argv and env. Pure: same inputs, same output (tested against vLLM's argparse)."""
    tp = spec.prefill_tp if role == "prefill" else spec.decode_tp
    backend = spec.attention_backend if spec.attention_backend is not None else defaults.attention_backend
    block_size = spec.block_size or defaults.block_size or DEFAULT_BLOCK_SIZE
    util = spec.gpu_memory_utilization if spec.gpu_memory_utilization is not None else defaults.gpu_memory_utilization
    max_len = spec.max_model_len if spec.max_model_len is not None else defaults.max_model_len

    argv: list[str] = [*engine.argv_prefix, "serve", model, "--host", host, "--port", str(ports.http)]
    argv += ["--kv-transfer-config", kv_transfer_config(spec, role, engine, defaults.platform)]
    if backend is not None and vllm_compat.supports_attention_backend_flag(engine.version):
        # The same backend on P and D: the NIXL handshake's compatibility hash includes it.
        argv += ["--attention-backend", backend]
    argv += ["--block-size", str(block_size)]
    if util is not None:
        argv += ["--gpu-memory-utilization", f"{util:g}"]
    if max_len is not None:
        argv += ["--max-model-len", str(max_len)]
    if defaults.enforce_eager:
        argv.append("--enforce-eager")
    argv += ["--seed", str(defaults.seed)]
    if tp > 1:
        argv += ["--tensor-parallel-size", str(tp)]
    if spec.trust_remote_code:
        argv.append("--trust-remote-code")
    if spec.enable_prefix_caching is True:
        argv.append("--enable-prefix-caching")
    elif spec.enable_prefix_caching is False:
        argv.append("--no-enable-prefix-caching")
    argv += vllm_compat.mamba_cache_mode_args(spec.mamba_cache_mode, engine.version)
    # The platform's flags (cpu.py: --dtype float32) come before every user source, so a user's flag wins.
    argv += platform_args
    if defaults.api_key is not None:
        argv += ["--api-key", defaults.api_key]
    argv += defaults.vllm_serve_extra_args
    argv += spec.extra_args
    argv += spec.prefill_extra_args if role == "prefill" else spec.decode_extra_args

    env: dict[str, str | None] = {}
    env.update(platform_env or {})
    env.update(gpu_env)
    if backend is not None:
        # vLLM < 0.13 has no --attention-backend (argparse would reject it) and reads VLLM_ATTENTION_BACKEND.
        env.update(vllm_compat.attention_backend_env(backend, engine.version))
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = SIDE_CHANNEL_HOST
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(ports.side_channel)
    env["VLLM_PORT"] = str(ports.vllm_port)
    env["VLLM_HOST_IP"] = host
    # Dev mode exposes POST /reset_prefix_cache, which the cold-vs-warm determinism check needs.
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.update(spec.env)
    env.update(spec.prefill_env if role == "prefill" else spec.decode_env)
    return ServerCommand(role=role, index=index, argv=tuple(argv), env=env)


def redact(argv: tuple[str, ...] | list[str]) -> list[str]:
    """argv with the value after ``--api-key`` hidden, for logs and error messages."""
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a == "--api-key":
            out[i + 1] = "***"
    return out
