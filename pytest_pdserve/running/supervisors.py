"""The session's two supervisors, the watchdog (watchdog.py) and the guard (supervise.py): started together before
a cluster's servers, started again if either died, stopped after every cluster. They stop our servers when pytest
(and, for the guard, the watchdog too) is dead; docs/architecture.md "Supervision" has the whole picture.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from pytest_pdserve.common.logfile import open_append
from pytest_pdserve.common.owner import Owner
from pytest_pdserve.running.supervise import start_guard
from pytest_pdserve.running.watchdog import Watchdog

__all__ = ["Supervisors"]


class Supervisors:
    """The watchdog and the guard of one pytest process (one run token)."""

    def __init__(
        self, run_token: str, shutdown_timeout: float, log_path: Callable[[str], Path], report: Callable[[str], None]
    ) -> None:
        self.run_token = run_token
        self.shutdown_timeout = shutdown_timeout
        self._log_path = log_path
        self.report = report
        #: The running watchdog, or None before the first cluster and after :meth:`close`.
        self.watchdog: Watchdog | None = None
        self._guard: subprocess.Popen[bytes] | None = None
        #: The pytest process they supervise for; a forked child neither restarts nor stops them (common/owner.py).
        self.owner = Owner()

    def _log(self, name: str) -> Path | None:
        """The watchdog's or the guard's log, or None (it logs nowhere) when what is there is refused (a link, a
        FIFO: logfile.open_append); said on the terminal, where their own stderr would be captured by pytest."""
        path = self._log_path(name)
        try:
            os.close(open_append(path))
        except OSError as exc:
            self.report(f"pdserve: not writing {path}: {exc.strerror or exc}; that supervisor logs nowhere")
            return None
        return path

    def watch(self) -> Watchdog:
        """The session's watchdog, (re)started with the guard if either is gone (both sweep by run token).

        :raises NotOwner: in a forked child (its copies of the parent's ``Popen`` objects read as exited)."""
        self.owner.refuse("start the watchdog and the guard")
        if self._guard is None or self._guard.poll() is not None:
            # The second supervisor: acts only once pytest and the watchdog are both gone (supervise.py).
            self._guard = start_guard(self.run_token, self.orphan_grace(), self._log("guard.log"))
        if self.watchdog is None or not self.watchdog.alive:
            # wait=False: the hello is checked at the first command, after the servers are spawned.
            self.watchdog = Watchdog.start(
                self.run_token,
                grace=self.orphan_grace(),
                log_path=self._log("watchdog.log"),
                wait=False,
            )
        return self.watchdog

    def close(self) -> None:
        """Stop the watchdog and the guard (after every cluster is stopped). Safe to call twice; nothing in a forked
        child."""
        if not self.owner.here:
            return
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None
        if self._guard is not None:  # nothing left to guard; it would exit with this process anyway
            self._guard.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._guard.wait(5)
            self._guard = None

    def orphan_grace(self) -> float:
        """SIGTERM-to-SIGKILL grace of the watchdog and the guards, who stop servers when pytest is dead.

        At most 3 s, so that no server is alive 5 s after pytest died, even one that ignores SIGTERM.
        """
        return min(self.shutdown_timeout, 3.0)
