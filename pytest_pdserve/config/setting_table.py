"""The settings table: one :class:`Setting` per setting, with its parser, default and help. [pytest-free]

Each :class:`Setting` derives its command-line flag (``--pd-<kebab>``), ini key (``pdserve_<snake>``) and
environment variable (``PDSERVE_<UPPER>``) from its name, with explicit overrides where vLLM's scripts already
use a name (``ATTENTION_BACKEND``, ``VLLM_SERVE_EXTRA_ARGS``, ``PREFILL_GPU_ID``, ...). The README options table
is generated from :data:`SETTINGS` (``python -m pytest_pdserve.config._options_table``);
:mod:`pytest_pdserve.config.settings` registers and resolves them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

from pytest_pdserve.config.bounds import MAX_BLOCK_SIZE, MAX_MODEL_LEN
from pytest_pdserve.config.setting_parsers import (
    api_key,
    attention_backend,
    boolean,
    choice,
    command,
    extra_args,
    gpu_ids,
    kv_connector_config,
    number,
    port,
    port_range,
    preset,
    seconds,
    simulate_gpus,
    text,
    url,
    urls,
    utilization,
)
from pytest_pdserve.machine.paths import DEFAULT_LEASE_DIR

__all__ = ["PATH_SETTINGS", "SETTINGS", "SETTINGS_BY_NAME", "Kind", "Setting", "remedy"]

#: How a setting appears on the command line: ``--pd-x VALUE``, ``--pd-x`` / ``--no-pd-x``, or repeatable. No kind
#: takes an *optional* value: argparse would hand such a flag the next word (``--pd-x test_a.py``), which the user
#: meant as a path for pytest (tests/config/test_settings.py walks every registered option to keep it so).
Kind = Literal["value", "bool", "append"]


class Setting(NamedTuple):
    """One setting: its name, parser and default; flag, ini key and env var derive from the name.

    A NamedTuple, not a frozen dataclass: immutable and equal the same way, and cheaper to define, which every run
    pays when the plugin loads."""

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
    #: The setting whose value, given, turns this flag on (``--pd-reuse-mode`` turns ``--pd-reuse`` on).
    implied_by: str | None = None

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
            choice("vllm", "sim", "auto"), "auto", metavar="ENGINE"),
    Setting("model", "Model served by prefill and decode (default: the engine's test model)",
            text("a model name or path"), None, metavar="MODEL"),
    Setting("attention_backend", "vLLM --attention-backend for both servers (P and D must match)",
            attention_backend, None, cli="--attention-backend", env="ATTENTION_BACKEND",
            metavar="BACKEND"),
    Setting("vllm_serve_extra_args",
            "Extra vllm serve arguments, comma form '--a,1,--b' or shell form \"--a 1 --b 'x y'\" "
            "(write --vllm-serve-extra-args=VALUE when VALUE starts with --)",
            extra_args, (), cli="--vllm-serve-extra-args", env="VLLM_SERVE_EXTRA_ARGS", metavar="ARGS"),
    Setting("prefill_gpu_ids", "GPU indices (in the visible list) for the prefill server, e.g. 0 or 0,1 "
            "(default: leased)", gpu_ids, None, env="PREFILL_GPU_ID", metavar="IDS"),
    Setting("decode_gpu_ids", "GPU indices (in the visible list) for the decode server (default: leased)",
            gpu_ids, None, env="DECODE_GPU_ID", metavar="IDS"),
    Setting("share_gpus", "Run every server of a cluster on one GPU, started one after another, each with "
            "--gpu-memory-utilization 0.4 unless given (TP 1 only)", boolean, False, kind="bool"),
    Setting("gpu_memory_utilization", "vLLM --gpu-memory-utilization, a fraction in (0, 1]",
            utilization, None, env="GPU_MEMORY_UTILIZATION", metavar="FRACTION"),
    Setting("block_size", "vLLM --block-size", number(int, 1, MAX_BLOCK_SIZE), None, metavar="N"),
    Setting("max_model_len", "vLLM --max-model-len", number(int, 1, MAX_MODEL_LEN), None, metavar="N"),
    Setting("enforce_eager", "Pass --enforce-eager to vLLM (default: on)", boolean, True, kind="bool"),
    Setting("seed", "vLLM --seed", number(int, 0, 2**32 - 1), 0, metavar="N"),
    Setting("startup_timeout", "Seconds a server may take to become ready", seconds, 1200.0,
            metavar="SECONDS"),
    Setting("shutdown_timeout", "Seconds between SIGTERM and SIGKILL when stopping a server",
            number(float, 0, 3600, open_low=True, what=" of seconds"), 30.0, metavar="SECONDS"),
    Setting("log_dir", "Directory for server logs (default: under pytest's basetemp)", text("a directory"),
            None, metavar="DIR"),
    Setting("platform", "GPU platform: auto (detect), cuda, rocm or cpu",
            choice("auto", "cuda", "rocm", "cpu"), "auto", metavar="PLATFORM"),
    Setting("simulate_gpus", "Simulate N GPUs (N, cuda:N or rocm:N) for marker skips and leasing on CPU CI",
            simulate_gpus, None, metavar="SPEC"),
    Setting("gpu_wait", "When no GPU is free: wait for one, or skip the test", choice("wait", "skip"),
            "wait", metavar="MODE"),
    Setting("gpu_wait_timeout", "Seconds to wait for a free GPU", seconds, 1800.0, metavar="SECONDS"),
    Setting("vllm_executable", "vllm executable: a path, or a name looked up next to python and on PATH",
            text("an executable name or path"), "vllm", metavar="PATH"),
    Setting("proxy_command", "P/D proxy command (shell-quoted argv template; default: built-in proxy)",
            command, None, metavar="COMMAND"),
    Setting("api_key", "API key the servers require (given to them as VLLM_API_KEY, never on argv)", api_key,
            None, metavar="KEY", secret=True),
    Setting("lease_dir", "Machine-wide directory for GPU and port lease files", text("a directory"),
            DEFAULT_LEASE_DIR, metavar="DIR"),
    Setting("prefill_urls", "Attach to a running prefill server instead of starting one (repeatable)",
            urls, (), kind="append", cli="--pd-prefill-url", metavar="URL"),
    Setting("decode_urls", "Attach to a running decode server instead of starting one (repeatable)",
            urls, (), kind="append", cli="--pd-decode-url", metavar="URL"),
    Setting("proxy_url", "Attach to a running P/D proxy", url, None, cli="--pd-proxy-url", metavar="URL"),
    Setting("export_env", "Start the session cluster before collection and export PREFILL_HOST/PORT, "
            "DECODE_HOST/PORT, PROXY_HOST/PORT, TEST_MODEL, BLOCK_SIZE, ... for vLLM's own test modules",
            boolean, False, kind="bool",
            implied_by="export_env_file"),
    Setting("export_env_file", "Also write the exported variables to FILE as `export` lines (turns "
            "--pd-export-env on); a file pdserve did not write is never overwritten", text("a file path"), None,
            metavar="FILE"),
    Setting("preset", "Server configuration of one of vLLM's nixl_integration scripts for the session cluster: "
            "vllm-edge-case, vllm-mamba-prefix-cache, vllm-multi-connector-edge-case, "
            "vllm-multi-connector-accuracy, vllm-accuracy, vllm-xpu-disagg, or auto (from the modules the paths name; "
            "none is a usage error)", preset,
            None, metavar="NAME"),
    Setting("kv_connector_config", "Connector of the session cluster, JSON: kv_connector (NixlConnector, or "
            "MultiConnector with kv_connector_extra_config.connectors), kv_buffer_device, "
            "kv_connector_extra_config; pdserve sets the outer kv_role per server, each MultiConnector child gives its "
            "own (kv_both in vLLM's scripts)", kv_connector_config, None, metavar="JSON"),
    Setting("proxy_port", "Port the session cluster's proxy listens on (leased; for modules that hard-code "
            "8192)", port, None, metavar="N"),
    Setting("port_range", "Lease every server and proxy port from LOW-HIGH (default: 20000 up to the kernel's "
            "ephemeral range; for firewalled hosts)", port_range, None, metavar="LOW-HIGH"),
    Setting("cache_salt", "Prefix-cache isolation: per-test (requests sent through the plugin carry the test's own "
            "vLLM cache_salt) or off (tests share one prefix cache)", choice("per-test", "off"), "per-test",
            metavar="MODE"),
    Setting("request_timeout", "Seconds one request through the plugin's clients may take", seconds, 600.0,
            metavar="SECONDS"),
    Setting("ready_check", "Hand out a cluster only after a request through the proxy moved KV into every decode "
            "server (P/D-ready, not only HTTP-ready)", boolean, True, kind="bool"),
    Setting("require_kv_transfer", "With --pd-export-env: fail the session when a test module that passed moved no "
            "KV from prefill to decode (decode's external_kv_transfer tokens and NIXL bytes both 0: a proxy that "
            "bypasses prefill passes that way); on under --pd-preset", boolean, False, kind="bool"),
    Setting("reuse", "Keep this run's clusters up when pytest ends and attach the next run with the same "
            "configuration to them (refused on CI unless --pd-reuse-mode=force); see `pdserve ls` and "
            "`pdserve stop --all`", boolean, False, kind="bool",
            implied_by="reuse_mode"),
    Setting("reuse_mode", "How --pd-reuse applies: local (not on CI: CI or BUILD_NUMBER set) or force (on CI too); "
            "giving it turns --pd-reuse on", choice("local", "force"), "local", metavar="MODE"),
    Setting("reuse_ttl", "Seconds a kept cluster may stay idle before its keeper stops it", seconds, 900.0,
            metavar="SECONDS"),
    Setting("reuse_dir", "Private directory for kept clusters' state and logs (default: "
            "${PDSERVE_CACHE_DIR:-~/.cache/pytest-pdserve}/reuse)", text("a directory"), None, metavar="DIR"),
)  # fmt: skip

SETTINGS_BY_NAME: Mapping[str, Setting] = {s.name: s for s in SETTINGS}
#: Settings that name a directory: relative values are resolved against the ini file or the invocation dir.
PATH_SETTINGS = ("log_dir", "lease_dir", "reuse_dir")


def remedy(name: str) -> str:
    """How to set setting *name*: ``--pd-x / PDSERVE_X / pdserve_x`` (derived from its declaration)."""
    return SETTINGS_BY_NAME[name].remedy
