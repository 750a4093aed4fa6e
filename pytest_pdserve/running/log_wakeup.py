"""Wake the readiness poll when a starting server writes to its log, so it is noticed about a millisecond after it
starts serving instead of half a poll interval later. [pytest-free]

uvicorn logs "Application startup complete." and starts listening right after, in vLLM and in the simulator alike;
the poll (``process.wait_all_ready``) sleeps in :meth:`LogWakeup.sleep`, which returns early when any watched log is
written (Linux ``inotify``, through ctypes: no dependency). A wake is only a hint to probe sooner: readiness is still
decided by the HTTP check alone, and without inotify (another OS, no instance left under
``fs.inotify.max_user_instances``) the sleep is a plain ``time.sleep``, the poll as before.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import select
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

__all__ = ["LogWakeup"]

_IN_MODIFY = 0x00000002
_IN_DONT_FOLLOW = 0x02000000  # a log replaced by a symlink is not followed (logfile.py refuses those anyway)
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000


class LogWakeup:
    """Sleeps that end early when one of ``paths`` is written to. A context manager; closes its inotify fd."""

    def __init__(self, paths: Iterable[Path]) -> None:
        self._fd: int | None = None
        self._poll: select.poll | None = None
        try:
            import ctypes  # lazily: only a session that starts servers pays its import

            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
            if fd < 0:
                return
            watched = 0
            for path in paths:
                if libc.inotify_add_watch(fd, os.fsencode(path), _IN_MODIFY | _IN_DONT_FOLLOW) >= 0:
                    watched += 1
            if watched:
                self._fd = fd
                # poll, not select: select refuses an fd above FD_SETSIZE (1024), which a session with its open-files
                # limit raised (common/rlimits.py) and many clients can hand out.
                self._poll = select.poll()
                self._poll.register(fd, select.POLLIN)
            else:
                os.close(fd)
        except (OSError, AttributeError):  # no libc with inotify here: plain sleeps
            self._fd = None

    @property
    def active(self) -> bool:
        """Whether writes wake the sleeps (inotify is available and watches at least one log)."""
        return self._fd is not None

    def sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True when it ended early because a watched log was written."""
        if self._fd is None or seconds < 0.001:
            # poll counts in whole milliseconds (rounded up): a shorter sleep is a plain one, and the poll's fast
            # window, which sleeps 0.5 ms, probes that often anyway.
            time.sleep(max(0.0, seconds))
            return False
        assert self._poll is not None
        if not self._poll.poll(seconds * 1000):
            return False
        with contextlib.suppress(BlockingIOError, InterruptedError):
            for _ in range(64):  # bounded: drain what queued up (events are small; 64 reads is plenty)
                if not os.read(self._fd, 65536):
                    break
        return True

    def close(self) -> None:
        """Stop watching. The fd itself is closed on a thread of its own: closing an inotify instance that has watches
        waits for the kernel's SRCU grace period (milliseconds: docs/benchmarks.md), and this close sits between the
        servers' readiness and the P/D-ready round trip. The syscall releases the GIL, so the start goes on meanwhile;
        ``_thread`` rather than ``threading`` because ``Thread.start`` waits for the new thread to run."""
        fd, self._fd, self._poll = self._fd, None, None
        if fd is not None:
            try:
                _thread.start_new_thread(_close_quietly, (fd,))
            except RuntimeError:  # no thread to be had (interpreter shutdown, a thread limit): close it here
                _close_quietly(fd)

    def __enter__(self) -> LogWakeup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
