"""Issue 43, class 1: data loss. A directory pdserve treats as its own must be proven to be its own, and pdserve
removes, renames over or truncates only what it can prove it created (``common/created.py``).

The outside case: ``--pd-reuse-dir=.`` in an empty directory was accepted and marked; the user then saved files
there, and ``pdserve ls`` and the next run removed a ``package.json`` ("not a kept-cluster state") and old
``logs/2024-*`` directories. Here every door that names the reuse directory (argv, ``PYTEST_ADDOPTS``, the ini,
the environment, ``pdserve --dir``) is given ``.``, ``~``, a repository root and a parent of the current
directory; a reuse directory that was accepted gets the user's files, links to their data and a FIFO, and is then
used by runs, ``pdserve ls``, ``pdserve stop`` and a kept cluster's keeper; a planted state file names the user's
files as a server's log and IPC directory; a lease directory holds files named like lock files; the export file
appears while the cluster starts. Nothing of the user's may be lost or changed. The rule's own cases (copied
markers, swapped directories, read-only and full file systems) are tests/common/test_created.py.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import _reuse
import pytest
from _mounts import tmpfs as _tmpfs
from _pdsession import Inner
from _reuse import UP, kept_one, run_reuse, states

from pytest_pdserve import cli
from pytest_pdserve.common import created
from pytest_pdserve.common.logfile import open_append, write_replace
from pytest_pdserve.errors import ReuseError
from pytest_pdserve.reuse import client, dirs

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

inner = _reuse.inner
reuse_dir = _reuse.reuse_dir

MINE = "the user's own content\n"
PASSING = "def test_a(pd_cluster):\n    assert pd_cluster.complete('a b c', max_tokens=1)\n"


def _users_files(path: Path, victim: Path) -> dict[Path, str]:
    """What a user saves in a directory: a project file, JSON that is no state, old log directories, a link to
    their data elsewhere, a FIFO. Returns each regular file with its content (the links and FIFO are checked apart)."""
    files = {
        path / "package.json": json.dumps({"name": "mine"}),
        path / "notes.json": "[1, 2, 3]",
        path / "keeper.log.1": MINE,
    }
    for i in range(8):
        files[path / "logs" / f"2024-01-0{i}" / "build.log"] = MINE
    for file, text in files.items():
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text)
    for i in range(8):
        os.utime(path / "logs" / f"2024-01-0{i}", (0, 0))  # old: what pruning would pick first
    (path / "logs" / "2025-link").symlink_to(victim.parent)
    (path / "victim.json").symlink_to(victim)
    os.mkfifo(path / "fifo.json")
    return files


def _assert_kept(files: dict[Path, str], victim: Path) -> None:
    lost = {str(p): t for p, t in files.items() if not p.is_file() or p.read_text() != t}
    assert lost == {}, f"the user's files were removed or changed: {sorted(lost)}"
    assert victim.read_text() == MINE
    parent = next(iter(files)).parent
    assert (parent / "logs" / "2025-link").is_symlink()
    assert (parent / "victim.json").is_symlink()
    assert stat.S_ISFIFO(os.lstat(parent / "fifo.json").st_mode)


# --------------------------------------------------------------------- a user's place, through every door

#: (place, door): the place given as the reuse directory, and how. "." is the issue's case: an empty current
#: directory. "~" is an empty home directory; "repo" a repository root; "parent" the current directory's parent.
PLACES = [(".", "argv"), (".", "PYTEST_ADDOPTS"), (".", "ini"), (".", "env"), ("~", "env"), ("repo", "argv"),
          ("parent", "ini")]  # fmt: skip
WHY = {
    ".": "is the current directory",
    "~": "is your home directory",
    "repo": "is a repository root (it holds .git)",
    "parent": "is a parent of the current directory",
}
SOURCE = {
    "argv": "--pd-reuse-dir",
    "PYTEST_ADDOPTS": "--pd-reuse-dir",
    "ini": "ini key pdserve_reuse_dir",
    "env": "environment variable PDSERVE_REUSE_DIR",
}


@pytest.mark.parametrize(("place", "door"), PLACES)
def test_a_users_place_is_never_a_reuse_dir_through_any_door(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    place: str,
    door: str,
) -> None:
    """The reuse dir is refused before any test, naming the path, why, and where the setting came from; nothing is
    created in it (no marker). Then the user saves files there and `pdserve ls|stop` is pointed at it the same way
    (`--dir`, `PDSERVE_REUSE_DIR`): refused, exit 2, nothing removed."""
    for var in dirs.CI_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    work = pytester.path / "work"
    work.mkdir(mode=0o700)
    home = pytester.path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    test_file = pytester.makepyfile(test_x="def test_x():\n    pass\n")
    if place == "repo":
        (work / "proj" / ".git").mkdir(parents=True)
        cwd, given, target = work, "proj", work / "proj"
    elif place == "parent":
        (work / "sub").mkdir()
        cwd, given, target = work / "sub", "..", work
    elif place == "~":
        cwd, given, target = work, "~", home
    else:
        cwd, given, target = work, ".", work
    argv = [sys.executable, "-m", "pytest", str(test_file), "-p", "no:cacheprovider", "--pd-engine=sim",
            f"--pd-lease-dir={pytester.path / 'leases'}", "--pd-reuse"]  # fmt: skip
    env = dict(os.environ)
    if door == "argv":
        argv.append(f"--pd-reuse-dir={given}")
    elif door == "PYTEST_ADDOPTS":
        env["PYTEST_ADDOPTS"] = f"--pd-reuse-dir={given}"
    elif door == "ini":
        (cwd / "pytest.ini").write_text(f"[pytest]\npdserve_reuse_dir = {given}\n")
        argv += ["-c", str(cwd / "pytest.ini")]
    else:
        env["PDSERVE_REUSE_DIR"] = given
    before = sorted(p.name for p in target.iterdir())
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == pytest.ExitCode.USAGE_ERROR, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"reuse directory {target}" in out.stderr or f"reuse directory {cwd / given}" in out.stderr, out.stderr
    assert WHY[place] in out.stderr, out.stderr
    assert f"(reuse_dir from {SOURCE[door]}" in out.stderr, out.stderr
    assert sorted(p.name for p in target.iterdir()) == before  # no marker, nothing made
    victim = pytester.path / "victim" / "data.txt"
    victim.parent.mkdir()
    victim.write_text(MINE)
    files = _users_files(target, victim)
    monkeypatch.chdir(cwd)
    for args in (["ls"], ["ls", "--json"], ["stop", "--all"]):
        for how in (["--dir", given], []):
            if how:
                monkeypatch.delenv("PDSERVE_REUSE_DIR", raising=False)
            else:
                monkeypatch.setenv("PDSERVE_REUSE_DIR", given)
            assert cli.main([*how, *args]) == 2, (how, args)
            assert WHY[place] in capsys.readouterr().err, (how, args)
    _assert_kept(files, victim)
    assert not (target / created.MARKER).exists()


# --------------------------------------------------------------------- a reuse dir the user then fills


def test_a_reuse_dir_a_user_fills_loses_nothing_to_runs_ls_stop_or_the_keeper(inner: Inner, reuse_dir: Path) -> None:
    """An empty directory the user made is accepted as the reuse dir (the README's "new, empty, or one pdserve used
    before"); the user then saves files there (and in the run's log directory). Two reuse runs (keep, reuse),
    `pdserve ls`, `pdserve stop --all` (the keeper removes the servers' logs) and a run after that: every file of
    the user's is there, unchanged, and what pdserve made (old run logs, the kept cluster's logs) is removed."""
    reuse_dir.mkdir(mode=0o700)
    victim = inner.pytester.path / "victim" / "data.txt"
    victim.parent.mkdir()
    victim.write_text(MINE)
    inner.pytester.makepyfile(UP)
    state = kept_one(inner, reuse_dir)
    files = _users_files(reuse_dir, victim)
    # Old run log directories pdserve made (marked, their logs recorded): what pdserve made there it prunes; the
    # user's file saved in one of them stays, and so does that directory.
    old_runs = []
    for i in range(7):
        run = created.make_dir(reuse_dir / "logs" / f"20200101-00000{i}-1-0000000{i}", 0o700, created.RUN_LOGS)
        os.close(open_append(run / "pdserve.log"))
        old_runs.append(run)
    files[old_runs[1] / "mine.txt"] = MINE
    (old_runs[1] / "mine.txt").write_text(MINE)
    for run in old_runs:
        os.utime(run, (0, 0))
    # The kept decode server's log, replaced by the user's own file of that name (an editor's save): the keeper
    # removes the servers' logs when it stops the cluster, and this one is no longer the file it was.
    decode_log = Path(next(s["log_path"] for s in state["servers"] if s["name"] == "decode-0"))
    prefill_log = Path(next(s["log_path"] for s in state["servers"] if s["name"] == "prefill-0"))
    (decode_log.parent / "saved.tmp").write_text(MINE)
    os.replace(decode_log.parent / "saved.tmp", decode_log)
    files[decode_log] = MINE
    second = run_reuse(inner, reuse_dir)
    second.assert_outcomes(passed=1)
    second.stdout.fnmatch_lines(["*reuse: left *notes.json alone*pdserve did not create it*"])
    second.stdout.fnmatch_lines(["*reused kept cluster*"])
    assert "pdserve: reuse: removed" not in second.stdout.str()
    assert not old_runs[0].exists()  # pdserve's own, old, beyond the newest 5: pruned
    assert old_runs[1].is_dir()
    assert all(r.is_dir() for r in old_runs[2:])
    assert cli.main(["--dir", str(reuse_dir), "ls"]) == 0
    assert cli.main(["--dir", str(reuse_dir), "stop", "--all"]) == 0
    inner.gone_within()
    assert not prefill_log.exists()  # pdserve's own log of the stopped cluster: removed by its keeper
    run_reuse(inner, reuse_dir).assert_outcomes(passed=1)
    assert cli.main(["--dir", str(reuse_dir), "stop", "--all"]) == 0
    _assert_kept(files, victim)


def test_a_planted_state_naming_the_users_files_costs_none_of_them(tmp_path: Path) -> None:
    """A state file (as pdserve writes one) whose keeper is gone names the user's directory as a server's IPC
    directory (named like one, `pdserve-rpc-*`) and the user's file as its log: `pdserve ls` sweeps the cluster
    and removes the state, and neither the directory nor the file (pdserve made neither)."""
    reuse = dirs.ensure_reuse_dir(tmp_path / "reuse")
    rpc = tmp_path / "pdserve-rpc-abcdefgh"
    rpc.mkdir()
    (rpc / "socket-lookalike").write_text(MINE)
    log = tmp_path / "important.log"
    log.write_text(MINE)
    server = {"pid": 2**22 + 1, "pgid": 2**22 + 1, "starttime": 1, "token": f"none-{os.getpid()}",
              "url": "http://127.0.0.1:9", "name": "prefill-0", "role": "prefill", "log_path": str(log),
              "rpc_dir": str(rpc)}  # fmt: skip
    planted = {"id": "pd-1-aaaaaa", "spec_name": "pd", "created": 0, "fingerprint": {}, "servers": [server],
               "proxy": {**server, "name": "proxy", "role": "proxy"},
               "keeper": {"pid": 2**22 + 1, "starttime": 1, "socket": "nobody", "ttl": 9, "since": 0}}  # fmt: skip
    write_replace(reuse / "pd-1-aaaaaa.json", json.dumps(planted).encode())
    for args in (["ls"], ["stop", "--all"]):
        assert cli.main(["--dir", str(reuse), *args]) == 0
    assert states(reuse) == []
    assert (rpc / "socket-lookalike").read_text() == MINE
    assert log.read_text() == MINE


# -------------------------------------------------------------------------------- the lease directory


def test_a_lease_dir_holding_files_named_like_lock_files_loses_none(inner: Inner) -> None:
    """`--pd-lease-dir` at a directory where the user keeps files named `port-N.lock` / `port-N.json` for every
    port of the run's `--pd-port-range`: the run still leases (a file of ours can be flocked) and none of them is
    removed or truncated (pdserve removes a lock file only when empty, a holder file only when it holds a holder
    record)."""
    low, high = 20500, 20699
    inner.lease_dir.mkdir()
    files = {}
    for port in range(low, high + 1):
        for suffix in (".lock", ".json"):
            path = inner.lease_dir / f"port-{port}{suffix}"
            path.write_text(f"{port}{suffix}: {MINE}")
            path.chmod(0o666)
            files[path] = path.read_text()
    inner.pytester.makepyfile(PASSING)
    inner.run(f"--pd-port-range={low}-{high}").assert_outcomes(passed=1)
    lost = [str(p) for p, text in files.items() if not p.is_file() or p.read_text() != text]
    assert lost == []


# ---------------------------------------------------------------------------------------- the export file

#: A proxy command that is the user, saving their own file where the export file goes (after pdserve checked that
#: path, which it does before the cluster starts; before it writes it, once the cluster is ready), then the
#: built-in proxy.
SAVE_THEN_PROXY = """
import os, sys
from pathlib import Path

Path(os.environ["EXPORT_FILE"]).write_text("the user's own content\\n")
port, prefill, decode = sys.argv[1:4]
os.execv(sys.executable, [sys.executable, "-m", "pytest_pdserve.proxy", "--port", port,
         "--prefill", f"http://127.0.0.1:{prefill}", "--decode", f"http://127.0.0.1:{decode}"])
"""


def test_an_export_file_saved_while_the_cluster_starts_is_not_overwritten(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export file is checked before the session cluster starts (a file pdserve did not write is never
    overwritten) and written once it is ready: a file saved there in between is the user's too."""
    export = pytester.path / "exported.sh"
    monkeypatch.setenv("EXPORT_FILE", str(export))
    saver = pytester.path / "saver.py"
    saver.write_text(SAVE_THEN_PROXY)
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess(
        "--pd-engine=sim", f"--pd-lease-dir={pytester.path / 'leases'}", "-p", "no:cacheprovider",
        f"--pd-export-env-file={export}", f"--pd-proxy-command={{python}} {saver} {{port}} {{prefill_ports}} "
        "{decode_ports}", timeout=120,
    )  # fmt: skip
    assert export.read_text() == MINE
    assert result.ret == 1, result.stdout.str()[-2000:]
    result.stdout.fnmatch_lines([f"*export file {export}*exists and was not written by pdserve*"])


# ------------------------------------------------------------------------------------------ the model cache


def test_a_model_directory_pdserve_did_not_build_is_not_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a tiny model goes there is already a directory that is not a model pdserve built (no build marker):
    the build stops naming it instead of removing it (it used to `rmtree` it as "a stale, incomplete build")."""
    from pytest_pdserve.engines import tiny_model

    monkeypatch.setattr(tiny_model, "library_versions", lambda: {"torch": "0"})

    def fake_build(out: Path) -> int:  # what a build leaves: files, then the marker (build() writes it)
        (out / "config.json").write_text("{}")
        return 1

    monkeypatch.setitem(tiny_model._BUILDERS, "llama", fake_build)
    target = tiny_model.model_dir("llama", tmp_path)
    mine = target / "mine.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text(MINE)
    with pytest.raises(tiny_model.TinyModelError, match="exists and is not a model pdserve built"):
        tiny_model.build("llama", tmp_path)
    assert mine.read_text() == MINE
    assert [p.name for p in target.parent.iterdir() if p.name.startswith(".llama") and p.is_dir()] == []
    mine.unlink()  # an empty directory there: replaced by the build's rename
    assert (tiny_model.build("llama", tmp_path) / tiny_model.MARKER).is_file()


def test_a_link_to_a_users_place_is_that_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--pd-reuse-dir=~/pd` where `~/pd` is a link to `~` (or to the current directory): the place it leads to is
    judged, not the link's name."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    (tmp_path / "to-home").symlink_to(home)
    (tmp_path / "to-here").symlink_to(work)
    with pytest.raises(ReuseError, match="is your home directory"):
        dirs.ensure_reuse_dir(tmp_path / "to-home")
    with pytest.raises(ReuseError, match="is the current directory"):
        dirs.ensure_reuse_dir(tmp_path / "to-here")
    assert list(home.iterdir()) == list(work.iterdir()) == []


def test_a_read_only_reuse_dir_is_named_as_such_and_loses_nothing(tmp_path: Path) -> None:
    """The reuse dir on a file system remounted read-only: a run's check names the file system (not "not
    writable by uid 0"), and `pdserve ls` names a stale state it cannot remove as such (not "pdserve did not create
    it"); the user's file there is untouched."""
    with _tmpfs(tmp_path / "fs", "size=1M,mode=0700") as fs:
        reuse = dirs.ensure_reuse_dir(fs / "reuse")
        server = {"pid": 2**22 + 3, "pgid": 2**22 + 3, "starttime": 1, "token": f"none-{os.getpid()}",
                  "url": "http://127.0.0.1:9", "name": "prefill-0", "role": "prefill"}  # fmt: skip
        state = {"id": "pd-1-cccccc", "spec_name": "pd", "created": 0, "fingerprint": {}, "servers": [server],
                 "proxy": {**server, "name": "proxy", "role": "proxy"},
                 "keeper": {"pid": 2**22 + 3, "starttime": 1, "socket": "nobody", "ttl": 9, "since": 0}}  # fmt: skip
        write_replace(reuse / "pd-1-cccccc.json", json.dumps(state).encode())
        (reuse / "package.json").write_text(MINE)
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True, capture_output=True)
        with pytest.raises(ReuseError, match=r"Read-only file system \(EROFS: the file system is read-only\)"):
            dirs.ensure_reuse_dir(reuse)
        said: list[str] = []
        assert client.list_kept(reuse, report=said.append) == []
        assert any("pd-1-cccccc.json alone: its keeper is gone, but it cannot be removed: Read-only" in s for s in said)
        assert any("package.json alone" in s and "pdserve did not create it" in s for s in said), said
        assert (reuse / "package.json").read_text() == MINE
