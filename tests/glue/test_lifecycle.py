"""Lifecycle guarantees of the cluster fixtures, proven with real pytest sessions and real simulator processes.

Each test runs an inner pytest (``pytester.runpytest_subprocess``) with ``--pd-engine=sim`` and a private
lease directory. Every process the inner session starts inherits ``PDSERVE_TEST_MARK=<unique>``, so the
outer test finds them in ``/proc`` (never by name) and checks that none is left afterwards.
"""

from __future__ import annotations

import pytest
from _pdsession import INNER_CONFTEST, Inner, cluster_resources

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

#: The crash test's --pd-startup-timeout: far above any start on a loaded machine, so waiting for it is caught.
CRASH_STARTUP_TIMEOUT_S = 120


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Inner:
    return Inner(pytester, monkeypatch)


# ---------------------------------------------------------------------------------------------- tests


def test_prefill_and_decode_start_in_parallel(inner: Inner) -> None:
    """P and D each take >= 2 s to load; they are spawned together, so their start windows overlap."""
    inner.pytester.makepyfile(
        """
        from pytest_pdserve.spec import ClusterSpec

        def test_up(pd_cluster_factory, pdinfo):
            cluster = pd_cluster_factory(ClusterSpec(env={"PDSERVE_SIM_STARTUP_DELAY": "2"}))
            pdinfo(cluster)
        """
    )
    result = inner.run()
    result.assert_outcomes(passed=1)
    [info] = inner.infos()
    servers = {s["name"]: s for s in info["servers"]}
    p, d = servers["prefill-0"], servers["decode-0"]
    p_ready_at = p["started_at"] + p["ready_seconds"]
    d_ready_at = d["started_at"] + d["ready_seconds"]
    assert p["ready_seconds"] >= 2
    assert d["ready_seconds"] >= 2
    # Overlapping [spawn, ready] windows: D was spawned before P was ready, and vice versa. In series the second
    # spawn waits for the first's ready; in parallel the two spawns are one Popen apart (0.018 s at load 13), and
    # each start lasts at least its 2 s delay, a sleep that no load shortens. (How fast the cluster is up is
    # bench_startup's.)
    assert d["started_at"] < p_ready_at, (p, d)  # timing: the 2 s delay against one Popen (see above)
    assert p["started_at"] < d_ready_at, (p, d)  # timing: the same, the other way round
    print(
        f"spawned {abs(d['started_at'] - p['started_at']):.3f}s apart; cluster up in {info['started_seconds']:.2f}s,"
        f" P and D ready in {p['ready_seconds']:.2f}s and {d['ready_seconds']:.2f}s"
    )
    inner.assert_nothing_left([info])


def test_crash_at_startup_fails_fast_with_log_tail_exit_code_and_hint(inner: Inner) -> None:
    inner.pytester.makepyfile(
        """
        import time
        from pytest_pdserve.spec import ClusterSpec

        def test_crash(pd_cluster_factory, pdinfo):
            spec = ClusterSpec(decode_env={
                "PDSERVE_SIM_CRASH_AT_STARTUP": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB",
                "PDSERVE_SIM_CRASH_EXIT_CODE": "3",
            })
            t0 = time.monotonic()
            try:
                pd_cluster_factory(spec)
            finally:
                print(f"CRASH-DETECTED-AFTER {time.monotonic() - t0:.3f}")
        """
    )
    # A long startup timeout, and detection asserted well below it: a start that waits for the timeout instead of
    # noticing the exit fails, and a loaded machine does not (0.5 s measured quiet, 2.26 s on a loaded 2-core CI
    # machine, which failed the old 2.0 s bound). The speed itself is bench_startup's.
    result = inner.run("-s", f"--pd-startup-timeout={CRASH_STARTUP_TIMEOUT_S}", timeout=2 * CRASH_STARTUP_TIMEOUT_S)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    seconds = float(out.split("CRASH-DETECTED-AFTER ")[1].split()[0])
    print(f"crash at startup detected after {seconds:.2f}s (startup timeout {CRASH_STARTUP_TIMEOUT_S} s)")
    assert seconds < CRASH_STARTUP_TIMEOUT_S / 4, f"crash noticed only after {seconds:.2f}s"
    assert "decode-0: server process exited with exit code 3 before it became ready" in out
    assert "CUDA out of memory. Tried to allocate 2 GiB" in out  # the log tail
    assert "hint: the GPU ran out of memory" in out
    assert "full log: " in out
    inner.assert_nothing_left()


