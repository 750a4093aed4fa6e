"""Helpers for tests that run a real inner pytest session against real simulator processes.

Imported by the test modules as ``_pdsession`` (pytest's default prepend import mode puts tests/ on sys.path).
Every process an inner session starts inherits ``PDSERVE_TEST_MARK=<unique>``, so the outer test finds them
in ``/proc`` by that mark (never by name), and by the servers' process groups.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _children import as_a_terminal_job

from pytest_pdserve.config.commands import VLLM_PORT_WINDOW

MARK_ENV = "PDSERVE_TEST_MARK"

#: How long a test waits for processes to go once it stopped or killed their owner. A correct cleanup takes the
#: grace (``--pd-shutdown-timeout``, at most 3 s after pytest died) plus the SIGKILL: 1-3 s; 30 s leaves a loaded
#: machine room, and a leak still fails (it never goes). The speed (README: "alive 5 s later") is bench_teardown's.
GONE_WITHIN_S = 30.0

#: The inner sessions' conftest: ``pdinfo(cluster, **extra)`` writes what a cluster got to $PDINFO_DIR as one
#: JSON file, and ``pytest_sessionfinish`` writes ``sessionfinish-<pid>`` there with the time it ran.
INNER_CONFTEST = r"""
import faulthandler, json, os, signal, time, uuid
from pathlib import Path

import pytest

# Inner.popen asks a session that outlived its test for every thread's stack (SIGUSR2) before it kills it.
faulthandler.register(
    signal.SIGUSR2, file=open(Path(os.environ["PDINFO_DIR"]) / f"stacks-{os.getpid()}.txt", "w"), all_threads=True
)


def _environ(pid):
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(e.split("=", 1) for e in raw.decode(errors="replace").split("\0") if "=" in e)


@pytest.fixture
def pdinfo(request):
    def write(cluster, **extra):
        servers = []
        for s in cluster.servers:
            env = _environ(s.process.pid) if s.process else {}
            servers.append({
                "name": s.name, "pid": s.process.pid if s.process else None, "port": s.port,
                "side": s.side_channel_port, "vllm_port": s.ports.vllm_port if s.ports and s.role != "proxy" else None,
                "cvd": env.get("CUDA_VISIBLE_DEVICES"), "log": str(s.log_path),
                "started_at": s.process.started_at if s.process else None, "ready_seconds": s.ready_seconds,
            })
        info = {"test": request.node.nodeid, "servers": servers, "started_seconds": cluster.started_seconds,
                "t": time.time(), **extra}
        out = Path(os.environ["PDINFO_DIR"]) / f"{uuid.uuid4().hex}.json"
        out.with_suffix(".tmp").write_text(json.dumps(info))
        out.with_suffix(".tmp").rename(out)  # atomic: a watcher never reads half a file
        return info
    return write


def pytest_sessionfinish(session):
    # After every fixture teardown: when the servers were stopped.
    (Path(os.environ["PDINFO_DIR"]) / f"sessionfinish-{os.getpid()}").write_text(repr(time.time()))
"""


def _stat(pid: str) -> list[bytes] | None:
    """The ``/proc/<pid>/stat`` fields after the command name, or None when gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()
    return None if fields[0] in (b"Z", b"X") else fields  # zombies count as gone


def live_procs(mark: str) -> dict[int, str]:
    """``{pid: comm}`` of live processes whose environment carries ``PDSERVE_TEST_MARK=mark``."""
    needle = f"{MARK_ENV}={mark}".encode()
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid() or _stat(entry) is None:
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            comm = Path(f"/proc/{entry}/comm").read_text().strip()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found[int(entry)] = comm
    return found


def live_in_groups(pgids: set[int]) -> list[int]:
    """Live processes whose process group is one of ``pgids``."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and (f := _stat(e)) is not None and int(f[2]) in pgids]


def wait_for(cond: Callable[[], object], timeout: float, what: str) -> float:
    """Seconds until ``cond()`` is truthy; fails naming ``what`` after ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"{what}: not within {timeout}s")


def unheld_locks(lease_dir: Path) -> list[Path]:
    """Every lock file in ``lease_dir``, after checking that none is held (fails naming a held one)."""
    locks = sorted(lease_dir.glob("*.lock"))
    for path in locks:
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError when someone holds it
        except BlockingIOError:
            raise AssertionError(f"lease {path.name} is still held") from None
        finally:
            os.close(fd)
    return locks


def cluster_resources(info: dict[str, object]) -> tuple[set[str], set[int]]:
    """The GPUs (CUDA_VISIBLE_DEVICES entries, if any) and every port a ``pdinfo`` record's cluster holds."""
    gpus: set[str] = set()
    ports: set[int] = set()
    for s in info["servers"]:  # type: ignore[attr-defined]
        ports.add(s["port"])
        if s["name"] != "proxy":
            gpus.update(s["cvd"].split(",") if s["cvd"] else ())  # None without (simulated) GPUs
            ports |= {s["side"], *range(s["vllm_port"], s["vllm_port"] + VLLM_PORT_WINDOW)}
    return gpus, ports


