"""``--pd-reuse`` (issue 19) as users meet it: consecutive real pytest sessions against real simulator processes.

Each case runs inner pytest sessions (``pytester``, in subprocesses) with a private reuse dir and lease dir, and
then checks what is left with the same helpers as the lifecycle tests: marked processes (every process an
inner session starts, the keeper included, carries ``PDSERVE_TEST_MARK``), held leases, state files. The
attacks: a keeper or a server killed while kept, a planted or garbage state file, a reuse dir others can write,
a second run wanting the kept cluster's GPUs, a concurrent claim, CI.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _pdsession import Inner, live_procs, unheld_locks

from pytest_pdserve import cli, reuse
from pytest_pdserve.proctree import read_stat

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

UP = """
def test_up(pd_cluster, pdinfo):
    pdinfo(pd_cluster, reused=pd_cluster.reused.kept_id if pd_cluster.reused else None)
    assert pd_cluster.complete("hello " * 10, max_tokens=2)["choices"]
"""


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Inner:
    monkeypatch.delenv("CI", raising=False)  # CI refuses --pd-reuse=on; the CI case sets it itself
    return Inner(pytester, monkeypatch)


@pytest.fixture
def reuse_dir(inner: Inner) -> Any:
    """The inner sessions' reuse dir; whatever a case leaves kept is stopped afterwards."""
    path = inner.pytester.path / "reuse"
    yield path
    cli.main(["--dir", str(path), "stop", "--all"])


def _run(inner: Inner, reuse_dir: Path, *extra: str) -> pytest.RunResult:
    return inner.run("--pd-reuse", f"--pd-reuse-dir={reuse_dir}", *extra)


def _states(reuse_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(reuse_dir.glob("*.json"))]


def _server_pids(info: dict[str, Any]) -> list[int]:
    return [s["pid"] for s in info["servers"]]


def _stop_all(reuse_dir: Path, inner: Inner) -> None:
    assert cli.main(["--dir", str(reuse_dir), "stop", "--all"]) == 0
    inner.gone_within(10.0)
    unheld_locks(inner.lease_dir)
    assert _states(reuse_dir) == []


