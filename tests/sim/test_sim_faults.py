"""Each ``PDSERVE_SIM_*`` fault switch, startup failures, and graceful vs forced shutdown."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ._simproc import BOUND_S, Factory, words


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    # a zombie still accepts signal 0; it is dead for our purposes
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def _wait_dead(pid: int, timeout: float = BOUND_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def kill_pids() -> Iterator[list[int]]:
    """PIDs (of detached workers) to SIGKILL at teardown."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_startup_delay(sim_factory: Factory) -> None:
    started = time.monotonic()
    server = sim_factory(env={"PDSERVE_SIM_STARTUP_DELAY": "0.8"})
    server.wait_ready()
    assert time.monotonic() - started >= 0.8
    assert "PDSERVE_SIM_STARTUP_DELAY=0.80" in server.log()


def test_crash_at_startup_message_and_code(sim_factory: Factory) -> None:
    server = sim_factory(
        env={
            "PDSERVE_SIM_CRASH_AT_STARTUP": "torch.OutOfMemoryError: CUDA out of memory.",
            "PDSERVE_SIM_CRASH_EXIT_CODE": "3",
        }
    )
    assert server.wait_exit() == 3
    assert "CUDA out of memory." in server.log()


def test_crash_after_requests(sim_factory: Factory) -> None:
    # The dead engine's server stays up until the test ends it (PDSERVE_SIM_DEAD_EXIT_DELAY): with the 1 s of
    # vLLM's shutdown, a loaded machine let it exit before the test's next request (connection refused).
    env = {"PDSERVE_SIM_CRASH_AFTER_REQUESTS": "2", "PDSERVE_SIM_DEAD_EXIT_DELAY": "3600"}
    server = sim_factory(env=env).wait_ready()
    assert server.complete("one", max_tokens=1).status_code == 200
    assert server.complete("two", max_tokens=1).status_code == 200
    assert httpx.get(server.url + "/health", timeout=BOUND_S).status_code == 503
    assert server.complete("three", max_tokens=1).status_code == 500
    assert "EngineDeadError" in server.log()
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait_exit() == 1  # a dead engine's exit status, however it ends


def test_a_dead_engine_exits_by_itself(sim_factory: Factory) -> None:
    server = sim_factory(env={"PDSERVE_SIM_CRASH_AFTER_REQUESTS": "1"}).wait_ready()
    assert server.complete("one", max_tokens=1).status_code == 200
    assert server.wait_exit() == 1  # after the default 1 s of answering 503
    assert "EngineDeadError" in server.log()


def test_hang_accepts_tcp_but_never_answers(sim_factory: Factory) -> None:
    server = sim_factory(env={"PDSERVE_SIM_HANG": "1"})
    deadline = time.monotonic() + BOUND_S
    while "without ever answering" not in server.log():
        assert time.monotonic() < deadline, server.log()
        assert server.proc.poll() is None
        time.sleep(0.05)
    with socket.create_connection(("127.0.0.1", server.port), timeout=BOUND_S):
        pass  # the TCP handshake completes
    with pytest.raises(httpx.ReadTimeout):
        # timing: a read that never gets an answer, however long it waits
        httpx.get(server.url + "/health", timeout=httpx.Timeout(BOUND_S, read=0.5))
    assert server.proc.poll() is None


def test_ignore_sigterm(sim_factory: Factory) -> None:
    server = sim_factory(env={"PDSERVE_SIM_IGNORE_SIGTERM": "1"}).wait_ready()
    server.proc.send_signal(signal.SIGTERM)
    # The server says it ignored the signal, and still answers: awaited in its log, not given a second to exit.
    deadline = time.monotonic() + BOUND_S
    while "ignoring it (PDSERVE_SIM_IGNORE_SIGTERM=1)" not in server.log():
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    assert httpx.get(server.url + "/health", timeout=BOUND_S).status_code == 200
    assert server.proc.poll() is None


def test_workers_are_orphaned_by_sigkill(sim_factory: Factory, kill_pids: list[int]) -> None:
    server = sim_factory(env={"PDSERVE_SIM_SPAWN_WORKERS": "2", "PDSERVE_RUN_TOKEN": "tok-123"}).wait_ready()
    pids = httpx.get(server.url + "/version", timeout=60).json()["pdserve_sim"]["worker_pids"]
    kill_pids.extend(pids)
    assert len(pids) == 2
    names = [Path(f"/proc/{pid}/comm").read_text().strip() for pid in pids]
    assert names == ["VLLM::EngineCor", "VLLM::Worker"]  # comm keeps 15 bytes, as for vLLM's own
    for pid in pids:
        assert os.getsid(pid) == pid  # setsid(): own session, so not in the server's process group
        assert os.getpgid(pid) != os.getpgid(server.proc.pid)
        assert b"PDSERVE_RUN_TOKEN=tok-123" in Path(f"/proc/{pid}/environ").read_bytes()
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=BOUND_S)
    assert all(_alive(pid) for pid in pids)


def test_graceful_sigterm_stops_workers(sim_factory: Factory, kill_pids: list[int]) -> None:
    server = sim_factory(env={"PDSERVE_SIM_SPAWN_WORKERS": "1"}).wait_ready()
    (pid,) = httpx.get(server.url + "/version", timeout=60).json()["pdserve_sim"]["worker_pids"]
    kill_pids.append(pid)
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait_exit() == 0
    assert _wait_dead(pid)
    assert "Finished server process" in server.log()


def test_port_in_use(sim_factory: Factory) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        server = sim_factory(port=holder.getsockname()[1])
        assert server.wait_exit() == 1
    assert "[Errno 98] Address already in use" in server.log()


def test_side_channel_port_in_use(sim_factory: Factory) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(holder.getsockname()[1])}
        server = sim_factory("--kv-transfer-config", '{"kv_connector":"NixlConnector"}', env=env)
        assert server.wait_exit() == 1
    assert "NIXL side channel could not bind" in server.log()


def test_gpu_mode_without_torch(sim_factory: Factory) -> None:
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed here; GPU mode is exercised on GPU machines only")
    server = sim_factory(env={"PDSERVE_SIM_GPU": "1"})
    assert server.wait_exit() == 1
    assert "PDSERVE_SIM_GPU=1 needs torch with CUDA" in server.log()


def test_bad_env_value_names_the_variable(sim_factory: Factory) -> None:
    server = sim_factory(env={"PDSERVE_SIM_NONDETERMINISM_RATE": "2"})
    assert server.wait_exit() == 2
    assert "PDSERVE_SIM_NONDETERMINISM_RATE='2' is not accepted: expected a number in [0.0, 1.0]" in server.log()


def test_requests_keep_working_under_concurrency(sim_factory: Factory) -> None:
    server = sim_factory().wait_ready()
    prompts = [words(30 + i, tag=f"c{i}") for i in range(8)]
    with httpx.Client(timeout=BOUND_S) as client:
        texts = [
            client.post(server.url + "/v1/completions", json={"prompt": p, "max_tokens": 4, "temperature": 0}).json()[
                "choices"
            ][0]["text"]
            for p in prompts
        ]
    assert len(set(texts)) == len(prompts)
