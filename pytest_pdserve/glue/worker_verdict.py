"""What an xdist worker's session cluster concluded, carried to the controller.

Under pytest-xdist each worker starts and exports its own ``--pd-export-env`` cluster, and each judges its own
modules (``kv_moved``). But a worker's terminal summary is shown nowhere, and its exit status is not the run's:
xdist's controller decides from the test reports alone. So ``--pd-require-kv-transfer`` (on under ``--pd-preset``)
would fail nothing and say nothing: a green that lies. The rule: **a worker's verdict and summary lines reach the
controller** (``workeroutput``, the channel xdist gives workers for this), which prints them, each with its
worker's id, and fails the run when a worker failed it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pytest_pdserve.common.redaction import redact

__all__ = ["failed", "lines", "receive", "send"]

#: The ``workeroutput`` key (xdist sends the dict to the controller once the worker's sessionfinish has run).
KEY = "pdserve_verdict"
_RELAYED = pytest.StashKey[list[tuple[str, list[str], bool]]]()


def send(config: pytest.Config, summary: Callable[[], list[str]], failed_run: bool) -> None:
    """In a worker (``pytest_sessionfinish``): hand the controller this worker's summary lines (``summary()``,
    called only in a worker: it scrapes the servers) and whether it failed the run. Nothing outside a worker."""
    out: dict[str, Any] | None = getattr(config, "workeroutput", None)
    if out is None:
        return
    summary_lines = summary()
    if summary_lines or failed_run:
        worker = str(getattr(config, "workerinput", {}).get("workerid", "worker"))
        out[KEY] = {"worker": worker, "lines": [redact(line) for line in summary_lines], "failed": failed_run}


def receive(config: pytest.Config, node: Any) -> None:
    """In the controller (xdist's ``pytest_testnodedown``): keep what a worker sent, if anything."""
    got = getattr(node, "workeroutput", None) or {}
    payload = got.get(KEY)
    if not isinstance(payload, dict):
        return
    worker = str(payload.get("worker", "worker"))
    relayed = config.stash.setdefault(_RELAYED, [])
    relayed.append((worker, [str(line) for line in payload.get("lines", ())], bool(payload.get("failed"))))


def failed(config: pytest.Config) -> bool:
    """Whether a worker failed the run (the controller's exit status follows it)."""
    relayed: list[tuple[str, list[str], bool]] = config.stash.get(_RELAYED, [])
    return any(bad for _, _, bad in relayed)


def lines(config: pytest.Config) -> list[str]:
    """The workers' summary lines, each prefixed with its worker's id, in worker order."""
    relayed: list[tuple[str, list[str], bool]] = config.stash.get(_RELAYED, [])
    relayed = sorted(relayed)
    return [f"[{worker}] {line}" for worker, got, _ in relayed for line in got]
