"""The watchdog kills our server trees when the pytest-like parent dies without cleaning up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_pdserve.machine.leases import try_acquire_gpus
from pytest_pdserve.running.process import ServerProcess, new_run_token
from pytest_pdserve.running.proctree import proc_table
from pytest_pdserve.running.watchdog import Watchdog

STANDIN = str(Path(__file__).parents[1] / "_standin.py")

# The throwaway "pytest": starts a watchdog and a stand-in server (with a setsid grandchild), optionally
# hands a GPU lease to the watchdog, reports pids as JSON, then sleeps until it is killed.
PARENT = textwrap.dedent(
    """
    import json, os, socket, sys, time
    from pathlib import Path
    from pytest_pdserve.machine.leases import acquire_gpus
    from pytest_pdserve.running.process import ServerProcess, new_run_token
    from pytest_pdserve.running.watchdog import Watchdog

    standin, tmp, knobs, watch, lease_dir, how, grace = sys.argv[1:8]
    tmp = Path(tmp)
    token = new_run_token()
    wd = Watchdog.start(token, grace=float(grace), log_path=tmp / "watchdog.log")
    if lease_dir != "-":
        lease = acquire_gpus(Path(lease_dir), ["g0", "g1"], 2, timeout=0)
        wd.hold("gpus", lease.fds)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = ServerProcess(
        "standin", [sys.executable, standin, "--port", str(port), *knobs.split()], dict(os.environ),
        tmp / "server.log", health_url=f"http://127.0.0.1:{port}/health", run_token=token,
    )
    srv.start()
    if watch == "watch":
        wd.watch(srv.pid, srv.pgid)
    srv.wait_ready(time.monotonic() + 60)
    child = next(int(l.split()[1]) for l in (tmp / "server.log").read_text().splitlines()
                 if l.startswith("CHILD_PID"))
    print(json.dumps({"server": srv.pid, "child": child, "watchdog": wd.pid}), flush=True)
    if how == "exit":
        os._exit(1)  # what pytest-timeout's thread method does: no finalisers, no atexit
    time.sleep(120)  # timing: until the test kills it
    """
)


#: A wait that ends in milliseconds to a second, bounded for a loaded machine (tests/_timing_scan.py).
BOUND_S = 30.0
#: A watchdog grace no test waits out.
GRACE_OUTLASTING_S = 600.0


def _log(tmp_path: Path) -> str:
    path = tmp_path / "watchdog.log"
    return path.read_text(errors="replace") if path.exists() else ""


def gone(pid: int) -> bool:
    info = proc_table().get(pid)
    return info is None or not info.live


@pytest.fixture
def parents() -> Iterator[list[subprocess.Popen[str]]]:
    """The parents a test started: killed if still running, reaped, their stdout pipe closed (else ResourceWarning)."""
    made: list[subprocess.Popen[str]] = []
    yield made
    for parent in made:
        parent.kill()
        parent.wait(BOUND_S)
        if parent.stdout is not None:
            parent.stdout.close()


def start_parent(
    parents: list[subprocess.Popen[str]],
    tmp_path: Path,
    knobs: str,
    *,
    watch: bool = True,
    lease_dir: str = "-",
    how: str = "kill",
    grace: float = 1.0,
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            PARENT,
            STANDIN,
            str(tmp_path),
            knobs,
            "watch" if watch else "no",
            lease_dir,
            how,
            repr(grace),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    parents.append(parent)
    assert parent.stdout is not None
    line = parent.stdout.readline()
    assert line, f"parent failed; server log:\n{(tmp_path / 'server.log').read_text(errors='replace')}"
    return parent, json.loads(line)


def wait_all_gone(pids: list[int], timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if all(gone(p) for p in pids):
            return time.monotonic() - t0
        time.sleep(0.01)
    alive = [p for p in pids if not gone(p)]
    for p in alive:  # do not leak into the rest of the suite
        os.kill(p, signal.SIGKILL)
    pytest.fail(f"still alive after {timeout}s: {alive}")


@pytest.mark.parametrize(
    ("knobs", "watch", "how"),
    [
        ("--spawn-child", True, "kill"),
        ("--spawn-child --ignore-sigterm", True, "kill"),
        ("--spawn-child", False, "kill"),  # never watched: found by the run token alone
        ("--spawn-child", True, "exit"),
    ],
    ids=["sigkill", "sigkill-ignores-sigterm", "token-only", "os-exit"],
)
def test_server_tree_dies_with_its_parent(
    parents: list[subprocess.Popen[str]], tmp_path: Path, knobs: str, watch: bool, how: str
) -> None:
    parent, pids = start_parent(parents, tmp_path, knobs, watch=watch, how=how)
    assert os.getsid(pids["watchdog"]) == pids["watchdog"], "the watchdog must lead its own session"
    t0 = time.monotonic()
    if how == "kill":
        parent.kill()
    parent.wait(BOUND_S)
    # 0.2 s measured at load average 11 on 2 cores, 1.3 s with the 1 s grace of a server ignoring SIGTERM; 30 s is
    # a loaded machine's margin (a tree that outlives its parent never goes). How soon: bench_teardown.
    wait_all_gone([pids["server"], pids["child"], pids["watchdog"]], BOUND_S)
    took = time.monotonic() - t0
    print(f"watchdog cleanup ({knobs}, {how}): {took * 1000:.0f} ms from parent death to all gone")
    log = (tmp_path / "watchdog.log").read_text()
    assert "EOF from parent" in log or "parent changed" in log
    assert "remaining=[]" in log


def test_lease_is_held_until_the_watchdog_finished_killing(
    parents: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    lease_dir = tmp_path / "leases"
    # The server ignores SIGTERM and the watchdog's grace outlasts the test: the watchdog is in its grace until the
    # test itself kills the server, whatever the machine's speed (with a 1 s grace a stall of the test let the
    # watchdog finish first).
    parent, pids = start_parent(
        parents, tmp_path, "--spawn-child --ignore-sigterm", lease_dir=str(lease_dir), grace=GRACE_OUTLASTING_S
    )
    parent.kill()
    parent.wait(BOUND_S)
    assert wait_for(lambda: "EOF from parent" in _log(tmp_path) or "parent changed" in _log(tmp_path), BOUND_S)
    assert not gone(pids["server"])
    assert try_acquire_gpus(lease_dir, ["g0", "g1"], 1) is None, "the lease was free during the watchdog's grace"
    for pid in (pids["server"], pids["child"]):  # the grace ends early, as when the tree exits on its own
        os.kill(pid, signal.SIGKILL)
    wait_all_gone([pids["server"], pids["child"], pids["watchdog"]], BOUND_S)
    lease = try_acquire_gpus(lease_dir, ["g0", "g1"], 2)
    assert lease is not None, "the lease was not freed after the watchdog exited"
    lease.release()


def test_close_exits_without_killing(tmp_path: Path) -> None:
    token = new_run_token()
    wd = Watchdog.start(token, grace=1.0)
    srv = ServerProcess(
        "standin",
        [sys.executable, STANDIN, "--hang"],
        dict(os.environ),
        tmp_path / "s.log",
        health_url=None,
        run_token=token,
    ).start()
    try:
        assert srv.pid is not None
        wd.watch(srv.pid, srv.pid)
        wd.unwatch(srv.pid)
        wd.close(timeout=BOUND_S)
        assert not wd.alive
        assert wd.returncode == 0
        assert srv.alive, "a normal close() must not kill anything"
    finally:
        srv.stop(grace=0)


def test_watchdog_survives_sigint_to_its_group() -> None:
    wd = Watchdog.start(new_run_token(), grace=0.5)
    os.killpg(wd.pid, signal.SIGINT)
    # The SIGINT is pending before the watchdog can read "exit", so a clean exit code proves it survived.
    wd.close(timeout=BOUND_S)
    assert wd.returncode == 0


def test_hold_and_drop_lease_fds(tmp_path: Path) -> None:
    wd = Watchdog.start(new_run_token(), grace=0.5)
    lease = try_acquire_gpus(tmp_path, ["g0", "g1"], 2)
    assert lease is not None

    def open_fds() -> int:
        return len(os.listdir(f"/proc/{wd.pid}/fd"))

    try:
        before = open_fds()
        wd.hold("gpus", lease.fds)
        assert wait_for(lambda: open_fds() == before + 2), "the watchdog did not take the lease fds"
        wd.drop("gpus")
        assert wait_for(lambda: open_fds() == before), "the watchdog did not close the dropped fds"
    finally:
        lease.release()
        wd.close(timeout=BOUND_S)


def wait_for(cond: Callable[[], bool], timeout: float = BOUND_S) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
