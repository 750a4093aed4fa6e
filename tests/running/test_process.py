"""ServerProcess against a real stand-in server process: ready, fail fast, time out, stop the whole tree."""

from __future__ import annotations

import os
import re
import socket
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _ports import free_port

from pytest_pdserve.errors import PortInUse, ServerExitedEarly, ServerStartupTimeout
from pytest_pdserve.running import readiness
from pytest_pdserve.running.process import ServerProcess, new_run_token, wait_all_ready
from pytest_pdserve.running.proctree import proc_table
from pytest_pdserve.running.rpc_dirs import make_rpc_dir, remove_rpc_dir

STANDIN = str(Path(__file__).parents[1] / "_standin.py")
#: A stand-in's start, or a wait that ends in milliseconds, bounded far beyond a loaded machine's stalls
#: (tests/_timing_scan.py: BOUND_FLOOR_S); a deadline the wait must not run into is twice that.
BOUND_S = 30.0
DEADLINE_S = 2 * BOUND_S


def gone(pid: int) -> bool:
    """Exited (zombies count: the container's init may not reap reparented processes)."""
    info = proc_table().get(pid)
    return info is None or not info.live


def wait_until(cond: Callable[[], object], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return bool(cond())


def log_value(srv: ServerProcess, key: str, timeout: float = BOUND_S) -> str:
    """Wait for a ``KEY value`` line in the stand-in's log and return the value."""
    pattern = re.compile(rf"^{key} (\S+)$", re.MULTILINE)
    found: list[str] = []

    def look() -> bool:
        m = pattern.search(srv.log_path.read_text(errors="replace"))
        if m:
            found.append(m.group(1))
        return bool(m)

    assert wait_until(look, timeout), f"{key} never appeared in {srv.log_path}"
    return found[0]


class Factory:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.made: list[ServerProcess] = []

    def __call__(self, *knobs: str, name: str = "standin", model_id: str | None = None) -> ServerProcess:
        port = free_port()
        srv = ServerProcess(
            name,
            [sys.executable, STANDIN, "--port", str(port), *knobs],
            dict(os.environ),
            self.tmp_path / f"{name}.log",
            health_url=f"http://127.0.0.1:{port}/health",
            models_url=f"http://127.0.0.1:{port}/v1/models" if model_id else None,
            model_id=model_id,
            run_token=new_run_token(),
        )
        self.made.append(srv)
        return srv


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[Factory]:
    factory = Factory(tmp_path)
    yield factory
    for srv in factory.made:
        srv.stop(grace=0)


def test_readiness_is_noticed_once_the_server_listens(standin: Factory) -> None:
    """The wait returns when the server is ready, not at its deadline. How soon after (milliseconds) is a speed,
    bench_startup's ("servers serving -> fixture yields"): a bound on it here failed on loaded machines."""
    srv = standin("--delay", "0.4").start()
    seconds = srv.wait_ready(time.monotonic() + 4 * DEADLINE_S)
    noticed = time.monotonic()
    latency = noticed - float(log_value(srv, "READY_AT"))
    print(f"readiness noticed {latency:.3f} s after the server listened")
    assert seconds >= 0.4
    assert srv.alive
    assert 0 <= latency < DEADLINE_S, f"readiness noticed {latency:.2f} s after the server listened"


class _Reported(Exception):
    """Ends a wait from its progress callback: the first report is what the test is about."""


def test_progress_reports_the_last_log_line(standin: Factory) -> None:
    # A server that never gets ready, and a wait that ends at the first report: however late that report comes on
    # a loaded machine, the server cannot have become ready first (with a 1.3 s start, a stall over the report's
    # second let the server be ready first, and no report came).
    srv = standin("--hang").start()
    progress: list[tuple[str, float, str]] = []

    def report(*args: Any) -> None:
        progress.append(args)
        raise _Reported

    with pytest.raises(_Reported):
        srv.wait_ready(time.monotonic() + DEADLINE_S, on_progress=report)
    name, elapsed, line = progress[0]
    assert name == "standin"
    # The first call comes after about a second (never before: the interval is timed), whatever the load.
    assert elapsed >= 0.9
    assert line.startswith(("stand-in starting", "stand-in hanging forever", "pdserve: starting"))


def test_models_check_requires_the_model_id(standin: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each probe may take as long as a loaded machine needs (0.5 s, the plugin's, timed out there and reported
    # that instead); the wait probes once before it looks at its deadline, so one probe decides.
    monkeypatch.setattr(readiness, "REQUEST_TIMEOUT", BOUND_S)
    ok = standin("--model", "tiny", model_id="tiny", name="ok").start()
    ok.wait_ready(time.monotonic() + DEADLINE_S)
    wrong = standin("--model", "tiny", model_id="other", name="wrong").start()
    log_value(wrong, "READY_AT")  # /health answers now; only the model check can fail
    with pytest.raises(ServerStartupTimeout) as exc_info:
        wrong.wait_ready(time.monotonic() + 0.5)  # timing: one probe decides (above); the model never appears
    assert "model 'other'" in exc_info.value.waiting_for
    assert "['tiny']" in exc_info.value.waiting_for


def test_crash_at_startup_fails_fast_with_exit_code_and_log(standin: Factory) -> None:
    msg = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    srv = standin("--crash-after", "0.2", "--exit-code", "3", "--crash-message", msg).start()
    t0 = time.monotonic()
    with pytest.raises(ServerExitedEarly) as exc_info:
        srv.wait_ready(t0 + 4 * DEADLINE_S)
    noticed = time.monotonic()
    exited = float(log_value(srv, "EXITING_AT"))
    # Within a few of the 10 ms polls (a speed: bench_startup's); asserted only far below the deadline it was given.
    print(f"crash noticed {noticed - exited:.3f}s after the process exited, {noticed - t0:.2f}s after the wait began")
    assert noticed - t0 < DEADLINE_S, "waited for the deadline instead of failing fast"
    err = exc_info.value
    assert err.returncode == 3
    assert msg in err.log_tail
    assert err.hint is not None
    assert "GPU ran out of memory" in err.hint
    text = str(err)
    assert "exit code 3" in text
    assert msg in text
    assert str(srv.log_path) in text


def test_exit_code_zero_before_ready_is_also_a_failure(tmp_path: Path) -> None:
    srv = ServerProcess(
        "quitter",
        [sys.executable, "-c", "print('bye')"],
        dict(os.environ),
        tmp_path / "q.log",
        health_url=f"http://127.0.0.1:{free_port()}/health",
        run_token=new_run_token(),
    ).start()
    with pytest.raises(ServerExitedEarly, match="exit code 0") as exc_info:
        srv.wait_ready(time.monotonic() + DEADLINE_S)
    assert "bye" in exc_info.value.log_tail


def test_hang_times_out_at_the_deadline_and_the_process_is_gone(standin: Factory) -> None:
    srv = standin("--hang").start()
    pid = srv.pid
    assert pid is not None
    t0 = time.monotonic()
    with pytest.raises(ServerStartupTimeout) as exc_info:
        srv.wait_ready(t0 + 1.0)  # timing: the deadline under test; the server never gets ready
    took = time.monotonic() - t0
    print(f"timeout raised after {took:.2f}s for a 1.0s deadline")
    # Never before the deadline; after it, only the kill of the server (milliseconds, bounded for a loaded machine).
    assert 1.0 <= took < BOUND_S, f"timeout raised after {took:.2f}s for a 1.0s deadline"
    assert gone(pid), "the timed-out server is still running"
    assert srv.returncode == -9
    assert "connect" in exc_info.value.waiting_for.lower()
    assert "stand-in hanging forever" in exc_info.value.log_tail


def test_graceful_stop_needs_no_sigkill(standin: Factory) -> None:
    srv = standin().start()
    srv.wait_ready(time.monotonic() + DEADLINE_S)
    report = srv.stop(grace=4 * BOUND_S)
    print(f"graceful stop took {report.total_seconds:.2f}s")
    assert not report.sigkill_needed
    assert report.returncode == -15
    assert report.total_seconds < BOUND_S  # did not sit out the 120 s grace
    assert srv.stop(grace=5) is report, "stop() is idempotent"


def test_ignored_sigterm_escalates_to_sigkill(standin: Factory) -> None:
    srv = standin("--ignore-sigterm").start()
    srv.wait_ready(time.monotonic() + DEADLINE_S)
    report = srv.stop(grace=0.5)
    print(f"SIGKILL after {report.term_seconds:.2f}s for a 0.5 s grace")
    assert report.sigkill_needed
    assert report.returncode == -9
    assert 0.5 <= report.term_seconds < BOUND_S  # the grace, then the kill (bounded for a loaded machine)
    assert report.remaining_pids == ()


def test_setsid_child_is_swept_by_token(standin: Factory) -> None:
    srv = standin("--spawn-child").start()
    srv.wait_ready(time.monotonic() + DEADLINE_S)
    child = int(log_value(srv, "CHILD_PID"))
    assert os.getsid(child) == child, "the stand-in's child should lead its own session"
    assert not gone(child)
    report = srv.stop(grace=2)
    assert child in report.swept_pids
    assert wait_until(lambda: gone(child), BOUND_S), f"setsid child {child} survived stop()"


def test_stop_only_touches_its_own_server(standin: Factory) -> None:
    a = standin("--spawn-child", name="a").start()
    b = standin("--spawn-child", name="b").start()
    wait_all_ready([a, b], time.monotonic() + DEADLINE_S)
    b_child = int(log_value(b, "CHILD_PID"))
    a.stop(grace=2)
    assert b.alive
    assert not gone(b_child), "stopping server a killed server b's descendant"


def test_chatty_log_does_not_block(standin: Factory) -> None:
    srv = standin("--spam-bytes", str(8 << 20)).start()
    srv.wait_ready(time.monotonic() + DEADLINE_S)
    assert srv.log_offset() > 8 << 20
    # What it allocates, not how long it takes (reading 8 MB takes milliseconds, more on a loaded machine).
    tracemalloc.start()
    try:
        tail = srv.log_tail(5)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"log_tail allocated {peak} bytes: it read the whole 8 MB log"
    assert len(tail.splitlines()) == 5
    assert "READY_AT" in tail or "chatty" in tail


def test_port_in_use_is_refused_before_spawning(tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        srv = ServerProcess(
            "prefill-0",
            [sys.executable, STANDIN, "--port", str(port)],
            dict(os.environ),
            tmp_path / "p.log",
            health_url=f"http://127.0.0.1:{port}/health",
            run_token=new_run_token(),
        )
        with pytest.raises(PortInUse) as exc_info:
            srv.start()
    assert srv.pid is None
    assert f"port {port}" in str(exc_info.value)
    assert "a previous server may still be running" in str(exc_info.value)


def test_wait_all_fails_at_once_when_any_exits(standin: Factory) -> None:
    slow = standin("--hang", name="decode-0").start()
    crasher = standin("--crash-after", "0.3", "--exit-code", "7", name="prefill-0").start()
    t0 = time.monotonic()
    with pytest.raises(ServerExitedEarly) as exc_info:
        wait_all_ready([slow, crasher], t0 + 4 * DEADLINE_S)
    assert time.monotonic() - t0 < DEADLINE_S, "waited for the deadline instead of failing fast"
    assert exc_info.value.name == "prefill-0"
    assert exc_info.value.returncode == 7
    assert slow.alive, "the other server is left for the caller to stop"


def test_wait_all_returns_per_server_seconds(standin: Factory) -> None:
    a = standin("--delay", "0.3", name="a").start()
    b = standin(name="b").start()
    seconds = wait_all_ready([a, b], time.monotonic() + DEADLINE_S)
    assert set(seconds) == {"a", "b"}
    assert seconds["a"] >= 0.3


def test_run_and_server_tokens_are_in_the_env(tmp_path: Path) -> None:
    out = tmp_path / "env.log"
    srv = ServerProcess(
        "envdump",
        [
            sys.executable,
            "-c",
            "import os; print(os.environ['PDSERVE_RUN_TOKEN'], os.environ['PDSERVE_SERVER_TOKEN'])",
        ],
        {"PATH": os.environ.get("PATH", "")},
        out,
        health_url=None,
        run_token="tok-123",
    ).start()
    assert wait_until(lambda: not srv.alive, BOUND_S)
    assert f"tok-123 {srv.server_token}" in out.read_text()
    assert srv.server_token.startswith("tok-123.envdump.")


def test_stop_before_start_is_a_no_op(tmp_path: Path) -> None:
    srv = ServerProcess("never", ["true"], {}, tmp_path / "n.log", health_url=None, run_token="t")
    report = srv.stop(grace=1)
    assert report.pid is None
    assert not report.sigkill_needed


def test_argv_must_be_a_list() -> None:
    with pytest.raises(ValueError, match="argv must be a non-empty list"):
        ServerProcess("bad", "vllm serve x", {}, Path("x.log"), health_url=None, run_token="t")


@pytest.mark.timeout(120)
def test_a_fifo_where_the_server_log_goes_is_refused_not_waited_on(tmp_path: Path) -> None:
    # Opening a FIFO for writing waits for a reader, forever if none comes: pytest hung before the server started.
    log = tmp_path / "pd-1-prefill-0.log"
    os.mkfifo(log)
    srv = ServerProcess(
        "prefill-0", [sys.executable, "-c", "pass"], dict(os.environ), log,
        health_url=f"http://127.0.0.1:{free_port()}/health", run_token=new_run_token(),
    )  # fmt: skip
    with pytest.raises(OSError, match="not a regular file"):
        srv.start()
    assert srv.pid is None  # nothing was spawned


def test_a_servers_rpc_dir_goes_when_it_stops_and_nothing_else_does(tmp_path: Path) -> None:
    # vLLM leaves its ZeroMQ IPC socket files behind (14 in /tmp per 1P x 1D cluster, measured): each server gets
    # its own directory for them (rpc_dirs.py), removed by whoever stops the server.
    started, unstarted = make_rpc_dir(), make_rpc_dir()
    with socket.socket(socket.AF_UNIX) as ipc:  # vLLM's ipc://<dir>/<uuid4> endpoint: a socket file stays behind
        ipc.bind(str(started / "c540ee7e-717e-440d-a6af-a8f05e06c137"))
    srv = ServerProcess(
        "decode-0", [sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), tmp_path / "d.log",
        health_url=None, run_token=new_run_token(), rpc_dir=started,
    ).start()  # fmt: skip
    assert started.is_dir()
    srv.stop(grace=1)
    assert not started.exists()
    never = ServerProcess("p-0", ["true"], {}, tmp_path / "p.log", health_url=None, run_token="t", rpc_dir=unstarted)
    never.stop()
    assert not unstarted.exists()  # made for a server that never started
    # A path from a state file is removed only when it is such a directory of ours: never another one, nor a link.
    other = tmp_path / "pdserve-rpc-not-a-dir"
    other.write_text("x")
    link = tmp_path / "pdserve-rpc-link"
    link.symlink_to(tmp_path)
    # Nor one of the user's named like one (no marker: common/created.py), nor a file in ours that is no socket.
    lookalike = tmp_path / "pdserve-rpc-abcdefgh"
    lookalike.mkdir()
    (lookalike / "notes.txt").write_text("mine")
    for path in (tmp_path, other, link, lookalike):
        remove_rpc_dir(path)
        assert os.path.lexists(path), path
    assert (lookalike / "notes.txt").read_text() == "mine"
    kept = make_rpc_dir()
    (kept / "notes.txt").write_text("mine")
    remove_rpc_dir(kept)
    assert (kept / "notes.txt").read_text() == "mine"


def test_the_readiness_poll_starts_fast_and_backs_off_with_the_wait() -> None:
    """5 ms while a start is young (the simulator's readiness target), then 1/500 of the wait up to 50 ms: a real
    vLLM start of 40-120 s is not polled 20,000 times (each refused probe costs about 0.1 ms of CPU)."""
    from pytest_pdserve.running.process import poll_interval

    assert [poll_interval(w) for w in (0.0, 1.0, 2.5)] == [0.005] * 3
    assert poll_interval(10.0) == pytest.approx(0.02)
    assert [poll_interval(w) for w in (25.0, 100.0, 1e9)] == [0.05] * 3
