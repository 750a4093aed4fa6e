"""proctree's stop: it sleeps on the processes it knows (pidfds) and scans /proc only to find the rest.

A scan of /proc reads every process's stat (and, for the env tokens, its environ): polled every 20 ms, one server's
stop cost ~45 ms of CPU, a fifth of a simulator test's inner session. These tests pin the cheaper wait down and
attack it where it could go wrong: a pid reused by another process, a process that starts a child while it dies.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_pdserve.running import proctree

#: Only the waits that sleep on pidfds need them; without, terminate polls as before (the last test runs anyway).
needs_pidfd = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no os.pidfd_open (Linux 5.3+, Python 3.9+)")

TOKEN_ENV = "PDSERVE_TEST_PROCTREE_TOKEN"

#: Exits ``delay`` seconds after SIGTERM; with a path, first starts a child in a session of its own (it inherits
#: the env token) and writes the child's pid there.
SLOW_EXIT = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    delay, child_file = float(sys.argv[1]), sys.argv[2]

    def on_term(*_):
        if child_file:
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
            with open(child_file, "w") as f:
                f.write(str(child.pid))
        time.sleep(delay)  # timing: the slow exit this stand-in is for
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)
    time.sleep(120)  # timing: until its SIGTERM
    """
)


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(30)
        if p.stdout is not None:
            p.stdout.close()


def _slow_exit(spawned: list[subprocess.Popen[str]], token: str, delay: float, child_file: Path | None = None) -> int:
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_EXIT, str(delay), str(child_file or "")],
        stdout=subprocess.PIPE, text=True, start_new_session=True, env={**os.environ, TOKEN_ENV: token},
    )  # fmt: skip
    spawned.append(proc)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    return proc.pid


def _count_scans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = proctree.proc_table

    def counting() -> Any:
        calls[0] += 1
        return real()

    monkeypatch.setattr(proctree, "proc_table", counting)
    return calls


@needs_pidfd
def test_a_slow_exit_is_slept_on_not_polled(
    spawned: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    token = uuid.uuid4().hex
    pid = _slow_exit(spawned, token, delay=1.0)
    scans = _count_scans(monkeypatch)
    result = proctree.terminate([pid], env=[(TOKEN_ENV, token)], grace=240)
    assert not result.killed, "it exited on SIGTERM within the grace"
    assert result.term_seconds >= 0.9, "returned before the process had exited"
    assert result.term_seconds < 60, "sat out the grace instead of waking when the process exited"
    # Polling every 20 ms through a 1 s exit is ~50 scans; sleeping on the pidfd, a handful.
    assert scans[0] <= 5, f"{scans[0]} scans of /proc for one process's stop"
    assert spawned[0].wait(30) == 0


@needs_pidfd
def test_a_pid_that_is_another_process_now_is_not_waited_on(spawned: list[subprocess.Popen[str]]) -> None:
    """A start time that does not match is what a reused pid looks like: no wait on that process."""
    pid = _slow_exit(spawned, uuid.uuid4().hex, delay=0)
    info = proctree.read_stat(pid)
    assert info is not None
    t0 = time.monotonic()
    proctree._await_exit({pid: info.starttime + 1}, t0 + 240)
    assert time.monotonic() - t0 < 60, "waited on a process that is not the one recorded"
    assert spawned[0].poll() is None


@needs_pidfd
def test_the_wait_ends_at_the_deadline_for_a_process_that_does_not_exit(spawned: list[subprocess.Popen[str]]) -> None:
    pid = _slow_exit(spawned, uuid.uuid4().hex, delay=0)
    info = proctree.read_stat(pid)
    assert info is not None
    t0 = time.monotonic()
    proctree._await_exit({pid: info.starttime}, t0 + 0.5)  # timing: the deadline under test; it never exits
    assert 0.45 <= time.monotonic() - t0 < 30
    assert spawned[0].poll() is None


def test_a_child_started_while_dying_is_still_found_and_killed(
    spawned: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    """The wait sleeps only on what it knew; the scan after it finds the child the dying process started (its own
    session, so not in the group signalled: found by the env token it inherited)."""
    token = uuid.uuid4().hex
    child_file = tmp_path / "child"
    pid = _slow_exit(spawned, token, delay=0.2, child_file=child_file)
    result = proctree.terminate([pid], env=[(TOKEN_ENV, token)], grace=30)
    child = int(child_file.read_text())
    assert child in result.swept, result
    assert result.remaining == ()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the child was SIGKILLed; it is reaped by init (or stays a zombie)
        info = proctree.read_stat(child)
        if info is None or not info.live:
            break
        time.sleep(0.02)
    else:
        pytest.fail(f"the child {child} started during the stop survived it")
