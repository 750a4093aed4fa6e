"""Issue 25, class 2: no file the plugin writes is written through a link planted where it goes.

In a shared directory (a sticky /tmp, a CI workspace) another user can plant ``FILE`` as a symbolic link to a file
of yours: writing ``FILE`` would truncate or append to it. Every write goes through ``logfile.open_append`` or
``logfile.write_replace``; each case here plants a link to a *victim* file this test owns at one path the plugin
writes, and checks that the victim is untouched and that the output names the path.
"""

from __future__ import annotations

import os
from pathlib import Path

import _reuse
import pytest
from _pdsession import Inner
from _plant import plant_in_run_logs
from _reuse import run_reuse

from pytest_pdserve.common.created import MARKER
from pytest_pdserve.common.logfile import open_append, write_replace
from pytest_pdserve.reuse import keeper
from pytest_pdserve.reuse.dirs import ensure_reuse_dir

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

# The shared fixtures (tests/_reuse.py): one copy, bound here so pytest finds them.
inner = _reuse.inner
reuse_dir = _reuse.reuse_dir

VICTIM_TEXT = "the victim's own content\n"
PASSING = "def test_a(pd_cluster):\n    assert pd_cluster.complete('a b c', max_tokens=1)\n"


def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text(VICTIM_TEXT)
    return path


def assert_untouched(path: Path) -> None:
    assert path.read_text() == VICTIM_TEXT, path.read_text()[:500]


def export_file_setting(
    path: Path, via: str, pytester: pytest.Pytester | None = None
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) asking for the ``--pd-export-env`` file ``path`` through ``via``: the one place here
    that spells the option (``--pd-export-env-file=FILE``, which turns ``--pd-export-env`` on); ``ini`` writes
    the pytester's ini file."""
    if via == "argv":
        return [f"--pd-export-env-file={path}"], {}
    if via == "PYTEST_ADDOPTS":
        return [], {"PYTEST_ADDOPTS": f"--pd-export-env-file={path}"}
    if via == "ini":
        assert pytester is not None
        pytester.makeini(f"[pytest]\npdserve_export_env_file = {path}\n")
        return [], {}
    return [], {"PDSERVE_EXPORT_ENV_FILE": str(path)}


# ------------------------------------------------------------------------------------------ the helpers


