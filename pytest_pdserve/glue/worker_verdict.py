"""What an xdist worker concluded, carried to the controller.

Under pytest-xdist each worker starts and exports its own ``--pd-export-env`` cluster, judges its own modules
(``kv_moved``) and checks its own items' markers. But a worker's terminal summary is shown nowhere, its exit status
is not the run's (xdist's controller decides from the test reports alone), and a worker that raises (a usage
error, ``pytest.exit``) is a crash that xdist answers with a restart, again and again, ending in "no tests ran"
(exit code 5) or an INTERNALERROR that never shows the message. The rule: **a worker never stops the run itself;
its verdict, its reason to stop and its summary lines reach the controller** (``workeroutput``, the channel xdist
gives workers for this), which prints them once with the workers' ids and ends the run with that exit status.

Two plugin objects, registered by plugin.py's ``pytest_configure`` only under xdist, each where it acts (as
pytest-xdist registers its ``DSession`` only in distribution mode): :class:`WorkerVerdict` in a worker,
:class:`ControllerVerdicts` in the controller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pytest_pdserve.common.redaction import redact

__all__ = ["ControllerVerdicts", "WorkerVerdict", "hand_over", "register", "stop"]

#: The ``workeroutput`` key (xdist sends the dict to the controller once the worker's sessionfinish has run).
KEY = "pdserve_verdict"
#: The names the plugins are registered under (``config.pluginmanager.get_plugin``).
WORKER = "pdserve-worker-verdict"
CONTROLLER = "pdserve-controller-verdicts"


class WorkerVerdict:
    """An xdist worker's: why it stopped the run (:func:`stop`), and what its summary says (:func:`hand_over`)."""

    def __init__(self) -> None:
        #: The message and exit status the first :func:`stop` asked for.
        self.stopped: tuple[str, int] | None = None
        #: The summary's lines, asked for only at the end (they scrape the servers), and whether the worker failed
        #: the run (``--pd-require-kv-transfer``).
        self.summary: Callable[[], list[str]] = list
        self.failed_run = False

    def pytest_collection(self, session: pytest.Session) -> bool | None:
        """A worker that stopped the run (its session cluster did not start) imports no module and collects
        nothing. (Registered after xdist's own worker plugin, this runs first and so skips its ``collectionstart``
        event, which xdist's controller ignores.)"""
        if self.stopped is None:
            return None
        session.items = []
        session.testscollected = 0
        session.config.hook.pytest_collection_finish(session=session)
        return True

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Hand the controller this worker's reason to stop, or its summary lines and whether it failed the run
        (after the features' own ``pytest_sessionfinish``, inside xdist's, which sends ``workeroutput``)."""
        out: dict[str, Any] | None = getattr(session.config, "workeroutput", None)
        if out is None:
            return
        if self.stopped is not None:
            said, status = [self.stopped[0]], self.stopped[1]
        else:
            said, status = self.summary(), int(pytest.ExitCode.TESTS_FAILED) if self.failed_run else 0
        if said or status:
            worker = str(getattr(session.config, "workerinput", {}).get("workerid", "worker"))
            out[KEY] = {"worker": worker, "lines": [redact(line) for line in said], "exit": status}


class ControllerVerdicts:
    """xdist's controller's: what each worker sent, printed once and ending the run with the gravest exit status."""

    def __init__(self) -> None:
        #: (worker id, summary lines, the exit status it asks for, or 0)
        self.relayed: list[tuple[str, list[str], int]] = []

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: object) -> None:
        """Keep what a worker sent, if anything."""
        got = getattr(node, "workeroutput", None) or {}
        payload = got.get(KEY)
        if not isinstance(payload, dict):
            return
        worker = str(payload.get("worker", "worker"))
        self.relayed.append(
            (worker, [str(line) for line in payload.get("lines", ())], int(payload.get("exit", 0) or 0))
        )

    def exit_status(self) -> int:
        """The exit status the workers ask the run to end with (the gravest: a usage error over a failure), or 0."""
        return max((status for _, _, status in self.relayed), default=0)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """The run ends with the workers' exit status where it would have passed or failed."""
        relayed = self.exit_status()
        ended = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED, pytest.ExitCode.TESTS_FAILED)
        if relayed and session.exitstatus in ended:
            session.exitstatus = pytest.ExitCode(max(relayed, 1 if session.exitstatus else 0))

    def lines(self) -> list[str]:
        """The workers' lines, each once, prefixed with the ids of the workers that said it."""
        said: dict[str, list[str]] = {}
        for worker, got, _ in sorted(self.relayed):
            for line in got:
                said.setdefault(line, []).append(worker)
        return [f"[{', '.join(workers)}] {line}" for line, workers in said.items()]

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        failed = self.exit_status() != 0
        for line in self.lines():
            terminalreporter.write_line(line, red=failed)


def register(config: pytest.Config) -> None:
    """``pytest_configure``: the worker's plugin in an xdist worker, the controller's in xdist's controller (xdist's
    own test, as its ``DSession`` is registered: a distribution mode and nodes to run on, not ``--collect-only``);
    neither elsewhere."""
    if hasattr(config, "workerinput"):
        config.pluginmanager.register(WorkerVerdict(), WORKER)
    elif (
        config.getoption("dist", "no") != "no"
        and bool(config.getoption("tx", None))
        and not config.getoption("collectonly", False)
    ):
        config.pluginmanager.register(ControllerVerdicts(), CONTROLLER)


def _worker(config: pytest.Config) -> WorkerVerdict | None:
    plugin = config.pluginmanager.get_plugin(WORKER)
    return plugin if isinstance(plugin, WorkerVerdict) else None


def stop(config: pytest.Config, message: str, status: int) -> bool:
    """Stop the run with ``message`` and exit ``status``. In an xdist worker: remembered (the worker then collects
    nothing, and hands both to the controller at its end): True. Elsewhere False: the caller raises as usual
    (``pytest.UsageError``, ``pytest.exit``)."""
    worker = _worker(config)
    if worker is None:
        return False
    if worker.stopped is None:
        worker.stopped = (message, int(status))
    return True


def hand_over(config: pytest.Config, summary: Callable[[], list[str]], failed_run: bool) -> None:
    """In an xdist worker (a feature's ``pytest_sessionfinish``): the summary lines (``summary()``, called only in a
    worker and only at its end: it scrapes the servers) and whether this worker failed the run. Elsewhere nothing."""
    worker = _worker(config)
    if worker is not None:
        worker.summary = summary
        worker.failed_run = failed_run
