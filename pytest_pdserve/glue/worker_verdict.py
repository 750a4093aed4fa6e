"""What an xdist worker concluded, carried to the controller.

Under pytest-xdist each worker starts and exports its own ``--pd-export-env`` cluster, judges its own modules
(``kv_moved``) and checks its own items' markers. But a worker's terminal summary is shown nowhere, its exit status
is not the run's (xdist's controller decides from the test reports alone), and a worker that raises (a usage
error, ``pytest.exit``) is a crash that xdist answers with a restart, again and again, ending in "no tests ran"
(exit code 5) or an INTERNALERROR that never shows the message. The rule: **a worker never stops the run itself;
its verdict, its reason to stop and its summary lines reach the controller** (``workeroutput``, the channel xdist
gives workers for this), which prints them once with the workers' ids and ends the run with that exit status.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pytest_pdserve.common.redaction import redact

__all__ = ["exit_status", "lines", "receive", "send", "stop", "stopped"]

#: The ``workeroutput`` key (xdist sends the dict to the controller once the worker's sessionfinish has run).
KEY = "pdserve_verdict"
#: (worker id, summary lines, the exit status it asks for, or 0)
_RELAYED = pytest.StashKey[list[tuple[str, list[str], int]]]()
_STOPPED = pytest.StashKey[tuple[str, int]]()


def stop(config: pytest.Config, message: str, status: int) -> bool:
    """Stop the run with ``message`` and exit ``status``. In an xdist worker: remembered (the worker then collects
    nothing, :func:`stopped`, and :func:`send` hands both to the controller): True. Elsewhere False: the caller
    raises as usual (``pytest.UsageError``, ``pytest.exit``)."""
    if not hasattr(config, "workerinput"):
        return False
    config.stash.setdefault(_STOPPED, (message, int(status)))
    return True


def stopped(config: pytest.Config) -> str | None:
    """Why this xdist worker stopped the run (:func:`stop`), or None."""
    got = config.stash.get(_STOPPED, None)
    return got[0] if got is not None else None


def send(config: pytest.Config, summary: Callable[[], list[str]], failed_run: bool) -> None:
    """In a worker (``pytest_sessionfinish``): hand the controller this worker's summary lines (``summary()``,
    called only in a worker: it scrapes the servers), its reason to stop, and whether it failed the run."""
    out: dict[str, Any] | None = getattr(config, "workeroutput", None)
    if out is None:
        return
    got = config.stash.get(_STOPPED, None)
    said = [got[0]] if got is not None else summary()
    status = got[1] if got is not None else int(pytest.ExitCode.TESTS_FAILED) if failed_run else 0
    if said or status:
        worker = str(getattr(config, "workerinput", {}).get("workerid", "worker"))
        out[KEY] = {"worker": worker, "lines": [redact(line) for line in said], "exit": status}


def receive(config: pytest.Config, node: Any) -> None:
    """In the controller (xdist's ``pytest_testnodedown``): keep what a worker sent, if anything."""
    got = getattr(node, "workeroutput", None) or {}
    payload = got.get(KEY)
    if not isinstance(payload, dict):
        return
    worker = str(payload.get("worker", "worker"))
    relayed = config.stash.setdefault(_RELAYED, [])
    relayed.append((worker, [str(line) for line in payload.get("lines", ())], int(payload.get("exit", 0) or 0)))


def exit_status(config: pytest.Config) -> int:
    """The exit status the workers ask the run to end with (the gravest: a usage error over a failure), or 0."""
    relayed: list[tuple[str, list[str], int]] = config.stash.get(_RELAYED, [])
    return max((status for _, _, status in relayed), default=0)


def lines(config: pytest.Config) -> list[str]:
    """The workers' lines, each once, prefixed with the ids of the workers that said it."""
    relayed: list[tuple[str, list[str], int]] = config.stash.get(_RELAYED, [])
    said: dict[str, list[str]] = {}
    for worker, got, _ in sorted(relayed):
        for line in got:
            said.setdefault(line, []).append(worker)
    return [f"[{', '.join(workers)}] {line}" for line, workers in said.items()]
