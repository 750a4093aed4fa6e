"""Whose is it: the process that started it (issue 43, class 3). [pytest-free, stdlib]

A test may fork: ``os.fork()``, multiprocessing's ``fork`` start method, a library that daemonizes. The child is a
copy of pytest with everything pdserve holds: the cluster manager, every server's ``Popen``, the lease fds, the
watchdog's socket, the guard's ``Popen``, the atexit safety net and, when the child returns through pytest
(``sys.exit(0)`` in a test is a failed test, not the end of the process), the rest of the session with its fixture
finalizers and ``pytest_unconfigure``. Every one of them acting in the child stops, unlocks or tells the watchdog
to leave what the parent still uses; the parent's next test then meets a server that exited 0.

The rule: whatever has a life outside this process (a server, a lease, a supervisor, the manager of clusters)
records the pid that made it, an :class:`Owner`, and every way of ending it is a no-op in any other pid:
``ServerProcess.stop`` (so the atexit net, a launcher's cleanup), ``Lease`` release (no unlock, no unlink: the
child closes only its own copies of the fds), the watchdog's commands and its ``close``, the guard's stop,
``ClusterManager.stop`` / ``stop_all`` / ``ensure_watchdog`` (so the fixtures' finalizers, ``pytest_unconfigure``,
the last-user stops and the ``--pd-reuse`` hand-over). A child may use a cluster the parent started (send it
requests); asking for one that is not running raises :class:`~pytest_pdserve.errors.NotOwner`. The lifeline pipe
needs nothing more: the child closes its copy of the write end at the fork (``running/supervise.py``), which the
parent and the watchdog still hold.
"""

from __future__ import annotations

import os

__all__ = ["Owner"]


class Owner:
    """The pid that made something; :attr:`here` is False in a forked child (and in anything it forks)."""

    __slots__ = ("pid",)

    def __init__(self) -> None:
        self.pid = os.getpid()

    @property
    def here(self) -> bool:
        """Whether this process made it (only then may it end it)."""
        return os.getpid() == self.pid

    def refuse(self, what: str) -> None:
        """Raise `NotOwner` naming ``what`` when this is not the process that made it."""
        if not self.here:
            # Here, not at the top: the watchdog imports this module under `python -I -S` (stdlib only).
            from pytest_pdserve.errors import NotOwner

            raise NotOwner(
                f"pdserve: {what}: this process (pid {os.getpid()}) is a fork of the pytest process that owns "
                f"pdserve's clusters (pid {self.pid}); a forked child may use a running cluster but not start or "
                "stop one (end a child that must not run the rest of the session with os._exit())"
            )

    def __repr__(self) -> str:
        return f"<Owner pid={self.pid}{'' if self.here else ' (not this process)'}>"
