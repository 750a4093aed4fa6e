"""The command builder: a `ClusterSpec` plus session settings -> the argv and env of each `vllm serve`,
and of the proxy.

argv is always a list (never a shell string), so a hostile value in the extra args stays one element.
Order follows vLLM's own P/D scripts: fixed flags first, then the session's ``VLLM_SERVE_EXTRA_ARGS``, then
the spec's extra args, then the role's. The flags pdserve sets itself cannot be overridden there
(`owned_flags`); the spec/session merge is `effective.effective`. The API key never goes on argv (``ps``
shows argv to every local user): servers read ``VLLM_API_KEY``, as vLLM does
(``entrypoints/serve/middleware/register.py``: ``args.api_key or [envs.VLLM_API_KEY]``).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pytest_pdserve.common.redaction import redact_env
from pytest_pdserve.config.effective import AskedConfig, Role, SessionDefaults
from pytest_pdserve.engines import vllm_compat
from pytest_pdserve.engines.engine import EngineInfo
from pytest_pdserve.spec import ClusterSpec

__all__ = [
    "PROXY_LIST_PLACEHOLDERS",
    "AskedConfig",
    "PROXY_PLACEHOLDERS",
    "EngineInfo",
    "ProxyCommand",
    "Role",
    "ServerCommand",
    "ServerPorts",
    "SessionDefaults",
    "build_proxy_command",
    "build_server_command",
    "kv_transfer_config",
    "proxy_placeholder_problems",
]

#: vLLM's default for VLLM_NIXL_SIDE_CHANNEL_HOST is "localhost", which may resolve to ::1 while the
#: listener binds IPv4 (toy_proxy_server.py's comment: "localhost binds to IPv6 which is blocked on CI").
SIDE_CHANNEL_HOST = "127.0.0.1"
#: vLLM scans upwards from VLLM_PORT for its internal ports (TCPStore, ZMQ); a private window per server
#: stops two engines from racing for the same port (vLLM PR #49129, issue #43206).
VLLM_PORT_WINDOW = 16


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

    def __repr__(self) -> str:
        # Redacted: a repr lands in assertion messages and --showlocals output, and env carries VLLM_API_KEY.
        env = redact_env(self.env)
        return f"ServerCommand(role={self.role!r}, index={self.index}, argv={self.argv!r}, env={env!r})"


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
    asked: AskedConfig,
    gpu_env: Mapping[str, str | None],
    platform_env: Mapping[str, str] | None = None,
    platform_args: tuple[str, ...] = (),
    host: str = "127.0.0.1",
) -> ServerCommand:
    """Build one server's argv and env. Pure: same inputs, same output (tested against vLLM's argparse).

    :param asked: ``spec`` merged with the session (``effective.effective(spec, defaults)``), made once per cluster
        by the caller and shared by its servers.
    """
    tp = spec.prefill_tp if role == "prefill" else spec.decode_tp
    backend, block_size = asked.attention_backend, asked.block_size
    util, max_len = asked.gpu_memory_utilization, asked.max_model_len

    argv: list[str] = [*engine.argv_prefix, "serve", model, "--host", host, "--port", str(ports.http)]
    argv += ["--kv-transfer-config", kv_transfer_config(spec, role, engine, asked.platform)]
    if backend is not None and vllm_compat.supports_attention_backend_flag(engine.version):
        # The same backend on P and D: the NIXL handshake's compatibility hash includes it.
        argv += ["--attention-backend", backend]
    argv += ["--block-size", str(block_size)]
    if util is not None:
        argv += ["--gpu-memory-utilization", f"{util:g}"]
    if max_len is not None:
        argv += ["--max-model-len", str(max_len)]
    if asked.enforce_eager:
        argv.append("--enforce-eager")
    argv += ["--seed", str(asked.seed)]
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
    argv += asked.extra_args(role)

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
    if engine.name == "sim":
        env["PDSERVE_SIM_PLATFORM"] = asked.platform  # the simulator follows the session's platform rules
    env.update(spec.env)  # ClusterSpec refuses the variables set above that it may not replace (owned_flags)
    env.update(spec.prefill_env if role == "prefill" else spec.decode_env)
    # None removes an inherited key: a server must require a key exactly when the clients know it.
    env["VLLM_API_KEY"] = asked.api_key
    return ServerCommand(role=role, index=index, argv=tuple(argv), env=env)


#: ``--pd-proxy-command`` placeholders substituted inside an element.
PROXY_PLACEHOLDERS = ("{port}", "{python}")
#: ``--pd-proxy-command`` placeholders that must be a whole element; each expands to one element per server.
PROXY_LIST_PLACEHOLDERS = ("{prefill_hosts}", "{prefill_ports}", "{decode_hosts}", "{decode_ports}")
_PLACEHOLDER = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}")


@dataclass(frozen=True)
class ProxyCommand:
    """What to run for the proxy: argv, the env it adds, and the path its readiness is checked on."""

    argv: tuple[str, ...]
    env: Mapping[str, str | None]
    health_path: str


def proxy_placeholder_problems(template: Sequence[str]) -> list[str]:
    """What is wrong with the placeholders of a ``--pd-proxy-command`` template (empty: nothing)."""
    problems = []
    for element in template:
        for name in _PLACEHOLDER.findall(element):
            if name in PROXY_LIST_PLACEHOLDERS and element != name:
                problems.append(f"{name} must be a whole argument (it expands to one per server), not {element!r}")
            elif name not in PROXY_PLACEHOLDERS and name not in PROXY_LIST_PLACEHOLDERS:
                known = ", ".join((*PROXY_PLACEHOLDERS, *PROXY_LIST_PLACEHOLDERS))
                problems.append(f"unknown placeholder {name} in {element!r} (known: {known})")
    return problems


def build_proxy_command(
    template: tuple[str, ...] | None,
    port: int,
    prefill: Sequence[tuple[str, int, str]],
    decode: Sequence[tuple[str, int, str]],
    api_key: str | None,
) -> ProxyCommand:
    """argv and env of the proxy; *prefill* / *decode* are ``(host, port, url)`` per server.

    The built-in proxy gets ``--host 127.0.0.1``, the servers' URLs and, in its environment, the API key
    (``VLLM_API_KEY``). A user command (``--pd-proxy-command``) is an argv template: ``{port}`` and
    ``{python}`` are substituted inside elements, and an element that is exactly ``{prefill_hosts}``,
    ``{prefill_ports}``, ``{decode_hosts}`` or ``{decode_ports}`` expands to one element per server,
    matching vLLM's ``toy_proxy_server.py`` flags; it gets the key as ``VLLM_API_KEY`` and
    ``OPENAI_API_KEY`` (what ``toy_proxy_server.py`` sends upstream). Its readiness is checked on
    ``/healthcheck``.
    """
    env: dict[str, str | None] = {"VLLM_API_KEY": api_key}
    if template is None:
        argv = [sys.executable, "-m", "pytest_pdserve.proxy", "--host", "127.0.0.1", "--port", str(port)]
        for _host, _port, url in prefill:
            argv += ["--prefill", url]
        for _host, _port, url in decode:
            argv += ["--decode", url]
        return ProxyCommand(tuple(argv), env, "/health")
    env["OPENAI_API_KEY"] = api_key
    lists = {
        "{prefill_hosts}": [h for h, _p, _u in prefill],
        "{prefill_ports}": [str(p) for _h, p, _u in prefill],
        "{decode_hosts}": [h for h, _p, _u in decode],
        "{decode_ports}": [str(p) for _h, p, _u in decode],
    }
    out: list[str] = []
    for element in template:
        if element in lists:
            out += lists[element]
        else:
            out.append(element.replace("{port}", str(port)).replace("{python}", sys.executable))
    return ProxyCommand(tuple(out), env, "/healthcheck")