def test_failed_cluster_fails_every_test_fast_without_restarting(inner: Inner) -> None:
    inner.pytester.makepyfile(
        """
        import pytest
        from pytest_pdserve.spec import ClusterSpec

        @pytest.fixture
        def cluster(pd_cluster_factory):
            return pd_cluster_factory(ClusterSpec(decode_env={"PDSERVE_SIM_CRASH_AT_STARTUP": "boom"}))

        @pytest.mark.parametrize("n", range(4))
        def test_needs_cluster(cluster, n):
            pass
        """
    )
    result = inner.run("-vv")
    result.assert_outcomes(errors=4)
    out = result.stdout.str()
    assert out.count("decode-0: server process exited with exit code 1 before it became ready") >= 4
    # One start attempt: one decode log file, one "starting" line in it; the three later tests failed from the
    # cached error. (Counted, not timed: a ratio of setup times failed on a loaded machine's stalls.)
    decode_logs = list(inner.run_logs().glob("*-decode-0.log"))
    assert len(decode_logs) == 1, decode_logs
    assert decode_logs[0].read_text().count("pdserve: starting decode-0") == 1
    inner.assert_nothing_left()


#: The clock of the test below, and how long each part of the plugin's own work lasts there: the first start's
#: manager build, the cluster's start (PDSERVE_SIM_STARTUP_DELAY), its stop (SIGTERM ignored,
#: --pd-shutdown-timeout). Each alone outlasts the clock; the test's own billed work (its fixture setups, one
#: assert) takes milliseconds, on a loaded machine too.
UNBILLED_TIMEOUT_S = 10
UNBILLED_PART_S = 12
#: The inner conftest's slow manager build (the imports and GPU probes it stands for took seconds on a loaded
#: machine, and were billed to the first test until issue 42).
SLOW_BUILD = f"""
import time
import pytest_pdserve.glue.fixtures as _fixtures

_build = _fixtures.build_manager

def _slow_build(*args, **kwargs):
    time.sleep({UNBILLED_PART_S})  # timing: outlasts the test's clock on purpose
    return _build(*args, **kwargs)

_fixtures.build_manager = _slow_build
"""


@pytest.mark.parametrize("stopped", ["at the session's end", "after its last user"])
def test_session_start_and_stop_are_not_billed_to_a_tests_timeout(inner: Inner, stopped: str) -> None:
    """The manager's build (first case), the cluster's start (second case) and its stop (both), each 12 s, under
    --timeout=10: none is the test's (pytest-timeout #96). Any of them billed to the test outlasts the clock
    whatever the machine's speed, and what is billed stays far below it on a loaded machine too (a 3 s clock, with
    the build and a completion billed, fired on one). With a test in a second module, the cluster a test body
    asked for is stopped at its module's end (glue/last_user.py), not by the factory's teardown."""
    if stopped == "at the session's end":
        (inner.pytester.path / "conftest.py").write_text(INNER_CONFTEST + SLOW_BUILD)
    delay = UNBILLED_PART_S if stopped == "after its last user" else 0
    files = {
        "test_a": f"""
            from pytest_pdserve.spec import ClusterSpec

            def test_first(pd_cluster_factory):
                env = {{"PDSERVE_SIM_STARTUP_DELAY": "{delay}", "PDSERVE_SIM_IGNORE_SIGTERM": "1"}}
                cluster = pd_cluster_factory(ClusterSpec(env=env))
                assert cluster.started_seconds >= {delay}
            """
    }
    if stopped == "after its last user":
        files["test_b"] = "def test_later():\n    pass\n"
    inner.pytester.makepyfile(**files)
    result = inner.run(
        f"--timeout={UNBILLED_TIMEOUT_S}",  # timing: outlasted by each 12 s part (see above)
        f"--pd-shutdown-timeout={UNBILLED_PART_S}",
        "-p",
        "no:randomly",
    )
    result.assert_outcomes(passed=len(files))
    if len(files) == 2:
        result.stdout.fnmatch_lines(["*stopping cluster pd: no remaining test uses it*test_a.py::test_first)*"])
    inner.assert_nothing_left()


