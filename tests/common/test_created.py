"""Issue 43, class 1, the rule itself (``common/created.py``): pdserve removes only what it can prove it created.

Each case gives the rule's functions what a careless or hostile user leaves where pdserve removes things: their
own files in a directory pdserve owns, a copied marker, a file replaced under the same name, links planted to
their data, a directory swapped between the check and the removal, a read-only or a full file system. Whatever
pdserve cannot prove it created must be there afterwards, unchanged. The doors (settings, ``pdserve ls|stop``,
the keeper, pruning) are tests/common/test_data_loss.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from _mounts import tmpfs as _tmpfs

from pytest_pdserve.common import created
from pytest_pdserve.common.logfile import open_append, write_replace
from pytest_pdserve.machine import lockfiles
from pytest_pdserve.reuse import dirs
from pytest_pdserve.running.rpc_dirs import make_rpc_dir, remove_rpc_dir

MINE = "the user's own content\n"


def _mine(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(MINE)
    return path


def _log(path: Path) -> Path:
    """A log as pdserve writes one (``open_append``: recorded in its directory's manifest when it creates it)."""
    fd = open_append(path)
    os.write(fd, b"pdserve: starting prefill-0\n")
    os.close(fd)
    return path


def _untouched(*paths: Path) -> None:
    for path in paths:
        assert path.read_text() == MINE, path


def test_only_what_pdserve_created_in_its_directory_goes(tmp_path: Path) -> None:
    victim_dir = tmp_path / "home-project"
    victim = _mine(victim_dir / "package.json")
    run = created.make_dir(tmp_path / "run", 0o700, created.RUN_LOGS)
    ours = [_log(run / "pd-1-prefill-0.log"), _log(run / "pdserve.log")]
    worker = created.make_dir(run / "gw0", 0o700, created.RUN_LOGS)
    ours.append(_log(worker / "pd-1-decode-0.log"))
    theirs = [_mine(run / "notes.txt"), _mine(run / "logs" / "2024-01-01" / "build.log"), _mine(worker / "x.log")]
    (run / "to-home").symlink_to(victim_dir)  # planted links: never followed, never removed
    (run / "to-file.log").symlink_to(victim)
    os.mkfifo(run / "fifo.log")
    left = created.remove_tree(run, created.RUN_LOGS)
    assert not any(p.exists() for p in ours)
    _untouched(victim, *theirs)
    assert (run / "to-home").is_symlink()
    assert (run / "to-file.log").is_symlink()
    assert (run / "fifo.log").exists()
    assert sorted(left) == sorted(
        f"{p} (pdserve did not create it)"
        for p in (run / "notes.txt", run / "logs", worker / "x.log", run / "to-home", run / "to-file.log",
                  run / "fifo.log")
    )  # fmt: skip
    for path in (*theirs, run / "to-home", run / "to-file.log", run / "fifo.log"):
        path.unlink()
    shutil.rmtree(run / "logs")
    assert created.remove_tree(run, created.RUN_LOGS) == []  # now only pdserve's: all of it goes
    assert not run.exists()


def test_a_marker_proves_only_the_directory_it_was_written_for(tmp_path: Path) -> None:
    """`cp -r` (or a restore) of a run directory copies the marker and the names: they prove nothing there."""
    run = created.make_dir(tmp_path / "run", 0o700, created.RUN_LOGS)
    _log(run / "a.log")
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    assert created.manifest(copy) is None
    assert created.marker_problem(copy, created.RUN_LOGS) == (
        f"{copy / created.MARKER} was written for another directory (copied or restored from elsewhere?)"
    )
    assert created.remove_tree(copy, created.RUN_LOGS) == [f"{copy} (pdserve did not create it)"]
    assert created.remove_file(copy / "a.log") is False
    assert (copy / "a.log").exists()
    # A marker moved in by hand, or of another kind, proves nothing either.
    other = tmp_path / "other"
    other.mkdir()
    os.rename(copy / created.MARKER, other / created.MARKER)
    assert created.manifest(other) is None
    assert created.remove_tree(run, created.RPC) == [f"{run} (pdserve did not create it)"]
    assert (run / "a.log").exists()


def test_a_file_replaced_under_its_name_is_the_users(tmp_path: Path) -> None:
    """pdserve created ``state.json``; the user then saved their own file under that name (an editor writes a new
    file and renames it over): its inode is not the one recorded, so it stays."""
    reuse = created.make_dir(tmp_path / "reuse", 0o700, created.REUSE)
    ino = write_replace(reuse / "pd-1-abcdef.json", b"{}")
    replacement = _mine(reuse / ".tmp-editor")
    os.replace(replacement, reuse / "pd-1-abcdef.json")
    assert created.remove_file(reuse / "pd-1-abcdef.json") is False
    assert created.remove_file(reuse / "pd-1-abcdef.json", expect_ino=ino) is False
    _untouched(reuse / "pd-1-abcdef.json")
    _mine(reuse / "package.json")
    assert created.remove_file(reuse / "package.json") is False  # never recorded: a name is no proof
    _untouched(reuse / "package.json")
    ours = write_replace(reuse / "pd-2-abcdef.json", b"{}")
    assert created.remove_file(reuse / "pd-2-abcdef.json", expect_ino=ours) is True


def test_a_rotation_never_renames_over_a_users_file(tmp_path: Path) -> None:
    reuse = created.make_dir(tmp_path / "reuse", 0o700, created.REUSE)
    _log(reuse / "keeper.log")
    _mine(reuse / "keeper.log.1")
    assert created.replace_file(reuse / "keeper.log", reuse / "keeper.log.1") is False
    _untouched(reuse / "keeper.log.1")
    (reuse / "keeper.log.1").unlink()
    assert created.replace_file(reuse / "keeper.log", reuse / "keeper.log.1") is True
    _log(reuse / "keeper.log")
    assert created.replace_file(reuse / "keeper.log", reuse / "keeper.log.1") is True  # over its own earlier copy
    assert created.remove_file(reuse / "keeper.log.1") is True


def test_a_directory_swapped_between_the_check_and_the_removal_is_left_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pruning finds an old run directory of pdserve's; before it removes it, the name is made to point at the
    user's data (a directory moved in, then a link): the removal re-proves what it opened, so it stays whole."""
    reuse = dirs.ensure_reuse_dir(tmp_path / "reuse")
    logs = reuse / "logs"
    logs.mkdir()
    run = created.make_dir(logs / "20240101-000000-1-00000000", 0o700, created.RUN_LOGS)
    _log(run / "pdserve.log")
    os.utime(run, (0, 0))
    project = _mine(tmp_path / "project" / "package.json").parent
    real_remove = created.remove_tree
    swaps = iter(["dir", "link"])

    def swapped(path: Path, kind: str, *, sockets: bool = False) -> list[str]:
        kind_of_swap = next(swaps)
        os.rename(path, tmp_path / f"moved-{kind_of_swap}")
        if kind_of_swap == "dir":
            shutil.copytree(project, path)  # the user's files, marker-less, under pdserve's name
        else:
            path.symlink_to(project)
        return real_remove(path, kind, sockets=sockets)

    monkeypatch.setattr(created, "remove_tree", swapped)
    for swap in ("dir", "link"):
        removed, left = dirs.prune_run_logs(reuse, keep=0, min_age=0)
        assert removed == [], (swap, left)
        assert left, swap
        assert (run / "package.json").read_text() == MINE
        _untouched(project / "package.json")
        if swap == "dir":
            shutil.rmtree(run)
            os.rename(tmp_path / "moved-dir", run)


def test_rpc_dirs_lose_only_their_sockets(tmp_path: Path) -> None:
    rpc = make_rpc_dir()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(rpc / "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"))
    _mine(rpc / "notes.txt")
    remove_rpc_dir(rpc)
    assert sorted(p.name for p in rpc.iterdir()) == [created.MARKER, "notes.txt"]
    (rpc / "notes.txt").unlink()
    remove_rpc_dir(rpc)
    assert not rpc.exists()
    # A path a state file names, to the user's directory named like one: no marker, nothing goes.
    lookalike = _mine(tmp_path / "pdserve-rpc-abcdefgh" / "data.txt")
    remove_rpc_dir(lookalike.parent)
    _untouched(lookalike)


