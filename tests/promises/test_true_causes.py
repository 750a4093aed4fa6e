"""Issue 43, class 7: errors that name the wrong cause.

* A lease directory out of inodes read as "no 16 adjacent free ports" plus a warning per port tried: a file system
  that cannot take a file (full, out of inodes, read-only) or a process out of descriptors is said once, as it is
  (``paths.fs_error_words``, used by ``paths.check_dir`` and ``lockfiles``).
* A non-ASCII ``--pd-log-dir`` under ``LC_ALL=C PYTHONUTF8=0`` read as "not valid UTF-8": the locale is named, with
  what to do (``common/locale_text.py``), through argv, ``PYTEST_ADDOPTS``, the environment and the ini.
* A 150,000-character test id killed the start with ``OSError: [Errno 7] Argument list too long``: the watchdog,
  guard and keeper inherited ``PYTEST_CURRENT_TEST``. Every child's environment is built by one rule
  (``common/child_env.py``): no child inherits it, a helper leaves out what Linux cannot pass, a server start
  names the variable.
* Two ``pdserve stop --all`` at once: the loser said a cluster was not stopped, though it was (``client.stop_kept``:
  stopped by anyone is stopped).
"""

from __future__ import annotations

import ast
import contextlib
import errno
import os
import subprocess
import sys
from pathlib import Path

import _reuse
import pytest
from _mounts import tmpfs as _tmpfs
from _pdsession import Inner
from _reuse import states

from pytest_pdserve import cli
from pytest_pdserve.common.child_env import MAX_ARG_STRLEN, child_environ
from pytest_pdserve.errors import EnvTooLarge, LeaseDirUnusable
from pytest_pdserve.machine import lockfiles, port_leases
from pytest_pdserve.reuse import client

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

inner = _reuse.inner
reuse_dir = _reuse.reuse_dir

PACKAGE = Path(__file__).resolve().parents[2] / "pytest_pdserve"
PASSING = "def test_a(pd_cluster):\n    assert pd_cluster.complete('a b c', max_tokens=1)\n"


# --------------------------------------------------------------------------- a lease dir that takes no file


def _fill_inodes(directory: Path) -> int:
    made = 0
    with contextlib.suppress(OSError):
        for made in range(1, 10_000):  # noqa: B007 - the count is the answer
            (directory / f"filler-{made}").touch()
    return made


#: Fills the lease dir's inodes once the run is configured (its lease dir checked), before any cluster starts.
FILL_LATE = """
import contextlib, os
from pathlib import Path

def pytest_collection_finish(session):
    lease = Path(os.environ["LEASE_DIR"])
    with contextlib.suppress(OSError):
        for i in range(10_000):
            (lease / f"late-{i}").touch()
"""


