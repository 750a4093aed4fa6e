"""One process's row of ``/proc/<pid>/stat``: its parent, group, state and start time (the start time tells a pid
reused by another process apart). Below both the lock files (a holder's liveness) and the process trees
(``running/proctree.py``, which re-exports it). [pytest-free, stdlib]
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ProcInfo", "read_stat"]


@dataclass(frozen=True)
class ProcInfo:
    """One row of ``/proc/<pid>/stat``: what we need to walk trees and to guard against PID reuse."""

    pid: int
    ppid: int
    pgid: int
    state: str
    starttime: int

    @property
    def live(self) -> bool:
        """False for zombies (exited, not yet reaped) and dead entries."""
        return self.state not in ("Z", "X", "x")


def read_stat(pid: int) -> ProcInfo | None:
    """``/proc/<pid>/stat`` parsed, or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses, so split after the last ')'.
    rest = data[data.rindex(b")") + 2 :].split()
    try:
        return ProcInfo(pid, int(rest[1]), int(rest[2]), rest[0].decode(), int(rest[19]))
    except (IndexError, ValueError):
        return None
