"""``--pd-reuse``'s pytest side: one plugin object, registered only when a run asks for reuse.

The main plugin's ``pytest_configure`` registers a `ReusePlugin` under :data:`~pytest_pdserve.reuse.PLUGIN_NAME`
when ``--pd-reuse`` (or a reuse mode) is given, as pytest registers its last-failed plugin for ``--lf``; a run
without it loads none of this package. The plugin decides whether this run reuses (refused on CI unless forced,
off in attach mode), checks the reuse directory (a bad one is a usage error, before any test), and holds what the
fixtures ask of it: the run's log directory, the servers' scratch, and the manager's `Reuser`. Its hooks add the
report header line (on or why off, and the kept clusters) and the terminal summary's saved start time.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from pytest_pdserve.common.redaction import redact
from pytest_pdserve.config.settings import PDServeConfig
from pytest_pdserve.reuse.client import list_kept
from pytest_pdserve.reuse.dirs import (
    ReuseOptions,
    default_reuse_dir,
    ensure_reuse_dir,
    prune_run_logs,
    reuse_decision,
    run_log_dir,
)
from pytest_pdserve.reuse.handover import KeptClusters

__all__ = ["ReusePlugin"]


class ReusePlugin:
    """``--pd-reuse`` for one pytest process: its options (None when refused), and its hooks."""

    def __init__(self, cfg: PDServeConfig, environ: Mapping[str, str]) -> None:
        """:raises ReuseError: the reuse directory is unusable (the main plugin makes it a usage error)."""
        self.enabled, self.why = reuse_decision(cfg.reuse, cfg.reuse_mode, environ)
        self.attach_mode = cfg.attach_mode
        #: Where kept clusters' state lives and their idle TTL; None: this run does not reuse.
        self.options: ReuseOptions | None = None
        if self.enabled and not cfg.attach_mode:
            self.options = ReuseOptions(ensure_reuse_dir(cfg.reuse_dir or default_reuse_dir()), cfg.reuse_ttl)
            prune_run_logs(self.options.directory)  # each reuse run without --pd-log-dir logs under it
        #: The manager's reuser, once the fixtures built one (what the summary reports).
        self.kept: KeptClusters | None = None

    def run_log_dir(self) -> Path | None:
        """This run's log directory under the reuse dir: kept servers outlive pytest's basetemp (it removes old
        ones, and a fixed --basetemp at every start). None: not reusing."""
        return run_log_dir(self.options.directory) if self.options is not None else None

    def reuser(self) -> KeptClusters | None:
        """The manager's `Reuser` (one per manager); None: not reusing."""
        if self.options is None:
            return None
        self.kept = KeptClusters(self.options)
        return self.kept

    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        """On, or why off; the kept clusters a run may attach to (with their age), and what the listing cleaned."""
        if not self.enabled or self.options is None:
            return [f"pdserve: reuse {self.why if not self.enabled else 'off: attach mode starts no servers'}"]
        cleaned: list[str] = []  # what the listing cleaned up (a keeper that is gone, a file that is no state)
        kept = list_kept(self.options.directory, report=cleaned.append)
        now = time.time()
        shown = ", ".join(f"{k.id} ({k.spec_name}, {_age(now - k.created)} old)" for k in kept[:6]) or "none"
        lines = [
            f"pdserve: reuse {self.why} (idle ttl {self.options.ttl:g}s, dir {self.options.directory}); "
            f"kept clusters: {shown}",
            *cleaned,
        ]
        return [redact(line) for line in lines]

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        """The start time this run saved by reusing kept clusters."""
        reused = self.kept.reused if self.kept is not None else []
        if reused:
            saved = sum(r.first_start_seconds for r in reused)
            names = ", ".join(r.describe().removeprefix("kept cluster ") for r in reused)
            terminalreporter.write_line(f"pdserve: reused {names}: {saved:.1f}s of cluster starts saved (--pd-reuse)")


def _age(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
