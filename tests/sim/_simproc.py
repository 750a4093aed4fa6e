"""Helpers for the simulator tests: real ``python -m pytest_pdserve.sim`` processes on 127.0.0.1.

Imported by the test modules as ``_simproc`` (pytest puts this directory on sys.path).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import httpx
import pytest
from _children import die_with_parent
from _ports import free_port as free_port  # re-exported: the sim tests import it from here
from prometheus_client.parser import text_string_to_metric_families

#: A simulator's start: about a second quiet, several on a loaded machine; bounded far beyond that.
READY_TIMEOUT_S = 120.0
#: A wait or a request that takes milliseconds to a second, bounded for a loaded machine (tests/_timing_scan.py).
BOUND_S = 60.0
NIXL_KVC = '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}'

#: A :meth:`SimServer.metrics` snapshot: (sample name, sorted labels) -> value.
Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


#: The block size these tests were written at: vLLM's default up to 0.33 (0.34's is 64, test_sim_vllm034.py).
TEST_BLOCK_SIZE = "16"


def sim_argv(model: str, *args: str, block_size: bool = True) -> list[str]:
    """argv of a simulator ``serve`` command, with ``--block-size 16`` unless ``args`` give one or ``block_size`` is
    False (the simulator's default then: its vLLM version's)."""
    given = any(a == "--block-size" or a.startswith("--block-size=") for a in args)
    pinned = ("--block-size", TEST_BLOCK_SIZE) if block_size and not given else ()
    return [sys.executable, "-m", "pytest_pdserve.sim", "serve", model, *args, *pinned]


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test process env without inherited simulator knobs, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_SIM_", "VLLM_"))}
    env.update(extra or {})
    return env


class SimServer:
    """One simulator process with its log file; ``url`` is ``http://127.0.0.1:PORT``."""

    def __init__(
        self,
        log_path: Path,
        args: Sequence[str],
        env: Mapping[str, str] | None = None,
        model: str = "tiny-sim",
        port: int | None = None,
        block_size: bool = True,
    ) -> None:
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.model = model
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            sim_argv(model, "--host", "127.0.0.1", "--port", str(self.port), *args, block_size=block_size),
            env=child_env(env),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )

    def log(self) -> str:
        """Everything the process wrote so far."""
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> SimServer:
        """Poll /health until 200; fail at once if the process exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"simulator exited with {self.proc.returncode} before ready:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            time.sleep(0.05)
        pytest.fail(f"simulator not ready after {timeout} s:\n{self.log()}")

    def wait_exit(self, timeout: float = BOUND_S) -> int:
        """The exit status, failing the test if it does not come in time."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"simulator still running after {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        """SIGKILL the process group (tests never rely on a graceful stop unless they test it)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=BOUND_S)
        self._log.close()

    def post(self, path: str, body: Mapping[str, object], headers: Mapping[str, str] | None = None) -> httpx.Response:
        """POST JSON to this server."""
        return httpx.post(self.url + path, json=dict(body), headers=headers, timeout=BOUND_S)

    def complete(self, prompt: str | list[int], **body: object) -> httpx.Response:
        """POST /v1/completions with temperature 0 unless given."""
        return self.post("/v1/completions", {"prompt": prompt, "temperature": 0, **body})

    def metrics(self) -> Metrics:
        """Scrape /metrics: (sample name, sorted labels without model_name/engine) -> value."""
        text = httpx.get(self.url + "/metrics", timeout=BOUND_S).text
        out: Metrics = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in {"model_name", "engine"}))
                out[(s.name, labels)] = s.value
        return out


def metric(snapshot: Metrics, name: str, **labels: str) -> float:
    """One sample value from a :meth:`SimServer.metrics` snapshot (0 when absent)."""
    return snapshot.get((name, tuple(sorted(labels.items()))), 0.0)


#: What :func:`sim_processes` yields (and the ``sim_factory`` fixture is): start one simulator, not waited for.
Factory = Callable[..., SimServer]


@contextlib.contextmanager
def sim_processes(log_dir: Path) -> Iterator[Factory]:
    """Start simulator processes (not waited for); all are SIGKILLed on exit."""
    servers: list[SimServer] = []

    def start(
        *args: str,
        env: Mapping[str, str] | None = None,
        model: str = "tiny-sim",
        port: int | None = None,
        block_size: bool = True,
    ) -> SimServer:
        server = SimServer(log_dir / f"sim{len(servers)}.log", args, env, model, port, block_size)
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


def _letters(i: int) -> str:
    out = ""
    while True:
        out = chr(ord("a") + i % 26) + out
        i //= 26
        if i == 0:
            return out


def words(n: int, tag: str = "w") -> str:
    """A prompt of ``n`` distinct words (``n`` tokens, plus BOS when sent as text).

    Letters only: the built-in tokenizer splits digits one by one, as Llama 3 / Qwen tokenizers do."""
    return " ".join(f"{tag}{_letters(i)}" for i in range(n))
