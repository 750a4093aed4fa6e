"""Start-up progress lines of a cluster's servers: what a person (or a CI log) sees while vLLM starts."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["StartProgress", "shorten"]

Reporter = Callable[[str], None]


class StartProgress:
    """Start-up progress: role, elapsed time, last log line.

    On a terminal, at most one line per role per 5 s. Into a log (CI, a pipe) a line only when the role's last log
    line changed since its previous line, or after 30 s without one; at most one per 5 s and none in a start's
    first 5 s. A start that only waits repeated one line every 5 s per server: most of a CI log.
    """

    EVERY = 5.0
    QUIET_EVERY = 30.0

    def __init__(self, report: Reporter, terminal: bool = True) -> None:
        self.report = report
        self.terminal = terminal
        self.last: dict[str, float] = {}
        self.shown: dict[str, str] = {}

    def __call__(self, name: str, elapsed: float, last_line: str) -> None:
        now = time.monotonic()
        # Into a log, the first line too waits 5 s: a start that takes less (the simulator's) shows none.
        since = now - self.last.get(name, 0.0 if self.terminal else now - elapsed)
        if since < self.EVERY:
            return
        if not self.terminal and last_line == self.shown.get(name) and since < self.QUIET_EVERY:
            return
        self.last[name] = now
        self.shown[name] = last_line
        self.report(f"pdserve: starting {name} ({elapsed:.0f}s) {shorten(last_line)}")


#: How much of a log line a progress line shows: its start (vLLM's level, time and source file, then the message).
LINE_CHARS = 400


def shorten(line: str, limit: int = LINE_CHARS) -> str:
    """``line`` whole up to ``limit`` characters, else its first ``limit`` and how many more there are: a line is read
    from its start (the log file has every line in full)."""
    if len(line) <= limit:
        return line
    return f"{line[:limit]} [... {len(line) - limit} more characters in the log]"
