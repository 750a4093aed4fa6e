"""Whose cluster is it: the process that started it (issue 43, class 3; common/owner.py).

A test that forks gives its child a copy of everything pdserve holds. The held-out worst case: the child returned
through ``sys.exit(0)``, ran the rest of the session, and its teardown stopped the parent's servers; the parent's
next test got ``ServerDied ... exit code 0``. The doors: ``os.fork()`` with the child running the rest of the
session (exactly that), multiprocessing's fork start method with a child that calls pytest's cleanup itself (the
factory's stop, ``pytest_unconfigure``, the atexit handlers) and asks for a cluster, the same under xdist, and each
holder alone (a server, a lease, the watchdog) stopped from a forked child.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _pdsession import Inner

from pytest_pdserve.machine.port_leases import acquire_ports
from pytest_pdserve.running.process import ServerProcess, new_run_token
from pytest_pdserve.running.watchdog import Watchdog

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

STANDIN = str(Path(__file__).parents[1] / "_standin.py")

#: Each inner process records its test outcomes by pid, and the session's own pid at configure.
OUTCOMES = r"""

def pytest_configure(config):
    pid_file = Path(os.environ["PDINFO_DIR"]) / "session-pid"
    if not pid_file.exists():
        pid_file.write_text(str(os.getpid()))


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        with open(Path(os.environ["PDINFO_DIR"]) / f"outcomes-{os.getpid()}.txt", "a") as fh:
            fh.write(f"{report.nodeid.split('::')[-1]} {report.when} {report.outcome}\n")
"""

#: What the parent checks once its child is gone: the cluster, its supervisors and its leases are all still there.
STILL_UP = r"""
@pytest.fixture
def still_up(request):
    return lambda cluster: _still_up(request, cluster)


def _still_up(request, cluster):
    import fcntl

    assert cluster.complete("after the child", max_tokens=2)["choices"]
    if os.getpid() != int((Path(os.environ["PDINFO_DIR"]) / "session-pid").read_text()):
        return  # a forked child running the rest of the session: the supervisors and leases are its parent's

    from pytest_pdserve.glue.fixtures import session_of
    from pytest_pdserve.config.settings import PDSERVE_CONFIG

    manager = session_of(request.config).manager
    supervisors = manager.launcher.supervisors
    assert supervisors.watchdog is not None and supervisors.watchdog.alive, "the watchdog was told to exit"
    assert supervisors._guard is not None and supervisors._guard.poll() is None, "the guard is gone"
    for s in cluster.servers:
        assert s.process.alive, f"{s.name} was stopped (exit {s.process.returncode})"
    locks = list(request.config.stash[PDSERVE_CONFIG].lease_dir.glob("port-*.lock"))
    assert locks, "the lease files were unlinked"
    for lock in locks:
        fd = os.open(lock, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):  # still held: by us and the servers
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
"""


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Inner:
    made = Inner(pytester, monkeypatch)
    conftest = pytester.path / "conftest.py"
    conftest.write_text(conftest.read_text() + OUTCOMES + STILL_UP)
    return made


def _outcomes(inner: Inner) -> tuple[list[str], list[str]]:
    """(the session's own outcomes, every forked child's), one ``test phase outcome`` line each."""
    parent = int((inner.info_dir / "session-pid").read_text())
    own: list[str] = []
    others: list[str] = []
    for path in inner.info_dir.glob("outcomes-*.txt"):
        lines = path.read_text().splitlines()
        (own if path.stem == f"outcomes-{parent}" else others).extend(lines)
    return own, others


def test_a_child_that_runs_the_rest_of_the_session_stops_nothing_of_its_parent(inner: Inner) -> None:
    """The held-out case, exactly: ``sys.exit(0)`` in the child is a failed test there, and the child runs the
    remaining tests and the session's teardown; the parent waits for all of it, then uses its cluster."""
    inner.pytester.makepyfile(
        """
        import os
        import sys

        def test_fork(pd_cluster):
            pid = os.fork()
            if pid == 0:
                sys.exit(0)
            os.waitpid(pid, 0)  # the child's whole session, its teardown and atexit included, is over

        def test_after(pd_cluster, still_up):
            still_up(pd_cluster)
        """
    )
    result = inner.run("-p", "no:randomly")
    own, child = _outcomes(inner)
    assert sorted(own) == ["test_after call passed", "test_fork call passed"], (own, result.stdout.str()[-4000:])
    assert sorted(child) == ["test_after call passed", "test_fork call failed"], child  # the child ran the rest
    assert "ServerDied" not in result.stdout.str()
    inner.assert_nothing_left()