@pytest.mark.parametrize("when", ["full before the run", "nearly full before the run", "full during the run"])
def test_a_lease_dir_out_of_inodes_is_said_once_as_it_is(
    inner: Inner, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """Full before the run: a usage error at start-up naming the lease dir's setting. Nearly full (a probe file
    fits, a few lock files do, then none): the start fails naming the lock file it could not create. Filled after
    the run was configured: the start fails naming the lease dir. Each says ENOSPC and `df -i` once, and no port is
    called busy (the outside run printed "no 16 adjacent free ports" and a warning per port tried)."""
    with _tmpfs(inner.lease_dir, "size=4M,nr_inodes=40,mode=1777"):
        inner.pytester.makepyfile(PASSING)
        if when == "full during the run":
            monkeypatch.setenv("LEASE_DIR", str(inner.lease_dir))
            inner.pytester.makeconftest(inner.pytester.path.joinpath("conftest.py").read_text() + FILL_LATE)
        else:
            _fill_inodes(inner.lease_dir)
            if when == "nearly full before the run":
                for name in ("filler-1", "filler-2", "filler-3"):
                    (inner.lease_dir / name).unlink()
        result = inner.run()
        out = result.stdout.str() + result.stderr.str()
        assert "No space left on device (ENOSPC: the file system is out of space or of inodes" in out, out[-3000:]
        assert f"df -i {inner.lease_dir}" in out, out[-3000:]
        assert "adjacent free ports" not in out, out[-3000:]
        assert "ports free in" not in out, out[-3000:]
        assert "is not a pdserve lock file" not in out, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        assert out.count("No space left on device") <= 2, out[-3000:]  # the error, and its summary line
        if when == "full before the run":  # checked at configure: a usage error naming the setting
            assert result.ret == pytest.ExitCode.USAGE_ERROR
            assert "lease_dir" in out or "--pd-lease-dir" in out, out[-3000:]
        else:
            result.assert_outcomes(errors=1)
        assert "chmod" not in out, out[-3000:]  # no owner's chmod helps a full file system
        if when != "full before the run":
            assert "LeaseDirUnusable: lease directory" in out, out[-3000:]


def test_a_read_only_lease_dir_and_a_process_out_of_fds_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _tmpfs(tmp_path / "ro", "size=1M,mode=1777") as fs:
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True, capture_output=True)
        with pytest.raises(LeaseDirUnusable, match=r"Read-only file system \(EROFS: the file system is read-only\)"):
            lockfiles.try_lock(fs / "port-20000.lock")
    real_open = os.open
    opened: list[str] = []

    def out_of_fds(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if str(path).endswith(".lock") and flags & os.O_CREAT:
            opened.append(str(path))
            if len(opened) > 3:  # three lock files of the span, then no descriptor left
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    leases = tmp_path / "leases"
    leases.mkdir()
    monkeypatch.setattr(os, "open", out_of_fds)
    with pytest.raises(LeaseDirUnusable, match=r"Too many open files \(EMFILE: this process has too many open files"):
        port_leases.acquire_port_span(leases, 16, low=20000, high=20999)
    assert sorted(p.name for p in leases.glob("*.lock")) == []  # the three it held went back, files and all
    assert lockfiles.describe_holder(leases / "port-20000.lock") == "an unknown holder"  # diagnostics never raise


# ------------------------------------------------------------------------------ a path under the C locale

#: Where the log dir is given, and how (the value is the same non-ASCII, valid-UTF-8 path).
LOCALE_VIAS = ["argv", "PYTEST_ADDOPTS", "env", "ini"]


@pytest.mark.parametrize("via", LOCALE_VIAS)
def test_a_non_ascii_log_dir_under_the_c_locale_names_the_locale(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, via: str
) -> None:
    logs = pytester.path / "логи"
    for var in ("LANG", "LC_CTYPE", "LANGUAGE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LC_ALL", "C")
    monkeypatch.setenv("PYTHONUTF8", "0")
    args: list[str] = []
    if via == "argv":
        args = [f"--pd-log-dir={logs}"]
    elif via == "PYTEST_ADDOPTS":
        monkeypatch.setenv("PYTEST_ADDOPTS", f"--pd-log-dir={logs}")
    elif via == "env":
        monkeypatch.setenv("PDSERVE_LOG_DIR", str(logs))
    else:
        pytester.makeini("[pytest]\npdserve_log_dir = логи\n")
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess(
        "--pd-engine=sim", f"--pd-lease-dir={pytester.path / 'leases'}", "-p", "no:cacheprovider", *args, timeout=120
    )
    err = result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()[-2000:] + err
    assert "ascii (LC_ALL=C, UTF-8 mode off: PYTHONUTF8=0)" in err, err
    assert "LC_ALL=C.UTF-8" in err, err
    assert "PYTHONUTF8=1" in err, err
    assert "not valid UTF-8" not in err, err
    assert "Traceback" not in err, err
    assert not logs.exists()


# --------------------------------------------------------------------------------- what children inherit

#: Tests whose ids are 150,000 characters (PYTEST_CURRENT_TEST carries the id while a test runs): the first starts
#: the watchdog and the guard, the last is running (its teardown) when the keeper of --pd-reuse starts. Between
#: them, a test sets a variable no program can be given, and asks for another cluster.
HUGE_ID = """
import os
import pytest

@pytest.mark.parametrize("x", [0], ids=["a" * 150_000])
def test_huge_id_first(pd_cluster, x):
    assert pd_cluster.complete("a b c", max_tokens=1)

def test_a_late_huge_variable(pd_cluster_factory):
    os.environ["PDSERVE_TEST_BIG"] = "x" * 200_000  # set late, by a test: no server can be given it
    pd_cluster_factory(block_size=16)

@pytest.mark.parametrize("x", [0], ids=["b" * 150_000])
def test_huge_id_last(pd_cluster, pdinfo, x):
    pdinfo(pd_cluster)
    assert pd_cluster.complete("a b c", max_tokens=1)
"""


def test_a_huge_test_id_reaches_no_child_and_a_huge_variable_is_named(inner: Inner, reuse_dir: Path) -> None:
    """The watchdog, the guard and the keeper start while a test of a 150,000-character id runs (and a variable
    of 200,000 bytes is set): they start, without either; the servers' start names the variable."""
    inner.pytester.makepyfile(HUGE_ID)
    result = _reuse.run_reuse(inner, reuse_dir)
    out = result.stdout.str() + result.stderr.str()
    result.assert_outcomes(passed=2, failed=1)
    assert "Argument list too long" not in out, out[-3000:]
    result.stdout.fnmatch_lines(["*EnvTooLarge: environment variable PDSERVE_TEST_BIG is 200,000 bytes long*"])
    [state] = states(reuse_dir)  # the keeper started (during the last huge-id test's teardown) and keeps it
    for pid in [state["keeper"]["pid"], *(s["pid"] for s in state["servers"])]:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert b"PYTEST_CURRENT_TEST=" not in environ, pid
        assert b"PDSERVE_TEST_BIG=" not in environ, pid
    assert cli.main(["--dir", str(reuse_dir), "stop", "--all"]) == 0
    inner.gone_within()


def test_the_rule_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "t.py::test[" + "a" * 150_000 + "] (call)")
    monkeypatch.setenv("PDSERVE_TEST_FINE", "y")
    env = child_environ({"PDSERVE_TEST_ADDED": "1", "PDSERVE_TEST_FINE": None}, drop=("PATH",))
    assert "PYTEST_CURRENT_TEST" not in env
    assert "PATH" not in env
    assert "PDSERVE_TEST_FINE" not in env
    assert env["PDSERVE_TEST_ADDED"] == "1"
    monkeypatch.setenv("PDSERVE_TEST_LATE", "read now, not at configure")
    assert child_environ()["PDSERVE_TEST_LATE"] == "read now, not at configure"
    taken = {"PYTEST_CURRENT_TEST": "t.py::x (call)", "KEPT": "1"}  # a copy a caller took: the same rule applies
    assert child_environ({"ADDED": "2"}, base=taken) == {"KEPT": "1", "ADDED": "2"}
    monkeypatch.setenv("PDSERVE_TEST_BIG", "x" * MAX_ARG_STRLEN)
    assert "PDSERVE_TEST_BIG" not in child_environ()
    with pytest.raises(EnvTooLarge, match="environment variable PDSERVE_TEST_BIG is 131,072 bytes long"):
        child_environ(oversize="refuse")
    monkeypatch.setenv("PDSERVE_TEST_BIG", "x" * (MAX_ARG_STRLEN - 32))  # fits alone
    arg_max = os.sysconf("SC_ARG_MAX")
    if arg_max > 64 << 20:
        pytest.skip(f"ARG_MAX is {arg_max} here (an unlimited stack): the total is not reached")
    for i in range(arg_max // 100_000 + 2):  # each fits, together they are more than the kernel's total
        monkeypatch.setenv(f"PDSERVE_TEST_MANY_{i}", "x" * 100_000)
    env = child_environ()
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True, timeout=60)
    with pytest.raises(EnvTooLarge, match="more than Linux passes to a program"):
        child_environ(oversize="refuse")