def test_lock_files_go_only_when_empty_and_held_and_holder_files_only_with_a_holder_record(tmp_path: Path) -> None:
    """``--pd-lease-dir`` pointed at a directory holding files named like pdserve's lock and holder files: the
    user's are neither removed nor truncated; an empty lock file and pdserve's own holder record go."""
    lease = tmp_path / "leases"
    lease.mkdir()
    their_lock, their_holder = _mine(lease / "port-20001.lock"), _mine(lease / "port-20001.json")
    fd = lockfiles.try_lock(their_lock)  # a regular file of ours with one link: lockable
    assert fd is not None
    lockfiles.write_holder(their_lock, "test")  # never truncates what is no holder record
    lockfiles.unlock(fd, their_lock)
    _untouched(their_lock, their_holder)
    ours = lease / "port-20002.lock"
    fd = lockfiles.try_lock(ours)
    assert fd is not None
    lockfiles.write_holder(ours, "test")
    assert json.loads(ours.with_suffix(".json").read_text())["purpose"] == "test"
    lockfiles.unlock(fd, ours)
    assert not ours.exists()
    assert not ours.with_suffix(".json").exists()


def test_a_reuse_dir_with_a_marker_from_before_the_rule_keeps_every_file_not_recorded(tmp_path: Path) -> None:
    """A reuse directory marked by an older pdserve (``.pytest-pdserve-reuse``), into which the user then saved
    files: it is taken over as it is, and nothing in it that this pdserve did not record creating is removed."""
    reuse = tmp_path / "reuse"
    reuse.mkdir(mode=0o700)
    (reuse / dirs.REUSE_DIR_MARKER).write_bytes(dirs._LEGACY_MARKER_TEXT)
    theirs = [_mine(reuse / "package.json"), _mine(reuse / "logs" / "2024-01-01" / "run.log")]
    os.utime(reuse / "logs" / "2024-01-01", (0, 0))
    dirs.ensure_reuse_dir(reuse)
    assert created.manifest(reuse, created.REUSE) is not None
    removed, left = dirs.prune_run_logs(reuse, keep=0, min_age=0)
    assert removed == []
    assert left == [f"{reuse / 'logs' / '2024-01-01'} (pdserve did not create it)"]
    from pytest_pdserve.reuse import client

    said: list[str] = []
    assert client.list_kept(reuse, report=said.append) == []
    _untouched(*theirs)