CLEANUP_CHILD = """
import atexit
import multiprocessing
import os
from pathlib import Path

from pytest_pdserve.errors import NotOwner


def test_child_cleans_up(pd_cluster, pd_cluster_factory, request):
    def child():
        pd_cluster_factory.stop(pd_cluster.spec)
        request.config.hook.pytest_unconfigure(config=request.config)
        atexit._run_exitfuncs()
        try:
            pd_cluster_factory(num_decode=2, name="another")
        except NotOwner as exc:
            (Path(os.environ["PDINFO_DIR"]) / "refused.txt").write_text(str(exc))
            os._exit(0)
        os._exit(3)

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(120)
    assert process.exitcode == 0, "the child started a cluster of its own"


def test_after(pd_cluster, still_up):
    still_up(pd_cluster)
"""


@pytest.mark.parametrize("xdist", [False, True], ids=["plain", "xdist"])
def test_a_forked_child_calling_pytests_cleanup_stops_nothing(inner: Inner, xdist: bool) -> None:
    """multiprocessing's fork start method; the child stops the cluster through the factory, runs the plugins'
    pytest_unconfigure and the atexit handlers, then asks for a cluster (refused: NotOwner)."""
    inner.pytester.makepyfile(CLEANUP_CHILD)
    result = inner.run("-p", "no:randomly", *(["-n", "1"] if xdist else []))
    result.assert_outcomes(passed=2)
    refused = (inner.info_dir / "refused.txt").read_text()
    assert refused.startswith("pdserve: start cluster another: this process (pid "), refused
    assert "is a fork of the pytest process that owns pdserve's clusters" in refused
    inner.assert_nothing_left()


# ------------------------------------------------------------------------------------ each holder, from a fork


def _in_child(action: Callable[[], object]) -> int:
    """Run ``action()`` in a forked child that ends with os._exit; its exit status (0: it returned)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            action()
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    from _ports import free_port

    port = free_port()
    proc = ServerProcess(
        "standin", [sys.executable, STANDIN, "--port", str(port)], dict(os.environ), tmp_path / "standin.log",
        health_url=f"http://127.0.0.1:{port}/health", run_token=new_run_token(),
    )  # fmt: skip
    proc.start()
    proc.wait_ready(time.monotonic() + 30)
    yield proc
    proc.stop(2.0)


def test_a_server_is_not_stopped_from_a_fork(server: ServerProcess) -> None:
    def stop() -> None:
        report = server.stop(0.5)
        assert report.errors, report
        assert "did not start it" in report.errors[0], report
        assert server.returncode is None  # not Popen.poll's 0 for a process it cannot wait for
        assert server.alive

    assert _in_child(stop) == 0
    assert server.alive
    assert server.returncode is None


def test_a_lease_is_not_released_from_a_fork(tmp_path: Path) -> None:
    lease = acquire_ports(tmp_path, 2, low=15000, high=19999, purpose="parent")
    try:
        assert _in_child(lease.release) == 0
        for _, path in lease.locks:
            assert path.exists(), "the child unlinked the parent's lock file"
            fd = os.open(path, os.O_RDWR)
            try:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
        assert lease.held
    finally:
        lease.release()
    assert not list(tmp_path.glob("port-*.lock"))


class _NoSend:
    """A watchdog socket that fails the child if it is written to: its "unwatch" or "exit" would reach the parent's
    watchdog (no sleep waiting to see whether the watchdog left: the write itself is the fault)."""

    def send(self, *_args: object) -> int:
        raise AssertionError("a forked child wrote to its parent's watchdog")

    def close(self) -> None:
        pass


def test_the_watchdog_is_not_told_anything_from_a_fork(tmp_path: Path) -> None:
    dog = Watchdog.start(new_run_token(), grace=1.0, log_path=tmp_path / "watchdog.log")
    try:

        def tell() -> None:
            dog._sock = _NoSend()  # type: ignore[assignment]  # the child's copy only
            dog.unwatch(1)
            dog.hold("x", [])
            dog.close()

        assert _in_child(tell) == 0
        assert dog.alive, (tmp_path / "watchdog.log").read_text()
    finally:
        dog.close()
    assert dog.returncode == 0