def test_second_run_attaches_to_the_kept_cluster_and_stop_all_leaves_nothing(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(UP)
    first = _run(inner, reuse_dir)
    first.assert_outcomes(passed=1)
    first.stdout.fnmatch_lines(["*pdserve: reuse: kept pd-1-* for the next --pd-reuse run*"])
    [state] = _states(reuse_dir)
    kept_pids = {s["pid"] for s in [*state["servers"], state["proxy"]]}
    assert all(read_stat(pid) is not None for pid in kept_pids), "kept servers must outlive the first pytest"
    with pytest.raises(AssertionError, match="still held"):
        unheld_locks(inner.lease_dir)  # the kept cluster's leases stay held while it runs

    second = _run(inner, reuse_dir)
    second.assert_outcomes(passed=1)
    second.stdout.fnmatch_lines([f"*reuse on (idle ttl 900s*kept clusters: {state['id']} (pd, *old)*"])
    second.stdout.fnmatch_lines([f"*cluster pd (sim, 1P x 1D) reused kept cluster {state['id']}, *old*"])
    infos = inner.infos()
    first_info = next(i for i in infos if i["reused"] is None)
    second_info = next(i for i in infos if i["reused"] is not None)
    assert second_info["reused"] == state["id"]
    assert [s["port"] for s in first_info["servers"]] == [s["port"] for s in second_info["servers"]]
    # The second run attached: it started no server (no process of its own behind the handles).
    assert all(s["pid"] is None for s in second_info["servers"])
    assert {s["pid"] for s in first_info["servers"]} == kept_pids

    listed = subprocess.run(
        [sys.executable, "-m", "pytest_pdserve.cli", "--dir", str(reuse_dir), "ls"],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    assert state["id"] in listed.stdout, listed.stdout
    assert "1P x 1D" in listed.stdout, listed.stdout
    _stop_all(reuse_dir, inner)


def test_a_different_configuration_starts_fresh_and_says_why(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(UP)
    _run(inner, reuse_dir).assert_outcomes(passed=1)
    [kept] = _states(reuse_dir)
    second = _run(inner, reuse_dir, "--pd-seed=7")
    second.assert_outcomes(passed=1)
    second.stdout.fnmatch_lines([f"*pd: starting a fresh cluster: kept cluster {kept['id']} differs in setting.seed*"])
    assert len(_states(reuse_dir)) == 2  # both kept: each fits its own configuration
    third = _run(inner, reuse_dir, "--pd-seed=7")
    third.stdout.fnmatch_lines(["*reused kept cluster*"])
    _stop_all(reuse_dir, inner)


def test_an_idle_cluster_stops_after_the_ttl(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(UP)
    _run(inner, reuse_dir, "--pd-reuse-ttl=1").assert_outcomes(passed=1)
    assert _states(reuse_dir)
    inner.gone_within(15.0)
    assert _states(reuse_dir) == []
    unheld_locks(inner.lease_dir)
    assert "idle for 1s" in (reuse_dir / "keeper.log").read_text()


def test_a_killed_keeper_takes_its_servers_down_and_the_next_run_starts_fresh(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(UP)
    _run(inner, reuse_dir).assert_outcomes(passed=1)
    [state] = _states(reuse_dir)
    os.kill(state["keeper"]["pid"], signal.SIGKILL)
    inner.gone_within(10.0)  # the keeper's guard stopped the kept servers
    second = _run(inner, reuse_dir)
    second.assert_outcomes(passed=1)
    second.stdout.fnmatch_lines([f"*kept cluster {state['id']}'s keeper (pid {state['keeper']['pid']}) is gone*"])
    assert [s["id"] for s in _states(reuse_dir)] != [state["id"]]
    _stop_all(reuse_dir, inner)


def test_a_kept_server_that_dies_stops_its_cluster(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(UP)
    _run(inner, reuse_dir).assert_outcomes(passed=1)
    [state] = _states(reuse_dir)
    prefill = state["servers"][0]
    os.killpg(prefill["pgid"], signal.SIGKILL)
    inner.gone_within(10.0)  # decode and proxy too: a cluster without its prefill is no cluster
    assert _states(reuse_dir) == []
    unheld_locks(inner.lease_dir)
    assert f"stopped {state['id']} (prefill-0 (pid {prefill['pid']}) is gone)" in (reuse_dir / "keeper.log").read_text()


def test_a_cluster_another_run_holds_is_not_shared(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(UP)
    _run(inner, reuse_dir).assert_outcomes(passed=1)
    [kept] = reuse.list_kept(reuse_dir)
    held = reuse.claim(kept)
    assert held is not None
    try:
        second = _run(inner, reuse_dir)
        second.assert_outcomes(passed=1)
        second.stdout.fnmatch_lines([f"*starting a fresh cluster: kept cluster {kept.id} is in use by another run*"])
    finally:
        held.release()
    _stop_all(reuse_dir, inner)


def test_prefix_cache_is_reset_when_a_run_attaches(inner: Inner, reuse_dir: Path) -> None:
    # With --pd-cache-salt=off the same prompt would hit the cache the previous run warmed, but for the reset.
    inner.pytester.makepyfile(
        """
        PROMPT = "the same long prompt " * 40

        def hits(cluster):
            return sum(v for _, v in cluster.prefill[0].metrics().series("vllm:prefix_cache_hits_total").items())

        def test_cold(pd_cluster, pdinfo):
            before = hits(pd_cluster)
            pd_cluster.complete(PROMPT, max_tokens=1)
            pdinfo(pd_cluster, hits=hits(pd_cluster) - before, reused=pd_cluster.reused is not None)
        """
    )
    _run(inner, reuse_dir, "--pd-cache-salt=off").assert_outcomes(passed=1)
    _run(inner, reuse_dir, "--pd-cache-salt=off").assert_outcomes(passed=1)
    by_reuse = {i["reused"]: i["hits"] for i in inner.infos()}
    assert by_reuse == {False: 0, True: 0}, by_reuse
    _stop_all(reuse_dir, inner)


def test_a_run_that_waits_for_the_kept_gpus_gets_them(inner: Inner, reuse_dir: Path) -> None:
    inner.pytester.makepyfile(UP)
    _run(inner, reuse_dir, "--pd-simulate-gpus=2").assert_outcomes(passed=1)
    [state] = _states(reuse_dir)
    # A run without --pd-reuse needs both GPUs: it waits, says so, and the keeper gives them up.
    other = inner.run("--pd-simulate-gpus=2", "--pd-gpu-wait-timeout=60")
    other.assert_outcomes(passed=1)
    other.stdout.fnmatch_lines(["*waiting for*GPU*kept for reuse*"])
    assert "another run waits for its GPUs" in (reuse_dir / "keeper.log").read_text()
    assert state["id"] not in [s["id"] for s in _states(reuse_dir)]
    inner.gone_within(10.0)
    unheld_locks(inner.lease_dir)


def test_ci_refuses_reuse_unless_forced(inner: Inner, reuse_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inner.pytester.makepyfile(UP)
    monkeypatch.setenv("CI", "true")
    refused = _run(inner, reuse_dir)
    refused.assert_outcomes(passed=1)
    refused.stdout.fnmatch_lines(["*pdserve: reuse off: refused because CI=true*--pd-reuse=force*"])
    inner.gone_within(5.0)
    assert _states(reuse_dir) == []
    forced = inner.run("--pd-reuse=force", f"--pd-reuse-dir={reuse_dir}")
    forced.assert_outcomes(passed=1)
    forced.stdout.fnmatch_lines(["*reuse force (CI is set)*", "*kept pd-1-*"])
    _stop_all(reuse_dir, inner)


# ------------------------------------------------------------------------------------------- hostile input


def test_a_reuse_dir_others_can_write_is_refused(inner: Inner) -> None:
    shared = inner.pytester.path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    inner.pytester.makepyfile(UP)
    result = inner.run("--pd-reuse", f"--pd-reuse-dir={shared}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--pd-reuse: reuse directory {shared} is writable by others (mode 0777)*"])


def test_planted_state_files_are_never_trusted(inner: Inner, reuse_dir: Path) -> None:
    reuse_dir.mkdir(mode=0o700)
    (reuse_dir / "garbage.json").write_text("{not json")
    # A bystander process, and a state file naming it as server and keeper: nothing may signal it.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        me = read_stat(bystander.pid)
        assert me is not None
        fake = {"pid": bystander.pid, "pgid": bystander.pid, "starttime": me.starttime, "token": "nothing-carries-it",
                "url": "http://127.0.0.1:9", "name": "prefill-0", "role": "prefill", "index": 0}  # fmt: skip
        planted = {
            "id": "planted-1", "spec_name": "pd", "created": 0, "fingerprint": {}, "servers": [fake],
            "proxy": {**fake, "name": "proxy", "role": "proxy"},
            "keeper": {"pid": bystander.pid, "starttime": me.starttime + 1, "socket": "x", "ttl": 1, "since": 0},
        }  # fmt: skip
        (reuse_dir / "planted-1.json").write_text(json.dumps(planted))
        inner.pytester.makepyfile(UP)
        result = _run(inner, reuse_dir)
        result.assert_outcomes(passed=1)
        result.stdout.fnmatch_lines(["*reuse: removed *garbage.json: not a kept-cluster state*"])
        assert bystander.poll() is None, "a pid named in a state file was signalled"
        assert not (reuse_dir / "garbage.json").exists()
        assert not (reuse_dir / "planted-1.json").exists()  # its "keeper" is not running: removed
    finally:
        bystander.kill()
        bystander.wait(10)
    _stop_all(reuse_dir, inner)


def test_the_keeper_serves_only_its_own_user(inner: Inner, reuse_dir: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user (setuid)")
    inner.pytester.makepyfile(UP)
    _run(inner, reuse_dir).assert_outcomes(passed=1)
    [kept] = reuse.list_kept(reuse_dir)
    probe = (
        "import os, socket, sys\n"
        "os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(5)\n"
        f"s.connect('\\0' + {kept.socket_name!r}); s.sendall(b'stop *\\n')\n"
        "sys.stdout.write(repr(s.recv(100)))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert out.stdout in ("b''", ""), out  # the keeper closed the connection without an answer
    assert reuse.list_kept(reuse_dir), "another user's `stop *` stopped our kept cluster"
    assert "refused a connection from uid 65534" in (reuse_dir / "keeper.log").read_text()
    assert live_procs(inner.mark), "the kept cluster must still run"
    _stop_all(reuse_dir, inner)


def test_pdserve_stop_names_what_it_does_not_know(inner: Inner, reuse_dir: Path) -> None:
    reuse_dir.mkdir(mode=0o700)
    out = subprocess.run(
        [sys.executable, "-m", "pytest_pdserve.cli", "--dir", str(reuse_dir), "stop", "nope"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 1
    assert "no kept cluster named nope (kept: none)" in out.stderr
