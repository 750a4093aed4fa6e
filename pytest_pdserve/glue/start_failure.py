"""An error raised on the user's behalf fails its test with the error's own message and the user's line, not with the
plugin's traceback.

Two kinds: a cluster that cannot start (the start errors already say what failed, the last lines of the server's
log, a hint and where the full log is), and a bad value the user gave (a ``ClusterSpec`` field, a factory call, a
setting: ``ClusterSpecError``, ``SettingError``, ``ExtraArgsError``; a configuration vLLM would refuse:
``VllmRefuses``). The ~70 lines of plugin source pytest printed around them (spec validation, fixtures, manager,
launch, process) only hid that. Only the report changes: code that calls ``pd_cluster_factory`` or builds a
``ClusterSpec`` still catches the error by its type. A module that raises one at import (a ``ClusterSpec`` at module
level) gets the same message as its collection error.
"""

from __future__ import annotations

import linecache
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_pdserve.errors import (
    ClusterSpecError,
    EngineVersionUnknown,
    EnvironmentRefused,
    EnvTooLarge,
    ExtraArgsError,
    LeaseTimeout,
    NotOwner,
    PathError,
    PortInUse,
    ResponseTooLarge,
    ServerStartupError,
    SettingError,
)

__all__ = ["START_ERRORS", "USER_ERRORS", "report_as_message", "rewrite_collect_report"]

#: What a cluster's start raises on purpose (errors.py); any other exception keeps pytest's traceback. A
#: PathError is a directory the start needs (logs, vLLM's cache root); its message names the path and the remedy.
START_ERRORS = (
    ServerStartupError, PortInUse, LeaseTimeout, PathError, EngineVersionUnknown, ResponseTooLarge,
    EnvironmentRefused, NotOwner, EnvTooLarge,
)  # fmt: skip
#: A value the user gave that pdserve (or vLLM, through pytest_pdserve/rules/) refuses.
USER_ERRORS = (ClusterSpecError, SettingError, ExtraArgsError)
_PLUGIN = Path(__file__).resolve().parents[1]
_NOT_THE_USERS = (_PLUGIN, *{Path(p).resolve() for p in (sys.prefix, sys.base_prefix)})


def _users(path: str) -> bool:
    """Whether ``path`` is the user's code: not ours, not pytest's or pluggy's (installed under the interpreter's
    prefix), not generated (a dataclass ``__init__`` is ``<string>``)."""
    if not path or path.startswith("<"):
        return False
    resolved = Path(path).resolve()
    return not set(_NOT_THE_USERS) & {resolved, *resolved.parents}


def _where(path: str, lineno: int, name: str | None, source: str | None) -> str:
    joined = " ".join(part.strip() for part in (source or "").splitlines() if part.strip())  # a call over lines
    line = f": {joined}" if joined else ""
    return f"{path}:{lineno}{f', in {name}' if name else ''}{line}"


def report_as_message(call: pytest.CallInfo[None]) -> None:
    """Turn a start error or a user error in ``call`` into a failure that pytest shows as its message alone
    (``pytrace=False``), with the line of the test's own code that asked for the cluster or gave the value."""
    excinfo = call.excinfo
    if excinfo is None or not isinstance(excinfo.value, (*START_ERRORS, *USER_ERRORS)):
        return
    message = f"{type(excinfo.value).__name__}: {excinfo.value}"
    callers = [e for e in excinfo.traceback if _users(str(e.path))]
    if callers:
        entry = callers[-1]
        try:
            source = str(entry.statement)
        except Exception:  # no source (a frozen module): the location alone
            source = None
        where = _where(str(entry.path), entry.lineno + 1, entry.name, source)
        started = isinstance(excinfo.value, START_ERRORS)
        message += f"\n({'the cluster was asked for' if started else 'raised'} at {where})"
    try:
        pytest.fail(message, pytrace=False)
    except pytest.fail.Exception:
        call.excinfo = pytest.ExceptionInfo.from_current()


def rewrite_collect_report(report: pytest.CollectReport) -> None:
    """A module whose import raised a user error (a bad ``ClusterSpec`` at module level): its collection error is
    the message and the module's line, not the plugin's traceback."""
    if not report.failed:
        return
    longrepr: Any = report.longrepr
    crash = getattr(longrepr, "reprcrash", None)
    chain = getattr(longrepr, "chain", None)
    if crash is None or not chain:
        return
    names = {f"{cls.__module__}.{cls.__name__}" for cls in (*USER_ERRORS, *_subclasses(USER_ERRORS))}
    kind, _, text = str(crash.message).partition(": ")
    if kind not in names:
        return
    entries = getattr(chain[-1][0], "reprentries", [])
    users = [e for e in entries if getattr(e, "reprfileloc", None) is not None and _users(e.reprfileloc.path)]
    message = f"{kind.rpartition('.')[2]}: {text}"
    if users:
        loc = users[-1].reprfileloc
        source = next((line[1:].strip() for line in users[-1].lines if line.startswith(">")), None)
        source = source or linecache.getline(loc.path, loc.lineno).strip() or None
        message += f"\n(raised at {_where(loc.path, loc.lineno, None, source)}, while importing the module)"
    report.longrepr = message


def _subclasses(classes: tuple[type, ...]) -> list[type]:
    found: list[type] = []
    for cls in classes:
        sub: type
        for sub in cls.__subclasses__():
            found += [sub, *_subclasses((sub,))]
    return found
