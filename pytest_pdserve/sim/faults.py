"""Environment knobs of the simulator (vLLM's own and ``PDSERVE_SIM_*``) and the fault helpers.

:class:`SimEnv` reads and validates every variable once at startup; a bad value stops the process
with a message naming the variable, the value and what is accepted. The helpers here implement the
faults that live outside the HTTP app: orphan-prone worker processes and the "hang" listener.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from pytest_pdserve.common.digits import parse_float, parse_int
from pytest_pdserve.config.bounds import SERVER_KEEPALIVE_ENV
from pytest_pdserve.rules.versions import DEFAULT_VLLM_VERSION, Release, parse_version

#: None by default: real vLLM 0.26.0 on an H200 with the project's tiny Llama gave identical tokens on FLASH_ATTN and
#: TRITON_ATTN for repeats, P/D against one server, cold against warm and batch sizes 1-16 (docs/hardware.md),
#: where the simulator's earlier default (FLASH_ATTN flips a token on every warm run) failed
#: tests/sim/test_contract.py's P/D-vs-single check that vLLM passed. Batch variance is a fault to ask for.
DEFAULT_NONDETERMINISTIC_BACKENDS: frozenset[str] = frozenset()
TIE_GAP = 1e-3
"""Nats between top-1 and top-2 at the tie position under ``PDSERVE_SIM_TIE_FLIP`` (a near-tie)."""


class SimEnvError(ValueError):
    """A simulator environment variable has a value that is not accepted."""


@dataclass(frozen=True)
class SimEnv:
    """Validated environment of one simulator process (see the package docstring for the table)."""

    side_channel_host: str = "localhost"
    side_channel_port: int = 5600
    dev_mode: bool = False
    runtime_lora_updating: bool = False
    startup_delay: float = 0.0
    crash_at_startup: str | None = None
    crash_exit_code: int = 1
    crash_after_requests: int | None = None
    engine_dies_on_request: int | None = None
    #: Seconds a dead engine's server keeps answering before it exits (tests hold it open to see the answers).
    dead_exit_delay: float = 1.0
    hang: bool = False
    ignore_sigterm: bool = False
    spawn_workers: int = 0
    fail_kv_pull: bool = False
    #: ``PDSERVE_SIM_KV_DROP_BLOCKS``: the last N blocks of each pull never arrive (the transfer reports success).
    kv_drop_blocks: int = 0
    #: ``PDSERVE_SIM_CONTEXT_BLIND``: outputs read only the prompt's last 8 tokens (a model that ignores its context).
    context_blind: bool = False
    #: ``VLLM_KV_CACHE_LAYOUT`` as set (None: unset); the layout it runs is `pytest_pdserve.rules.kv_layout.running`.
    kv_cache_layout: str | None = None
    nondeterministic_backends: frozenset[str] = DEFAULT_NONDETERMINISTIC_BACKENDS
    nondeterminism_rate: float = 1.0
    gpu: bool = False
    #: The simulated platform (``PDSERVE_SIM_PLATFORM``: cpu, cuda, rocm; default cuda with PDSERVE_SIM_GPU=1,
    #: else cpu). On cpu the attention backend follows vLLM's CPU rule (pytest_pdserve.engines.cpu).
    platform: str = "cpu"
    tie_flip: bool = False
    override_block_size: int | None = None
    kv_connector_off: bool = False
    vllm_version: str = DEFAULT_VLLM_VERSION
    #: ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``: seconds before an idle connection is closed (vLLM's default, 5).
    http_keepalive: int = 5

    @property
    def vllm_version_tuple(self) -> Release:
        """``vllm_version`` as numbers (the rules of :mod:`pytest_pdserve.rules` take it as it is too)."""
        return parse_version(self.vllm_version)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> SimEnv:
        """Read every knob from ``environ``.

        :raises SimEnvError: naming the variable, its value and the accepted values.
        """

        def get(name: str) -> str | None:
            value = environ.get(name)
            return None if value is None or value.strip() == "" else value.strip()

        def flag(name: str) -> bool:
            value = get(name)
            if value is None:
                return False
            if value.lower() in {"1", "true", "yes", "on"}:
                return True
            if value.lower() in {"0", "false", "no", "off"}:
                return False
            raise SimEnvError(f"{name}={value!r} is not a boolean: use 1/0, true/false, yes/no or on/off")

        def number(name: str, default: float, lo: float, hi: float | None = None) -> float:
            value = get(name)
            if value is None:
                return default
            try:
                result = parse_float(value)
            except ValueError:
                result = float("nan")
            if not (result >= lo and (hi is None or result <= hi)):
                bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
                raise SimEnvError(f"{name}={value!r} is not accepted: expected a number {bound} (digits 0-9)")
            return result

        def integer(name: str, default: int | None, lo: int, hi: int = 2**31) -> int | None:
            value = get(name)
            if value is None:
                return default
            try:
                result = parse_int(value)
            except ValueError:
                result = lo - 1
            if not lo <= result <= hi:
                raise SimEnvError(f"{name}={value!r} is not accepted: expected an integer in [{lo}, {hi}] (digits 0-9)")
            return result

        backends_raw = get("PDSERVE_SIM_NONDETERMINISTIC_BACKENDS")
        backends = (
            DEFAULT_NONDETERMINISTIC_BACKENDS
            if backends_raw is None
            else frozenset(b.strip().upper() for b in backends_raw.split(",") if b.strip())
        )
        crash_code = integer("PDSERVE_SIM_CRASH_EXIT_CODE", 1, 1, 255)
        side_port = integer("VLLM_NIXL_SIDE_CHANNEL_PORT", 5600, 1, 65535)
        workers = integer("PDSERVE_SIM_SPAWN_WORKERS", 0, 0, 64)
        keepalive = integer(SERVER_KEEPALIVE_ENV, 5, 0, 86400)
        version = get("PDSERVE_SIM_VLLM_VERSION") or DEFAULT_VLLM_VERSION
        platform = (get("PDSERVE_SIM_PLATFORM") or ("cuda" if flag("PDSERVE_SIM_GPU") else "cpu")).lower()
        if platform not in ("cpu", "cuda", "rocm"):
            raise SimEnvError(f"PDSERVE_SIM_PLATFORM={platform!r} is not accepted: expected cpu, cuda or rocm")
        try:
            parse_version(version)
        except ValueError:
            raise SimEnvError(
                f"PDSERVE_SIM_VLLM_VERSION={version!r} is not accepted: expected a vLLM version like 0.32.0"
            ) from None
        if (
            crash_code is None or side_port is None or workers is None or keepalive is None
        ):  # pragma: no cover - defaults given
            raise AssertionError("integer knobs with defaults cannot be None")
        return cls(
            side_channel_host=environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or "localhost",
            side_channel_port=side_port,
            dev_mode=flag("VLLM_SERVER_DEV_MODE"),
            # vLLM's own parse (envs.py): "1" or "true", anything else off (not an error).
            runtime_lora_updating=(get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") or "").lower() in ("1", "true"),
            startup_delay=number("PDSERVE_SIM_STARTUP_DELAY", 0.0, 0.0),
            crash_at_startup=environ.get("PDSERVE_SIM_CRASH_AT_STARTUP") or None,
            crash_exit_code=crash_code,
            crash_after_requests=integer("PDSERVE_SIM_CRASH_AFTER_REQUESTS", None, 1),
            engine_dies_on_request=integer("PDSERVE_SIM_ENGINE_DIES_ON_REQUEST", None, 1),
            dead_exit_delay=number("PDSERVE_SIM_DEAD_EXIT_DELAY", 1.0, 0.0),
            hang=flag("PDSERVE_SIM_HANG"),
            ignore_sigterm=flag("PDSERVE_SIM_IGNORE_SIGTERM"),
            spawn_workers=workers,
            fail_kv_pull=flag("PDSERVE_SIM_FAIL_KV_PULL"),
            kv_drop_blocks=integer("PDSERVE_SIM_KV_DROP_BLOCKS", 0, 0, 1 << 20) or 0,
            context_blind=flag("PDSERVE_SIM_CONTEXT_BLIND"),
            kv_cache_layout=environ.get("VLLM_KV_CACHE_LAYOUT"),
            nondeterministic_backends=backends,
            nondeterminism_rate=number("PDSERVE_SIM_NONDETERMINISM_RATE", 1.0, 0.0, 1.0),
            gpu=flag("PDSERVE_SIM_GPU"),
            platform=platform,
            tie_flip=flag("PDSERVE_SIM_TIE_FLIP"),
            override_block_size=integer("PDSERVE_SIM_OVERRIDE_BLOCK_SIZE", None, 1, 1 << 20),
            kv_connector_off=flag("PDSERVE_SIM_KV_CONNECTOR_OFF"),
            vllm_version=version,
            http_keepalive=keepalive,
        )


def tie_position(packed_prompt: bytes, n_out: int) -> int | None:
    """Under ``PDSERVE_SIM_TIE_FLIP``: the output position (never the first) where top-1 and top-2 are a
    near-tie (:data:`TIE_GAP`), a pure function of the prompt (packed ids) and the output length, so a
    cold run and a warm run agree on it. ``None`` for outputs shorter than 2 tokens."""
    if n_out < 2:
        return None
    digest = hashlib.blake2b(b"tie|" + packed_prompt, digest_size=8).digest()
    return 1 + int.from_bytes(digest, "little") % (n_out - 1)


# The child keeps nothing of the parent (no sockets, no app): it renames itself like vLLM's
# processes (setproctitle in vLLM; prctl(PR_SET_NAME) here, 15 bytes max, as /proc/PID/comm shows)
# and sleeps until killed. It is started with start_new_session=True (setsid), so it leaves the
# parent's process group and survives a SIGKILL of the parent: the orphan the plugin must sweep.
_WORKER_CODE = """
import ctypes, sys, time
try:
    ctypes.CDLL(None, use_errno=True).prctl(15, sys.argv[1].encode()[:15], 0, 0, 0)
