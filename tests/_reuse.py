"""What the ``--pd-reuse`` test modules share (test_reuse, test_reuse_hostile): the inner test, fixtures, runs.

Each case runs inner pytest sessions (``pytester``, in subprocesses) with a private reuse dir and lease dir; the
modules import the fixtures from here (``from _reuse import inner, reuse_dir``), so there is one copy of each.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _pdsession import Inner, unheld_locks

from pytest_pdserve import cli
from pytest_pdserve.reuse import dirs

__all__ = ["UP", "claimed_run", "inner", "kept_one", "reuse_dir", "run_reuse", "states", "stop_all", "up_until"]

UP = """
def test_up(pd_cluster, pdinfo):
    pdinfo(pd_cluster, reused=pd_cluster.reused.kept_id if pd_cluster.reused else None)
    assert pd_cluster.complete("hello " * 10, max_tokens=2)["choices"]
"""


def up_until(go: Path) -> str:
    """An inner test that takes ``pd_cluster``, reports it, waits (at most 240 s) for the file ``go``, then sends a
    request: the outer test acts on the claimed cluster in between."""
    return f"""
import time
from pathlib import Path

def test_up(pd_cluster, pdinfo):
    pdinfo(pd_cluster, reused=pd_cluster.reused.kept_id if pd_cluster.reused else None)
    deadline = time.monotonic() + 240
    while not Path({str(go)!r}).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pd_cluster.complete("hello " * 10, max_tokens=2)
"""


@contextlib.contextmanager
def claimed_run(inner: Inner, reuse_dir: Path) -> Iterator[tuple[dict[str, Any], subprocess.Popen[bytes], Path]]:
    """Keep a cluster, then start a second reuse run that claims it and waits inside its test: yields the kept
    state, that run's process and the file that lets its test go on (`up_until`)."""
    inner.pytester.makepyfile(UP)
    state = kept_one(inner, reuse_dir)
    go = inner.pytester.path / "go"
    inner.pytester.makepyfile(up_until(go))
    for p in inner.info_dir.glob("*.json"):
        p.unlink()
    with inner.popen("--pd-reuse", f"--pd-reuse-dir={reuse_dir}") as proc:
        assert inner.wait_info()["reused"] == state["id"]
        yield state, proc, go


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Inner:
    for var in dirs.CI_ENV_VARS:  # CI refuses --pd-reuse (mode local); the CI case sets it itself
        monkeypatch.delenv(var, raising=False)
    return Inner(pytester, monkeypatch)


@pytest.fixture
def reuse_dir(inner: Inner) -> Iterator[Path]:
    """The inner sessions' reuse dir; whatever a case leaves kept is stopped afterwards."""
    path = inner.pytester.path / "reuse"
    yield path
    if path.is_dir():
        cli.main(["--dir", str(path), "stop", "--all"])


def run_reuse(inner: Inner, reuse_dir: Path, *extra: str, timeout: float = 120) -> pytest.RunResult:
    return inner.run("--pd-reuse", f"--pd-reuse-dir={reuse_dir}", *extra, timeout=timeout)


def states(reuse_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(reuse_dir.glob("*.json"))]


def kept_one(inner: Inner, reuse_dir: Path, *extra: str) -> dict[str, Any]:
    """Run the inner session once with reuse (one passing test) and return the one cluster it kept."""
    run_reuse(inner, reuse_dir, *extra).assert_outcomes(passed=1)
    [state] = states(reuse_dir)
    return state


def stop_all(reuse_dir: Path, inner: Inner) -> None:
    """``pdserve stop --all``, then nothing left: no marked process, no held lease, no state."""
    assert cli.main(["--dir", str(reuse_dir), "stop", "--all"]) == 0
    inner.gone_within()
    unheld_locks(inner.lease_dir)
    assert states(reuse_dir) == []