# ------------------------------------------------------------------------------ read-only and full file systems


def test_a_read_only_file_system_removes_nothing_and_says_so(tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "fs", "size=1M,mode=0700") as fs:
        run = created.make_dir(fs / "run", 0o700, created.RUN_LOGS)
        _log(run / "a.log")
        _mine(run / "notes.txt")
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True, capture_output=True)
        left = created.remove_tree(run, created.RUN_LOGS)
        assert f"{run / 'a.log'} (Read-only file system)" in left, left
        assert f"{run / 'notes.txt'} (pdserve did not create it)" in left, left
        assert (run / "a.log").exists()
        assert (run / "notes.txt").read_text() == MINE
        with pytest.raises(OSError, match="Read-only file system"):
            created.make_dir(fs / "new", 0o700, created.RUN_LOGS)
        assert not (fs / "new").exists()


def test_a_full_file_system_never_costs_a_file(tmp_path: Path) -> None:
    """Out of inodes: a directory whose marker cannot be written is not left behind (one inode left: the ``mkdir``
    takes it, the marker finds none), and removing pdserve's own files still works and touches nothing else."""
    with _tmpfs(tmp_path / "fs", "size=1M,nr_inodes=16,mode=0700") as fs:
        run = created.make_dir(fs / "run", 0o700, created.RUN_LOGS)
        _log(run / "a.log")
        fillers = []
        with contextlib.suppress(OSError):
            for i in range(64):
                fillers.append(_mine(fs / f"filler-{i}"))
        fillers.pop().unlink()  # one inode free
        with pytest.raises(OSError, match="No space left on device"):
            created.make_dir(fs / "new", 0o700, created.RUN_LOGS)
        assert not (fs / "new").exists()
        assert created.remove_tree(run, created.RUN_LOGS) == []
        _untouched(*fillers)


def test_a_keeper_writes_only_a_new_state_file(tmp_path: Path) -> None:
    """A kept cluster's id is new, so its state file is too: a file already at that name (the user's, another
    container's kept cluster of the same id) is not replaced, and the keeper stops instead of keeping."""
    from pytest_pdserve.reuse import keeper

    theirs = _mine(tmp_path / "pd-1-abcdef.json")
    with pytest.raises(OSError, match="a file is there already, which pdserve did not write"):
        keeper._write_state(theirs, {"id": "pd-1-abcdef"})
    _untouched(theirs)
