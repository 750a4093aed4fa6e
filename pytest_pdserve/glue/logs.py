"""Per-test log slices: what each server and the proxy wrote while one test ran, attached when it fails.

Only servers that wrote during the test (or died) get a section: the others' "(no output during this test)" was
most of a failure's report on a cluster of several servers.

Offsets are recorded at the start of each test; a cluster started during that test's setup has no
offset and contributes everything it wrote. The sections travel inside the test report, so they reach
the terminal (and JUnit XML) under xdist too, where ``-s`` cannot show live output.
"""

from __future__ import annotations

import pytest

from pytest_pdserve.common.redaction import redact
from pytest_pdserve.glue.fixtures import session_of

OFFSETS = pytest.StashKey[dict[str, int]]()
#: Lines per server kept in a failure report; the full logs stay on disk (path in the section title).
MAX_LINES = 200


def record_offsets(item: pytest.Item) -> None:
    """Remember where each running server's log ends, before ``item`` runs."""
    manager = session_of(item.config).manager
    offsets: dict[str, int] = {}
    if manager is not None:
        for cluster in manager.running():
            for server in cluster.servers:
                if server.log_path is not None:
                    offsets[str(server.log_path)] = server.log_offset()
    item.stash[OFFSETS] = offsets


def attach_sections(item: pytest.Item, report: pytest.TestReport) -> None:
    """Add one report section per server that wrote during this test, or is dead (failed reports only)."""
    if not report.failed:
        return
    manager = session_of(item.config).manager
    if manager is None:
        return
    offsets = item.stash.get(OFFSETS, {})
    for cluster in manager.running():
        for server in cluster.servers:
            if server.log_path is None:
                continue
            text = server.read_log(since=offsets.get(str(server.log_path), 0))
            lines = text.splitlines()
            if len(lines) > MAX_LINES:
                lines = [f"[... {len(lines) - MAX_LINES} earlier lines in {server.log_path}]"] + lines[-MAX_LINES:]
            proc = server.process
            dead = proc is not None and proc.pid is not None and not proc.alive
            if not lines and not dead:
                continue  # a server that wrote nothing during the test has nothing to say about it
            body = "\n".join(lines) if lines else "(no output during this test)"
            if dead and proc is not None:
                # A server that died during an earlier test explains this one's errors: say so, with its last words.
                body = f"{server.name} is not running: exit code {proc.returncode}\n{proc.log_tail(30)}\n" + body
            # Redacted: vLLM logs its non-default args, and server code may print anything it was given.
            report.sections.append((f"pdserve {server.name} log ({server.log_path})", redact(body)))


def redact_report(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Every text of a report through the one redaction rule: its failure (or skip) text and its sections.

    Whatever raised it (a ``ServerDied`` with its log excerpt, ``pytest.fail`` with a server's answer, a test
    that printed a response), the terminal, JUnit XML and xdist all read the report, so a registered secret
    is hidden in every one of them. The structured traceback is kept unless it holds a secret (then it
    becomes its redacted text: colours are lost, never the words).
    """
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, lineno, reason)
        path, lineno, reason = longrepr
        report.longrepr = (path, lineno, redact(reason))
    elif longrepr is not None:
        text = str(longrepr)
        if redact(text) != text:
            report.longrepr = redact(text)
    report.sections = [(title, redact(body)) for title, body in report.sections]
