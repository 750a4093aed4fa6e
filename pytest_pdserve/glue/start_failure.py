"""A cluster that cannot start fails its test with the error's own message, not with the plugin's traceback.

The start errors already say what failed, the last lines of the server's log, a hint and where the full log is;
the ~70 lines of plugin source pytest printed around them (fixtures, manager, launch, process) only hid that.
Only the report changes: code that calls ``pd_cluster_factory`` still catches the error by its type.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pytest_pdserve.errors import (
    EngineVersionUnknown,
    EnvironmentRefused,
    LeaseTimeout,
    NotOwner,
    PathError,
    PortInUse,
    ResponseTooLarge,
    ServerStartupError,
)

__all__ = ["START_ERRORS", "report_as_message"]

#: What a cluster's start raises on purpose (errors.py); any other exception keeps pytest's traceback. A
#: PathError is a directory the start needs (logs, vLLM's cache root); its message names the path and the remedy.
START_ERRORS = (
    ServerStartupError, PortInUse, LeaseTimeout, PathError, EngineVersionUnknown, ResponseTooLarge,
    EnvironmentRefused, NotOwner,
)  # fmt: skip
_NOT_THE_USERS = (Path(__file__).resolve().parents[1], *{Path(p).resolve() for p in (sys.prefix, sys.base_prefix)})


def report_as_message(call: pytest.CallInfo[None]) -> None:
    """Turn a start error in ``call`` into a failure that pytest shows as its message alone (``pytrace=False``),
    with the line of the test's own code that asked for the cluster, when there is one."""
    excinfo = call.excinfo
    if excinfo is None or not isinstance(excinfo.value, START_ERRORS):
        return
    message = f"{type(excinfo.value).__name__}: {excinfo.value}"
    # The test's own frames: not ours, not pytest's or pluggy's (installed under the interpreter's prefix).
    callers = [e for e in excinfo.traceback if not set(_NOT_THE_USERS) & set(Path(str(e.path)).resolve().parents)]
    if callers:
        entry = callers[-1]
        message += f"\n(the cluster was asked for at {entry.path}:{entry.lineno + 1}, in {entry.name})"
    try:
        pytest.fail(message, pytrace=False)
    except pytest.fail.Exception:
        call.excinfo = pytest.ExceptionInfo.from_current()