except Exception:
    pass
while True:
    time.sleep(3600)
"""


def worker_names(count: int) -> list[str]:
    """vLLM-like process names: the first is the engine core, the rest are workers."""
    return ["VLLM::EngineCore" if i == 0 else "VLLM::Worker" for i in range(count)]


def spawn_workers(count: int) -> list[subprocess.Popen[bytes]]:
    """Start ``count`` detached sleeper processes named like vLLM's EngineCore / Worker."""
    procs: list[subprocess.Popen[bytes]] = []
    for name in worker_names(count):
        procs.append(
            subprocess.Popen(
                [name, "-c", _WORKER_CODE, name],
                executable=sys.executable,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
        )
    for proc, name in zip(procs, worker_names(count), strict=True):
        _wait_renamed(proc, name)
    return procs


def _wait_renamed(proc: subprocess.Popen[bytes], name: str, timeout: float = 10.0) -> None:
    """Wait (bounded) until the child shows its vLLM name, so anyone who sees it listed sees the name."""
    comm = f"/proc/{proc.pid}/comm"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with open(comm) as f:
                if f.read().strip() == name[:15]:
                    return
        except OSError:
            return  # no procfs: nothing to wait for
        time.sleep(0.01)


def stop_workers(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill the workers this process started (graceful shutdown path; a SIGKILLed parent leaves them)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def hang_forever(sock: socket.socket) -> None:
    """Listen on ``sock`` but never accept: clients connect (the kernel completes the handshake via the
    backlog) and then wait forever for an HTTP answer. Returns only if SIGTERM/SIGINT arrive (and
    SIGTERM is not ignored)."""
    sock.listen(128)
    deadline_step = 3600.0
    while True:
        # signal.pause would also work; a bounded sleep keeps this interruptible and portable.
        time.sleep(deadline_step)


def install_default_signal_behaviour(ignore_sigterm: bool) -> None:
    """Before uvicorn takes over: ignore SIGTERM if asked, else exit 143 quietly on it (no traceback)."""
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(128 + signum))