def test_every_child_pdserve_starts_gets_the_one_rule() -> None:
    """Every ``subprocess`` call of the plugin (the simulator is a program of its own, started with the rule) passes
    ``env=`` built by ``child_environ`` (the servers' through ``launch.child_env``, kept in ``ServerProcess.env``)."""
    calls: list[tuple[str, str | None]] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "sim" in path.relative_to(PACKAGE).parts:
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if not (isinstance(node.func.value, ast.Name) and node.func.value.id == "subprocess"):
                continue
            if node.func.attr not in ("Popen", "run", "call", "check_call", "check_output"):
                continue
            given = next((k.value for k in node.keywords if k.arg == "env"), None)
            calls.append((f"{path.relative_to(PACKAGE)}:{node.lineno}", ast.unparse(given) if given else None))
    assert len(calls) >= 7, calls
    assert [c for c in calls if c[1] is None] == []
    for where, env in calls:
        module = (PACKAGE / where.split(":")[0]).read_text()
        if env is None or env == "self.env":  # ServerProcess: what launch.child_env built
            continue
        assert "child_environ(" in env or (env == "env" and "env = child_environ(" in module), (where, env)
    launch = (PACKAGE / "running" / "launch.py").read_text()
    assert 'return child_environ(delta, oversize="refuse"' in launch  # the servers': refused, never dropped


# ---------------------------------------------------------------------------- two `pdserve stop` at once

#: Two clusters kept by one keeper: stopping one leaves the keeper running with the other.
TWO_KEPT = """
def test_up(pd_cluster, pd_cluster_factory):
    assert pd_cluster.complete("a", max_tokens=1)
    assert pd_cluster_factory(block_size=16).complete("a", max_tokens=1)
"""


def test_a_cluster_stopped_by_another_stop_is_stopped(inner: Inner, reuse_dir: Path) -> None:
    """`pdserve stop` in two terminals: the loser's cluster was stopped by the winner. Reported as stopped (exit 0),
    whether its keeper still runs (other clusters) or has just exited; a real failure still fails."""
    inner.pytester.makepyfile(TWO_KEPT)
    _reuse.run_reuse(inner, reuse_dir).assert_outcomes(passed=1)
    first, second = client.list_kept(reuse_dir)
    assert client.stop_kept(first) is True  # the winner
    assert client.stop_kept(first) is True  # the loser, with what it had listed: its keeper runs on (second)
    assert [k.id for k in client.list_kept(reuse_dir)] == [second.id]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "pytest_pdserve.cli", "--dir", str(reuse_dir), "stop", "--all"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for _ in range(2)
    ]
    outs = [(p.communicate(timeout=120)[0].decode(errors="replace"), p.returncode) for p in procs]
    assert [code for _, code in outs] == [0, 0], outs
    assert all("did not stop it" not in out for out, _ in outs), outs
    assert client.stop_kept(second) is True  # its keeper has exited since: still stopped
    inner.gone_within()
    assert states(reuse_dir) == []