def test_open_append_and_write_replace_refuse_a_link_by_name(tmp_path: Path) -> None:
    target = victim(tmp_path)
    link = tmp_path / "out.log"
    link.symlink_to(target)
    with pytest.raises(
        OSError, match=r"not a regular file \(a symbolic link; pdserve never writes through a link\)"
    ) as a:
        open_append(link)
    assert a.value.filename == str(link)
    with pytest.raises(OSError, match="a symbolic link") as b:
        write_replace(link, b"new\n")
    assert b.value.filename == str(link)
    assert link.is_symlink()  # refused, not replaced either
    hard = tmp_path / "hard.log"
    os.link(target, hard)
    with pytest.raises(OSError, match="a file with 2 hard links"):
        os.close(open_append(hard))
    with pytest.raises(OSError, match="a file with 2 hard links"):
        write_replace(hard, b"new\n")
    assert_untouched(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hard.log", "out.log", "victim.txt"]  # no temp left


def test_a_kept_clusters_state_file_is_not_written_through_a_link(tmp_path: Path) -> None:
    target = victim(tmp_path)
    state = tmp_path / "pd-1-abcdef.json"
    state.symlink_to(target)
    with pytest.raises(OSError, match="a symbolic link"):
        keeper._write_state(state, {"id": "pd-1-abcdef"})
    assert_untouched(target)
    fresh = tmp_path / "pd-2-abcdef.json"
    keeper._write_state(fresh, {"id": "pd-2-abcdef"})  # the normal case: written, owner-only
    assert fresh.read_text() == '{"id": "pd-2-abcdef"}'
    assert fresh.stat().st_mode & 0o777 == 0o600


# ------------------------------------------------------------------------------------- the export file


@pytest.mark.parametrize("via", ["argv", "PYTEST_ADDOPTS", "env", "ini"])
def test_a_link_planted_as_the_export_file_is_refused_and_its_target_kept(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, via: str
) -> None:
    target = victim(pytester.path)
    link = pytester.path / "shared" / "pd.env"
    link.parent.mkdir()
    link.symlink_to(target)
    args, env = export_file_setting(link, via, pytester)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    pytester.makepyfile("def test_a(): pass\n")
    result = pytester.runpytest_subprocess(
        "--pd-engine=sim", f"--pd-lease-dir={pytester.path / 'leases'}", "-p", "no:cacheprovider", *args, timeout=120
    )
    out = result.stdout.str() + result.stderr.str()
    assert result.ret != 0, out
    assert f"cannot write the export file {link}" in out, out
    assert "a symbolic link" in out, out
    assert_untouched(target)
    assert link.is_symlink()


def test_the_export_file_is_written_when_nothing_is_planted(pytester: pytest.Pytester) -> None:
    path = pytester.path / "pd.env"
    args, _ = export_file_setting(path, "argv")
    pytester.makepyfile("def test_a(): pass\n")
    result = pytester.runpytest_subprocess(
        "--pd-engine=sim", f"--pd-lease-dir={pytester.path / 'leases'}", "-p", "no:cacheprovider", *args, timeout=120
    )
    result.assert_outcomes(passed=1)
    assert "export PREFILL_PORT=" in path.read_text()
    assert [p.name for p in pytester.path.glob(".pd.env.*")] == []  # the temp file was renamed, none is left


# ------------------------------------------------------------------------------------- the log directory

#: (file in the run's log dir, whether the run fails: a server's log is required, the supervisors' are not)
LOG_FILES = [
    ("pd-1-prefill-0.log", True), ("pd-1-decode-0.log", True), ("pd-1-proxy.log", True),
    ("pdserve.log", False), ("watchdog.log", False), ("guard.log", False),
]  # fmt: skip


@pytest.mark.parametrize(("name", "fails"), LOG_FILES, ids=[n for n, _ in LOG_FILES])
def test_a_link_planted_in_the_log_dir_is_refused_and_its_target_kept(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, name: str, fails: bool
) -> None:
    target = victim(pytester.path)
    plant_in_run_logs(pytester, monkeypatch, "link", name, str(target))
    pytester.makepyfile(PASSING)
    logs = pytester.path / "logs"
    result = pytester.runpytest_subprocess(
        "--pd-engine=sim", f"--pd-lease-dir={pytester.path / 'leases'}", f"--pd-log-dir={logs}", "-p",
        "no:cacheprovider", timeout=120,
    )  # fmt: skip
    out = result.stdout.str() + result.stderr.str()
    assert_untouched(target)
    [run_dir] = logs.iterdir()
    assert f"{run_dir / name}" in out, out
    assert "not a regular file (a symbolic link" in out, out
    if fails:
        result.assert_outcomes(errors=1)
    else:  # the session's and the supervisors' own logs: the run goes on without them
        result.assert_outcomes(passed=1)


# --------------------------------------------------------------------------------- the reuse directory


@pytest.mark.parametrize("name", ["keeper.log", MARKER])
def test_a_link_planted_in_the_reuse_dir_is_refused_and_its_target_kept(
    inner: Inner,
    reuse_dir: Path,
    name: str,
) -> None:
    target = victim(inner.pytester.path)
    reuse_dir.mkdir(mode=0o700)
    if name != MARKER:
        ensure_reuse_dir(reuse_dir)  # pdserve's own directory, so what is in it is pdserve's to write
    (reuse_dir / name).symlink_to(target)
    inner.pytester.makepyfile(PASSING)
    result = run_reuse(inner, reuse_dir)
    out = result.stdout.str() + result.stderr.str()
    assert_untouched(target)
    assert f"{reuse_dir / name}" in out or f"{reuse_dir}: cannot create {name}" in out, out
    assert "a symbolic link" in out, out