def test_failing_test_carries_server_logs_under_xdist(inner: Inner) -> None:
    inner.pytester.makepyfile(
        """
        def test_fails(pd_cluster):
            pd_cluster.complete("the quick brown fox " * 10, max_tokens=3)
            assert False, "deliberate"

        def test_passes(pd_cluster):
            pd_cluster.complete("hello " * 5, max_tokens=1)
        """
    )
    result = inner.run("-n", "2", "--dist=loadfile")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    for name in ("prefill-0", "decode-0", "proxy"):
        assert f"pdserve {name} log (" in out, name
    # Lines the servers wrote during the failing test (the request), not only the startup banner.
    sections = out.split("pdserve prefill-0 log (", 1)[1]
    # prefill and decode, for the test's request and for the P/D-ready round trip of the start (in its setup)
    assert sections.count('"POST /v1/completions HTTP/1.1" 200') == 4
    assert "proxy /v1/completions status=200" in sections
    assert out.count("pdserve decode-0 log (") == 1  # the passing test carries none
    inner.assert_nothing_left()


@pytest.mark.timeout(600)
def test_xdist_workers_get_disjoint_gpus_and_ports(inner: Inner) -> None:
    """-n 4 on 4 simulated GPUs: each worker's cluster takes 2; concurrent clusters never share a GPU or port."""
    for i in range(4):
        inner.pytester.makepyfile(
            **{
                f"test_mod{i}": """
                import os, time
                from pathlib import Path

                def test_cluster(pd_cluster, pdinfo):
                    info = pdinfo(pd_cluster, start=time.time())
                    pd_cluster.complete("abc " * 20, max_tokens=2)
                    # Hold the cluster until another one has been up (its record is written): the first test to end
                    # then overlapped another, however the workers' starts are spread (a fixed 1 s hold was not
                    # enough on a loaded machine). Bounded: after 240 s the overlap assertion below says why.
                    records = Path(os.environ["PDINFO_DIR"])
                    for _ in range(12000):
                        if len(list(records.glob("*.json"))) >= 2:
                            break
                        time.sleep(0.02)
                    pdinfo(pd_cluster, start=info["start"], end=time.time())
                """
            }
        )
    result = inner.run("-n", "4", "--pd-simulate-gpus=4", timeout=360)
    result.assert_outcomes(passed=4)
    infos = [i for i in inner.infos() if "end" in i]
    assert len(infos) == 4

    for info in infos:
        gpus, _ = cluster_resources(info)
        cvds = [s["cvd"] for s in info["servers"] if s["name"] != "proxy"]
        assert len(cvds) == 2, cvds
        assert len(gpus) == 2, cvds  # P and D each have their own GPU
    overlapping = 0
    for a in range(4):
        for b in range(a + 1, 4):
            ia, ib = infos[a], infos[b]
            if ia["start"] < ib["end"] and ib["start"] < ia["end"]:
                overlapping += 1
                (ga, pa), (gb, pb) = cluster_resources(ia), cluster_resources(ib)
                assert not ga & gb, f"GPU shared by {ia['test']} and {ib['test']}: {ga & gb}"
                assert not pa & pb, f"port shared by {ia['test']} and {ib['test']}: {pa & pb}"
    assert overlapping >= 1, "no two clusters ran at the same time; the test proved nothing"
    inner.assert_nothing_left(infos)