class Inner:
    """One inner pytest setup: a test dir with the helper conftest, a mark, a lease dir and a log dir."""

    def __init__(self, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pytester = pytester
        self.mark = uuid.uuid4().hex
        self.info_dir = pytester.path / "pdinfo"
        self.info_dir.mkdir()
        self.log_dir = pytester.path / "logs"
        self.lease_dir = pytester.path / "leases"
        monkeypatch.setenv(MARK_ENV, self.mark)
        monkeypatch.setenv("PDINFO_DIR", str(self.info_dir))
        pytester.makeconftest(INNER_CONFTEST)

    def args(self, *extra: str) -> list[str]:
        """The inner pytest's arguments: the simulator, this setup's lease and log dirs, then ``extra``."""
        return [
            "--pd-engine=sim", f"--pd-lease-dir={self.lease_dir}", f"--pd-log-dir={self.log_dir}",
            "-p", "no:cacheprovider", *extra,
        ]  # fmt: skip

    def run_logs(self) -> Path:
        """The one inner run's own log directory (``<log dir>/<time>-<pid>``: each run writes into its own)."""
        [run] = [p for p in self.log_dir.iterdir() if p.is_dir()]
        return run

    def run(self, *extra: str, timeout: float = 240) -> pytest.RunResult:
        """Run the inner pytest to its end in a subprocess (bounded far beyond a loaded machine's tens of seconds,
        and below the outer test's own 300 s)."""
        return self.pytester.runpytest_subprocess(*self.args(*extra), timeout=timeout)

    @contextlib.contextmanager
    def popen(self, *extra: str) -> Iterator[subprocess.Popen[bytes]]:
        """The inner pytest in its own session (like a shell job: Ctrl-C goes to its whole group)."""
        with open(self.pytester.path / "inner-output.txt", "wb") as out:
            proc = self.pytester.popen(
                [sys.executable, "-m", "pytest", *self.args(*extra)],
                stdout=out,  # type: ignore[arg-type]  # pytest's stub says TextIO; any file object works
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=as_a_terminal_job,
            )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                self._print_stacks(proc)
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)

    def _print_stacks(self, proc: subprocess.Popen[bytes]) -> None:
        """Into the failing test's report: where each thread of a still running inner session is (the conftest's
        faulthandler writes them on SIGUSR2), and what the session wrote."""
        stacks = self.info_dir / f"stacks-{proc.pid}.txt"
        with contextlib.suppress(OSError, AssertionError):
            os.kill(proc.pid, signal.SIGUSR2)
            wait_for(lambda: stacks.stat().st_size > 0, GONE_WITHIN_S, "the inner session's stacks")
        with contextlib.suppress(OSError, AssertionError):
            print(f"--- the inner pytest (pid {proc.pid}) was still running; its threads:\n{stacks.read_text()}")
        with contextlib.suppress(OSError):
            print(f"--- its output:\n{self.output()}")

    def output(self) -> str:
        """What a ``popen`` inner pytest wrote (stdout and stderr)."""
        return (self.pytester.path / "inner-output.txt").read_text(errors="replace")

    def infos(self) -> list[dict[str, Any]]:
        """Every ``pdinfo`` record written so far (JSON, so ``Any`` values; each test knows the keys it wrote)."""
        return [json.loads(p.read_text()) for p in sorted(self.info_dir.glob("*.json"))]

    def wait_info(self, timeout: float = 120) -> dict[str, Any]:
        """The first ``pdinfo`` record, once one is written."""
        wait_for(lambda: list(self.info_dir.glob("*.json")), timeout, f"cluster up ({self.output()[-3000:]})")
        return self.infos()[0]

    def session_finished_at(self) -> float:
        """When the (single, non-xdist) inner session's ``pytest_sessionfinish`` ran."""
        [path] = self.info_dir.glob("sessionfinish-*")
        return float(path.read_text())

    def gone_within(self, timeout: float = GONE_WITHIN_S) -> float:
        """Seconds until no marked process is alive (fails listing the survivors)."""
        try:
            return wait_for(lambda: not live_procs(self.mark), timeout, "marked processes gone")
        except AssertionError:
            raise AssertionError(f"still alive after {timeout}s: {live_procs(self.mark)}") from None

    def assert_nothing_left(self, infos: list[dict[str, object]] | None = None) -> None:
        """No marked process within :data:`GONE_WITHIN_S`, and no member left in the servers' process groups."""
        self.gone_within()
        pgids = {s["pid"] for i in (infos or []) for s in i["servers"]}  # type: ignore[attr-defined]
        assert not live_in_groups(pgids), f"process groups {pgids} still have members"

    def assert_clean(self, infos: list[dict[str, object]]) -> None:
        """No process, no process group, no held lease left; every server log kept and non-empty."""
        self.assert_nothing_left(infos)
        unheld_locks(self.lease_dir)
        for s in (s for i in infos for s in i["servers"]):  # type: ignore[attr-defined]
            assert Path(s["log"]).stat().st_size > 0, s["log"]
