"""log_wakeup.py: a write to a watched log ends the readiness poll's sleep early; without inotify it is a plain sleep.

What it buys is measured in benchmarks/bench_startup.py (the plugin notices a server ~3 ms after it serves, was ~4.5);
these tests check the mechanism and its fallbacks, with bounds far from any timing a loaded machine could reach.
"""

from __future__ import annotations

import ctypes
import os
import resource
import threading
import time
from pathlib import Path

import pytest

from pytest_pdserve.running import process
from pytest_pdserve.running.log_wakeup import LogWakeup


def _write_soon(path: Path, after: threading.Event, before_write: threading.Event | None = None) -> threading.Thread:
    def write() -> None:
        after.wait(30)
        if before_write is not None:
            before_write.set()
        with path.open("a") as fh:
            fh.write("INFO:     Application startup complete.\n")

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def test_a_write_to_a_watched_log_ends_the_sleep(tmp_path: Path) -> None:
    log = tmp_path / "decode-0.log"
    log.write_text("pdserve: starting decode-0\n")
    other = tmp_path / "prefill-0.log"
    other.write_text("")
    go = threading.Event()
    with LogWakeup([other, log]) as wakeup:
        assert wakeup.active
        assert wakeup.sleep(0.01) is False  # nothing written: the whole sleep, and says so
        thread = _write_soon(log, go)
        go.set()
        t0 = time.monotonic()
        assert wakeup.sleep(240) is True
        assert time.monotonic() - t0 < 60  # woken by the write, not by the 240 s
        thread.join(10)
        assert wakeup.sleep(0.01) is False  # the events were drained: the next sleep is a whole one again
    assert not wakeup.active  # closed


def _is_inotify(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify"
    except OSError:
        return False


def test_close_leaves_the_kernels_wait_to_another_thread_and_the_fd_is_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closing an inotify fd with watches waits for an SRCU grace period (5-15 ms on the CI machine): close() must not
    pay it on the caller's thread, which is the start's critical path, and the fd must still end up closed."""
    log = tmp_path / "decode-0.log"
    log.write_text("")
    closed_on: list[int] = []
    real_close = os.close

    def recording_close(fd: int) -> None:
        if fd == watched:
            closed_on.append(threading.get_ident())
        real_close(fd)

    wakeup = LogWakeup([log])
    assert wakeup.active
    watched = wakeup._fd  # noqa: SLF001 (the fd under test)
    assert watched is not None
    assert _is_inotify(watched)
    monkeypatch.setattr(os, "close", recording_close)
    wakeup.close()
    assert not wakeup.active
    for _ in range(6000):  # bounded: 60 s, polled every 10 ms
        if closed_on:
            break
        time.sleep(0.01)
    assert closed_on, "the inotify fd was never closed"
    assert closed_on[0] != threading.get_ident(), "close() closed the inotify fd on the caller's thread"
    wakeup.close()  # idempotent: nothing left to close
    assert len(closed_on) == 1


def test_without_inotify_the_sleep_is_plain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No inotify (another OS, or fs.inotify.max_user_instances used up): the poll sleeps as before."""

    class NoInotify:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def inotify_init1(self, flags: int) -> int:
            return -1  # EMFILE

    log = tmp_path / "x.log"
    log.write_text("")
    monkeypatch.setattr(ctypes, "CDLL", NoInotify)
    with LogWakeup([log]) as wakeup:
        assert not wakeup.active
        t0 = time.monotonic()
        assert wakeup.sleep(0.05) is False
        assert time.monotonic() - t0 >= 0.05
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: (_ for _ in ()).throw(OSError("no libc")))
    assert not LogWakeup([log]).active


def test_a_log_that_is_not_there_is_not_watched(tmp_path: Path) -> None:
    with LogWakeup([tmp_path / "missing.log"]) as wakeup:
        assert not wakeup.active
        assert wakeup.sleep(0) is False


def test_the_poll_probes_soon_after_a_server_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """wait_all_ready sleeps in LogWakeup: a log line makes it probe within the fast window, not after the poll
    interval (made 240 s here, so only the wake can end the wait in time)."""
    monkeypatch.setattr(process, "poll_interval", lambda waited: 240.0)
    log = tmp_path / "sim.log"
    ready = threading.Event()
    probes: list[float] = []

    class Fake:
        name, log_path, started_at = "decode-0", log, time.monotonic()

        def poll_ready(self, client: object) -> bool:
            probes.append(time.monotonic())
            return ready.is_set()

        def ready_seconds(self) -> float:
            return 1.0

        def __init__(self) -> None:
            self.first = threading.Event()

    log.write_text("")
    fake = Fake()
    # The server becomes ready and logs only after the poll's first probe said no: then only a wake ends its 240 s
    # sleep.
    thread = _write_soon(log, fake.first, before_write=ready)
    original = fake.poll_ready

    def poll_ready(client: object) -> bool:
        answer = original(client)
        fake.first.set()
        return answer

    fake.poll_ready = poll_ready  # type: ignore[method-assign]
    t0 = time.monotonic()
    process.wait_all_ready([fake], time.monotonic() + 480)  # type: ignore[list-item]
    assert time.monotonic() - t0 < 60, "the poll slept its interval out: the log line did not wake it"
    assert len(probes) >= 2
    thread.join(10)


def test_an_inotify_fd_above_fd_setsize_still_wakes(tmp_path: Path) -> None:
    """select() refuses fds above 1024; a session with many open files (its limit raised by common/rlimits.py) gets
    such an fd for its inotify instance, and the poll must neither crash nor lose the wake."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 2048), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        log = tmp_path / "decode-0.log"
        log.write_text("")
        go = threading.Event()
        with LogWakeup([log]) as wakeup:
            assert wakeup.active
            assert wakeup._fd is not None  # noqa: SLF001 (the case under test)
            assert wakeup._fd > 1024  # noqa: SLF001
            thread = _write_soon(log, go)
            go.set()
            assert wakeup.sleep(60) is True
            thread.join(10)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
