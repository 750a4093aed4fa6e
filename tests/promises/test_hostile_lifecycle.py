"""Hostile and careless input against paths, leases and supervision (issue 13), on real pytest sessions.

Every case runs a real inner pytest (``pytester``, in a subprocess) against real simulator processes. The
kill cases SIGKILL pytest, the watchdog, the proxy (and combinations) and then check, within a bounded wait,
that no process the inner session started is alive and that every lease can be taken again.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import stat
import time
from pathlib import Path

import pytest
from _pdsession import GONE_WITHIN_S, Inner, live_procs, unheld_locks, wait_for

from pytest_pdserve.config.commands import VLLM_PORT_WINDOW
from pytest_pdserve.machine.leases import acquire_ports, try_acquire_gpus

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

SIM_GPU = "GPU-sim-0000-0000-0000-{:012d}"

UP = """
def test_up(pd_cluster, pdinfo):
    pdinfo(pd_cluster)
    pd_cluster.complete("hello " * 10, max_tokens=2)
"""


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Inner:
    return Inner(pytester, monkeypatch)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _run(inner: Inner, *args: str, timeout: float = 120) -> pytest.RunResult:
    """An inner session with only ``args`` (no lease/log dir of the Inner helper: the case gives its own)."""
    return inner.pytester.runpytest_subprocess("--pd-engine=sim", "-p", "no:cacheprovider", *args, timeout=timeout)


# ------------------------------------------------------------------------------------------------ paths


def test_ini_lease_dir_in_the_project_keeps_the_project_root_mode(inner: Inner) -> None:
    root = inner.pytester.path
    root.chmod(0o755)
    inner.pytester.makeini("[pytest]\npdserve_lease_dir = .leases\n")
    inner.pytester.makepyfile(UP)
    result = _run(inner, f"--pd-log-dir={inner.log_dir}")
    result.assert_outcomes(passed=1)
    assert _mode(root) == 0o755, oct(_mode(root))  # was 1777: anyone could drop a conftest.py here
    assert _mode(root / ".leases") == 0o1777  # created by the plugin: shared
    unheld_locks(root / ".leases")


@pytest.mark.parametrize("lease_dir", ["~/leases", "~/x/leases"])
def test_lease_dir_under_home_keeps_home_mode(inner: Inner, monkeypatch: pytest.MonkeyPatch, lease_dir: str) -> None:
    home = inner.pytester.path / "home"
    home.mkdir(mode=0o750)
    home.chmod(0o750)
    monkeypatch.setenv("HOME", str(home))
    inner.pytester.makepyfile(UP)
    result = _run(inner, f"--pd-lease-dir={lease_dir}", f"--pd-log-dir={inner.log_dir}")
    result.assert_outcomes(passed=1)
    assert _mode(home) == 0o750, oct(_mode(home))  # was 1777 for ~/leases: the lease code chmodded the parent
    created = Path(lease_dir.replace("~", str(home)))
    while created != home:  # every directory the plugin created, and only those, is shared
        assert _mode(created) == 0o1777, created
        created = created.parent


@pytest.mark.parametrize("setting", ["lease", "log"])
def test_a_regular_file_as_directory_is_a_usage_error(inner: Inner, setting: str) -> None:
    target = inner.pytester.path / "afile"
    target.write_text("data")
    target.chmod(0o640)
    inner.pytester.makepyfile(UP)
    result = _run(inner, f"--pd-{setting}-dir={target}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    out = result.stderr.str()
    assert f"--pd-{setting}-dir" in out, out
    assert f"{target} is a regular file, not a directory" in out, out
    assert "Traceback" not in out
    assert _mode(target) == 0o640
    assert target.read_text() == "data"


def test_a_file_as_a_parent_is_a_usage_error(inner: Inner) -> None:
    (inner.pytester.path / "afile").write_text("")
    result = _run(inner, f"--pd-log-dir={inner.pytester.path / 'afile' / 'logs'}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "afile is a regular file, not a directory" in result.stderr.str()


def test_existing_log_dir_keeps_its_mode(inner: Inner) -> None:
    logs = inner.pytester.path / "ci-logs"
    logs.mkdir()
    logs.chmod(0o755)
    inner.pytester.makepyfile(UP)
    result = _run(inner, f"--pd-log-dir={logs}", f"--pd-lease-dir={inner.lease_dir}")
    result.assert_outcomes(passed=1)
    assert _mode(logs) == 0o755, oct(_mode(logs))  # was 0700
    assert list(logs.glob("*/*-prefill-0.log"))  # in the run's own directory


def test_missing_log_dir_parents_are_created_private(inner: Inner) -> None:
    logs = inner.pytester.path / "a" / "b" / "logs"
    root_mode = _mode(inner.pytester.path)
    inner.pytester.makepyfile(UP)
    result = _run(inner, f"--pd-log-dir={logs}", f"--pd-lease-dir={inner.lease_dir}")
    result.assert_outcomes(passed=1)
    assert [_mode(p) for p in (logs.parent.parent, logs.parent, logs)] == [0o700] * 3
    assert _mode(inner.pytester.path) == root_mode  # the existing ancestor is not touched


@pytest.mark.parametrize("path", ["/proc/1", "/proc/1/pdserve-logs"], ids=["existing", "missing"])
def test_unwritable_log_dir_is_a_usage_error(inner: Inner, path: str) -> None:
    # /proc/1 is a directory nobody, root included, can create files in: a real unwritable directory.
    inner.pytester.makepyfile(UP)
    result = _run(inner, f"--pd-log-dir={path}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    out = result.stderr.str()
    assert "--pd-log-dir" in out, out
    assert "not writable by uid" in out, out
    assert "PermissionError" not in out
    assert "Traceback" not in out


def test_lease_dir_through_a_symlink_owned_by_someone_else(inner: Inner) -> None:
    """A symlinked component (another user's) is followed, and neither the link's target nor its parent changes."""
    target = inner.pytester.path / "shared"
    target.mkdir()
    target.chmod(0o755)
    link = inner.pytester.path / "link"
    link.symlink_to(target)
    os.lchown(link, 65534, 65534)
    inner.pytester.makepyfile(UP)
    result = _run(inner, f"--pd-lease-dir={link / 'leases'}", f"--pd-log-dir={inner.log_dir}")
    result.assert_outcomes(passed=1)
    assert _mode(target) == 0o755
    assert _mode(target / "leases") == 0o1777
    assert link.is_symlink()


def test_dangling_symlink_as_lease_dir_is_a_usage_error(inner: Inner) -> None:
    link = inner.pytester.path / "gone"
    link.symlink_to(inner.pytester.path / "nowhere")
    result = _run(inner, f"--pd-lease-dir={link}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"{link} is a dangling symbolic link" in result.stderr.str()


# ------------------------------------------------------------------------------- planted lease entries


def _plant(lease_dir: Path, name: str, kind: str) -> Path:
    path = lease_dir / name
    if kind == "dir":
        path.mkdir()
    elif kind == "symlink":
        path.symlink_to("/etc/passwd")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "foreign-0644":  # another user's file we may not write
        path.write_text("")
        path.chmod(0o644)
        os.chown(path, 65534, 65534)
    elif kind == "foreign-0666":  # another user's file anyone may lock: a lock file like ours
        path.write_text("")
        path.chmod(0o666)
        os.chown(path, 65534, 65534)
    return path


def test_planted_entries_named_like_gpu_locks_are_skipped(inner: Inner) -> None:
    inner.lease_dir.mkdir()
    inner.lease_dir.chmod(0o1777)
    kinds = ["dir", "symlink", "fifo", "foreign-0644"]
    for i, kind in enumerate(kinds):
        _plant(inner.lease_dir, f"gpu-{SIM_GPU.format(i)}.lock", kind)
    inner.pytester.makepyfile(UP)
    result = inner.run("--pd-simulate-gpus=6")
    result.assert_outcomes(passed=1)
    [info] = inner.infos()
    used = {s["cvd"] for s in info["servers"] if s["name"] != "proxy"}
    assert used == {"4", "5"}, used  # the GPUs behind the planted entries were treated as busy
    for i, kind in enumerate(kinds):  # nothing planted was changed or removed
        path = inner.lease_dir / f"gpu-{SIM_GPU.format(i)}.lock"
        assert os.path.lexists(path), kind
    assert Path("/etc/passwd").stat().st_size > 0


def test_planted_entries_on_every_gpu_are_named_in_the_timeout(inner: Inner) -> None:
    inner.lease_dir.mkdir()
    _plant(inner.lease_dir, f"gpu-{SIM_GPU.format(0)}.lock", "dir")
    _plant(inner.lease_dir, f"gpu-{SIM_GPU.format(1)}.lock", "symlink")
    inner.pytester.makepyfile(UP)
    result = inner.run("--pd-simulate-gpus=2", "--pd-gpu-wait-timeout=1")
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    assert "IsADirectoryError" not in out
    assert "OSError" not in out
    assert f"gpu-{SIM_GPU.format(0)}.lock is a directory" in out, out[-3000:]
    assert f"gpu-{SIM_GPU.format(1)}.lock is a symbolic link" in out
    assert "gave up waiting for" in out


def test_planted_port_entries_are_skipped(inner: Inner, monkeypatch: pytest.MonkeyPatch) -> None:
    low = 21000 + (os.getpid() % 500) * 8
    inner.lease_dir.mkdir()
    kinds = ["dir", "symlink", "fifo", "foreign-0644"]
    planted = {low + i: _plant(inner.lease_dir, f"port-{low + i}.lock", kinds[i % 4]) for i in range(40)}
    # A holder-info file pointing at an endless device must not be read to its end.
    (inner.lease_dir / f"port-{low + 40}.json").symlink_to("/dev/zero")
    monkeypatch.setenv("PDSERVE_PORT_RANGE", f"{low}-{low + 119}")
    inner.pytester.makepyfile(UP)
    result = inner.run()
    result.assert_outcomes(passed=1)
    [info] = inner.infos()
    from _pdsession import cluster_resources

    _, used = cluster_resources(info)
    assert not used & set(planted), sorted(used & set(planted))
    assert all(os.path.lexists(p) for p in planted.values())


def test_foreign_0666_lock_file_is_an_ordinary_lock(tmp_path: Path) -> None:
    """Another user's 0666 lock file in the shared dir is what sharing looks like: it is locked, not refused."""
    tmp_path.chmod(0o1777)
    _plant(tmp_path, f"gpu-{SIM_GPU.format(0)}.lock", "foreign-0666")
    lease = try_acquire_gpus(tmp_path, [SIM_GPU.format(0)], 1)
    assert lease is not None
    lease.release()


def test_every_port_planted_gives_a_lease_timeout_not_an_oserror(tmp_path: Path) -> None:
    for port in range(22000, 22004):
        _plant(tmp_path, f"port-{port}.lock", "dir")
    with pytest.raises(Exception, match="only 0 of 1 ports free") as exc:
        acquire_ports(tmp_path, 1, low=22000, high=22003)
    assert not isinstance(exc.value, OSError)


def test_hard_linked_holder_file_is_never_written(tmp_path: Path) -> None:
    """A ``.json`` holder file hard-linked to a victim file must not be truncated (we may run as root)."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    lease_dir = tmp_path / "leases"
    lease_dir.mkdir()
    os.link(victim, lease_dir / f"gpu-{SIM_GPU.format(0)}.json")
    lease = try_acquire_gpus(lease_dir, [SIM_GPU.format(0)], 1)
    assert lease is not None
    lease.release()
    assert victim.read_text() == "precious"


# ------------------------------------------------------------------------------ kills, in every order

#: Servers ignore SIGTERM and leave setsid "EngineCore"/"Worker" sleepers behind: only SIGKILL ends them, and
#: only a sweep by env token finds the sleepers. The test waits until $GO_FILE exists (the outer test's cue to
#: end the session normally), bounded.
HOLD = """
import os, time
from pathlib import Path
from pytest_pdserve.spec import ClusterSpec

def test_up(pd_cluster_factory, pdinfo):
    env = {"PDSERVE_SIM_SPAWN_WORKERS": "2", "PDSERVE_SIM_IGNORE_SIGTERM": "1"}
    cluster = pd_cluster_factory(ClusterSpec(env=env))
    pdinfo(cluster)
    go = Path(os.environ["GO_FILE"])
    for _ in range(12000):  # 240 s: longer than the outer test's kills and waits take on a loaded machine
        if go.exists():
            break
        time.sleep(0.02)
"""


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _helpers(inner: Inner, module: str) -> list[int]:
    """Live marked processes running ``pytest_pdserve.<module>`` (the watchdog, the guards)."""
    needle = f"from pytest_pdserve.{module} import main".encode()
    return [pid for pid in live_procs(inner.mark) if needle in _cmdline(pid)]


def _servers(inner: Inner) -> list[int]:
    """Live marked simulator and proxy processes."""
    return [p for p in live_procs(inner.mark) if re.search(rb"-m\0pytest_pdserve\.(sim|proxy)\0", _cmdline(p))]


def _alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X")


def _has_files(pid: int) -> bool:
    """Whether ``pid`` still has its fd table: a live process that is not yet past the kernel's ``exit_files``.

    An exiting process drops its fds (and so its flocks) a moment before it turns zombie; a lease found free in
    that moment was not handed out under a running server, and must not fail the test (it did once in CI).
    """
    try:
        return bool(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not _alive(pid), GONE_WITHIN_S, f"pid {pid} gone after SIGKILL")


def _held_while_alive(inner: Inner, locks: list[Path], server_pids: list[int], timeout: float) -> float:
    """Wait until every marked process is gone; meanwhile, no lease may be free while a server lives.

    Returns the seconds it took. Each round tries every lock file non-blockingly: one that can be taken while a
    server is alive is a lease handed out under a running server.
    """
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not live_procs(inner.mark):
            return time.monotonic() - t0
        if any(_alive(p) for p in server_pids):
            for path in locks:
                try:
                    fd = os.open(path, os.O_RDWR)
                except FileNotFoundError:
                    continue  # released and removed by its holder: only after its servers stopped (see below)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                finally:
                    os.close(fd)  # closing drops a lock we got
                # Checked after the lock: a server that still has its fds now had them when the lock was free.
                running = [p for p in server_pids if _alive(p) and _has_files(p)]
                if running:
                    raise AssertionError(f"lease {path.name} was free while servers {running} were running")
        time.sleep(0.02)
    raise AssertionError(f"still alive after {timeout}s: {live_procs(inner.mark)}")


KILL_ORDERS = [
    ("pytest",),
    ("watchdog",),
    ("watchdog", "pytest"),
    ("pytest", "watchdog"),
    ("proxy",),
    ("proxy", "pytest"),
    ("watchdog", "proxy", "pytest"),
    ("guard", "pytest"),
    ("guard",),
]


@pytest.mark.parametrize("order", KILL_ORDERS, ids=["-then-".join(o) for o in KILL_ORDERS])
def test_sigkill_in_any_order_leaves_no_server_and_no_lease_held_early(
    inner: Inner, monkeypatch: pytest.MonkeyPatch, order: tuple[str, ...]
) -> None:
    go = inner.pytester.path / "go"
    monkeypatch.setenv("GO_FILE", str(go))
    inner.pytester.makepyfile(HOLD)
    with inner.popen("--pd-shutdown-timeout=1", "--pd-simulate-gpus=2") as proc:
        info = inner.wait_info()
        servers = {s["name"]: s["pid"] for s in info["servers"]}
        [watchdog] = _helpers(inner, "running.watchdog")
        [guard] = _helpers(inner, "running.supervise")  # one per pytest process
        locks = sorted(inner.lease_dir.glob("*.lock"))
        assert len(locks) == 2 + 2 * (1 + 1 + VLLM_PORT_WINDOW) + 1, locks  # GPUs, HTTP, NIXL, VLLM_PORT, proxy
        victims = {"pytest": proc.pid, "watchdog": watchdog, "guard": guard, "proxy": servers["proxy"]}
        for name in order:
            _kill(victims[name])
        if "pytest" not in order:
            go.touch()  # the session ends normally, with its own teardown
            proc.wait(60)
        seconds = _held_while_alive(inner, locks, [p for n, p in servers.items() if n != "proxy"], GONE_WITHIN_S)
    print(f"SIGKILL {' then '.join(order)} -> everything gone in {seconds:.2f}s")
    inner.assert_clean([info])
    for key in ("0", "1"):  # every GPU can be leased again
        lease = try_acquire_gpus(inner.lease_dir, [SIM_GPU.format(int(key))], 1)
        assert lease is not None, key
        lease.release()


def test_pytest_killed_during_cluster_start(inner: Inner) -> None:
    inner.pytester.makepyfile(
        """
        from pytest_pdserve.spec import ClusterSpec

        def test_up(pd_cluster_factory):
            pd_cluster_factory(ClusterSpec(env={"PDSERVE_SIM_STARTUP_DELAY": "30", "PDSERVE_SIM_IGNORE_SIGTERM": "1"}))
        """
    )
    with inner.popen("--pd-shutdown-timeout=1", "--pd-simulate-gpus=2") as proc:
        wait_for(lambda: len(_servers(inner)) == 3 and _helpers(inner, "running.supervise"), 60, "servers spawned")
        [watchdog] = _helpers(inner, "running.watchdog")
        _kill(watchdog)  # and the watchdog first: only the guards are left to stop the starting servers
        _kill(proc.pid)
        seconds = inner.gone_within()
    print(f"SIGKILL watchdog then pytest during start-up -> everything gone in {seconds:.2f}s")
    unheld_locks(inner.lease_dir)


#: What the simulator logs when it ignores a SIGTERM (PDSERVE_SIM_IGNORE_SIGTERM=1).
SIGTERM_IGNORED = "Received SIGTERM; ignoring it"


def test_pytest_killed_during_teardown(inner: Inner) -> None:
    inner.pytester.makepyfile(
        """
        from pytest_pdserve.spec import ClusterSpec

        def test_up(pd_cluster_factory, pdinfo):
            pdinfo(pd_cluster_factory(ClusterSpec(env={"PDSERVE_SIM_IGNORE_SIGTERM": "1"})))
        """
    )
    # A shutdown timeout no test waits out: teardown sits in the SIGTERM grace until pytest is killed there (with
    # 3 s, a loaded machine could let the grace end between the log line and the kill). After pytest's death the
    # guards and the watchdog use their own grace of at most 3 s.
    with inner.popen("--pd-shutdown-timeout=600", "--pd-simulate-gpus=2") as proc:
        info = inner.wait_info()
        # The test has returned and teardown is in the grace of servers that ignore SIGTERM: awaited in their logs.
        logs = [Path(s["log"]) for s in info["servers"] if s["name"] != "proxy"]
        wait_for(lambda: any(SIGTERM_IGNORED in p.read_text(errors="replace") for p in logs), 60, "SIGTERM sent")
        assert proc.poll() is None
        [watchdog] = _helpers(inner, "running.watchdog")
        _kill(proc.pid)
        _kill(watchdog)
        seconds = inner.gone_within()
    print(f"SIGKILL pytest then watchdog during teardown -> everything gone in {seconds:.2f}s")
    inner.assert_clean([info])


def test_forked_child_of_pytest_does_not_keep_servers_alive(inner: Inner, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that forks a long-lived helper: the fork inherits pytest's fds, but not the lifeline."""
    go = inner.pytester.path / "go"
    monkeypatch.setenv("GO_FILE", str(go))
    inner.pytester.makepyfile(
        HOLD.replace(
            "    pdinfo(cluster)\n",
            "    child = os.fork()\n    if child == 0:\n        time.sleep(30)\n        os._exit(0)\n"
            "    pdinfo(cluster, child=child)\n",
        )
    )
    with inner.popen("--pd-shutdown-timeout=1") as proc:
        info = inner.wait_info()
        child = int(info["child"])
        [watchdog] = _helpers(inner, "running.watchdog")
        try:
            _kill(watchdog)
            _kill(proc.pid)
            servers = [s["pid"] for s in info["servers"]]
            wait_for(lambda: not any(_alive(p) for p in servers), GONE_WITHIN_S, "servers gone while the fork lives")
            assert _alive(child)
        finally:
            os.kill(child, signal.SIGKILL)
        inner.gone_within()


# ------------------------------------------------------------------------------------ stopped clusters


def test_pd_cluster_after_factory_stop_is_a_fresh_cluster(inner: Inner) -> None:
    inner.pytester.makepyfile(
        """
        from pytest_pdserve.spec import ClusterSpec

        def test_a(pd_cluster, pdinfo):
            pdinfo(pd_cluster, step="a")
            pd_cluster.complete("hello " * 10, max_tokens=2)

        def test_b(pd_cluster_factory):
            pd_cluster_factory.stop(ClusterSpec())

        def test_c(pd_cluster, pdinfo):
            pdinfo(pd_cluster, step="c")
            assert pd_cluster.proxy.process.alive
            pd_cluster.complete("hello " * 10, max_tokens=2)  # was: httpx.ConnectError on the stopped proxy

        def test_d(pd_cluster, pdinfo):
            pdinfo(pd_cluster, step="d")  # shared again until the next stop
        """
    )
    result = inner.run("-p", "no:randomly")
    result.assert_outcomes(passed=4)
    by_step = {i["step"]: i for i in inner.infos()}
    pids = {step: {s["pid"] for s in i["servers"]} for step, i in by_step.items()}
    assert not pids["a"] & pids["c"], "test_c got the stopped cluster"
    assert pids["c"] == pids["d"]
    inner.assert_clean(list(by_step.values()))


def test_pd_cluster_after_its_gpus_went_to_another_spec_is_a_fresh_cluster(
    inner: Inner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The H200 run's failure (examples on one GPU): the mamba example's cluster made room by stopping `pd`, and
    the next `pd_cluster` test got pytest's cached, stopped cluster ("prefill-0 exited with exit code 0", with
    an out-of-memory hint). The manager's making room and an explicit stop are one rule: pytest forgets it."""
    monkeypatch.setenv("PDSERVE_SIMULATE_GPUS", "1")
    inner.pytester.makepyfile(
        """
        import pytest
        from pytest_pdserve.errors import ClusterStopped
        from pytest_pdserve.spec import ClusterSpec

        HELD = []

        def test_a(pd_cluster, pdinfo):
            pdinfo(pd_cluster, step="a")
            HELD.append(pd_cluster)
            pd_cluster.complete("hello " * 10, max_tokens=2)

        def test_b(pd_cluster_factory, pdinfo):
            other = pd_cluster_factory(ClusterSpec(name="other", max_model_len=1024))  # needs the one GPU
            pdinfo(other, step="b")
            with pytest.raises(ClusterStopped, match="its GPUs were needed for another spec"):
                HELD[0].complete("hello " * 10, max_tokens=2)

        def test_c(pd_cluster, pdinfo):
            pdinfo(pd_cluster, step="c")
            pd_cluster.complete("hello " * 10, max_tokens=2)  # was: ServerDied, exit code 0, an OOM hint
        """
    )
    result = inner.run("-p", "no:randomly", "--pd-share-gpus")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*stopping cluster pd to free its GPUs for another spec*"])
    by_step = {i["step"]: i for i in inner.infos()}
    pids = {step: {s["pid"] for s in i["servers"]} for step, i in by_step.items()}
    assert not pids["a"] & pids["c"], "test_c got the stopped cluster"
    inner.assert_clean(list(by_step.values()))


def test_factory_after_stop_starts_a_fresh_cluster_too(inner: Inner) -> None:
    inner.pytester.makepyfile(
        """
        from pytest_pdserve.spec import ClusterSpec

        def test_a(pd_cluster_factory):
            spec = ClusterSpec(num_decode=2)
            first = pd_cluster_factory(spec)
            pd_cluster_factory.stop(spec)
            again = pd_cluster_factory(spec)
            assert again is not first
            again.complete("hello " * 10, max_tokens=2)
        """
    )
    inner.run().assert_outcomes(passed=1)


def test_a_dead_watchdog_is_started_again(inner: Inner, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GO_FILE", str(inner.pytester.path / "go"))
    inner.pytester.makepyfile(
        """
        import os, time
        from pathlib import Path

        def _wait(name):
            for _ in range(12000):  # 240 s
                if Path(os.environ["GO_FILE"] + name).exists():
                    return
                time.sleep(0.02)

        def test_a(pd_cluster, pdinfo):
            pdinfo(pd_cluster, step="a")
            _wait("a")

        def test_b(pd_cluster, pdinfo):
            pdinfo(pd_cluster, step="b")
            _wait("b")
        """
    )
    with inner.popen("--pd-shutdown-timeout=1") as proc:
        inner.wait_info()
        [first] = _helpers(inner, "running.watchdog")
        _kill(first)
        (inner.pytester.path / "goa").touch()
        wait_for(lambda: len(inner.infos()) == 2, 60, "test_b got the cluster")
        [second] = _helpers(inner, "running.watchdog")
        assert second != first
        _kill(proc.pid)
        inner.gone_within()
    wd_log = (inner.run_logs() / "watchdog.log").read_text()
    assert f"pdserve-watchdog[{second}]" in wd_log, wd_log  # the new one swept the servers (by run token)
    assert "cleaning up" in wd_log
