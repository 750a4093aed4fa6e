"""Reliability: however pytest ends and whatever the servers do, nothing we started survives, and logs stay.

Each test runs a real inner pytest session against real simulator processes (``--pd-engine=sim``, a
private lease directory). Every process the inner session starts inherits ``PDSERVE_TEST_MARK=<unique>``,
so survivors are found in ``/proc`` by that mark (never by name), and by the servers' process groups.

``PDSERVE_STRESS_RUNS`` (default 1) sets how many times the xdist stress session is repeated; the issue's
20 runs take about 20 x 8 s (150 s) on two busy cores, too long for the default suite.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import time
import uuid
from pathlib import Path

import pytest
from _pdsession import GONE_WITHIN_S, INNER_CONFTEST, MARK_ENV, Inner, cluster_resources, live_procs, unheld_locks

from pytest_pdserve.running import port_race

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

STRESS_RUNS = int(os.environ.get("PDSERVE_STRESS_RUNS", "1"))
HANG_STARTUP_TIMEOUT_S = 6
#: A stop's upper bound where the alternative is minutes (tests/_timing_scan.py: BOUND_FLOOR_S).
BOUND_S = 60.0

#: An inner test that brings a cluster up in its fixture, reports it, then blocks in its body until the outer test
#: (or pytest-timeout) ends the session. The servers start setsid "VLLM::EngineCore" workers and ignore SIGTERM, so
#: they end only by SIGKILL and never get to stop their workers themselves: only the sweep by env token finds those.
#: Run with --pd-shutdown-timeout=1.
UP_AND_WAIT = """
import time
import pytest
from pytest_pdserve.spec import ClusterSpec

@pytest.fixture
def cluster(pd_cluster_factory, pdinfo):
    env = {"PDSERVE_SIM_SPAWN_WORKERS": "2", "PDSERVE_SIM_IGNORE_SIGTERM": "1"}
    cluster = pd_cluster_factory(ClusterSpec(env=env))
    pdinfo(cluster)
    return cluster

def test_up(cluster):
    time.sleep(600)  # timing: blocks until the outer test or pytest-timeout ends the session; the cluster is up
"""


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Inner:
    return Inner(pytester, monkeypatch)


# ------------------------------------------------------------------------------- pytest dies or is stopped


def test_sigkill_of_pytest_leaves_no_server(inner: Inner) -> None:  # how soon: bench_teardown
    inner.pytester.makepyfile(UP_AND_WAIT)
    with inner.popen("--pd-shutdown-timeout=1") as proc:
        info = inner.wait_info()
        comms = set(live_procs(inner.mark).values())
        assert {"VLLM::EngineCor", "VLLM::Worker"} <= comms, comms  # the setsid workers (comm is 15 chars)
        os.kill(proc.pid, signal.SIGKILL)
        seconds = inner.gone_within()
    print(f"SIGKILL of pytest -> every server, worker and the watchdog gone in {seconds:.2f}s")
    inner.assert_clean([info])


def test_pytest_timeout_thread_method_leaves_no_server(inner: Inner) -> None:
    """The thread method ends pytest with os._exit: no finaliser runs, the watchdog must clean up.

    The clock covers the test body only (``timeout_func_only``): it starts once the fixture has the cluster up and
    recorded, and the body blocks, so the timeout fires with the cluster up however slow the start was. (With the
    clock over the setup, a start slower than the timeout on a loaded machine was cut short, and the test proved
    nothing: issue 42.)"""
    inner.pytester.makepyfile(UP_AND_WAIT)
    result = inner.run(
        "--timeout=2", "-o", "timeout_func_only=true", "--timeout-method=thread", "--pd-shutdown-timeout=1"
    )
    exited = time.monotonic()
    assert "Timeout" in result.stdout.str() + result.stderr.str()
    assert result.ret != 0
    [info] = inner.infos()
    seconds = inner.gone_within()
    print(f"pytest-timeout (thread) -> everything gone {time.monotonic() - exited:.2f}s after pytest exited")
    assert seconds < GONE_WITHIN_S
    inner.assert_clean([info])


def test_ctrl_c_stops_servers_and_keeps_logs(inner: Inner) -> None:
    inner.pytester.makepyfile(UP_AND_WAIT)
    with inner.popen("--pd-shutdown-timeout=1") as proc:
        info = inner.wait_info()
        status = Path(f"/proc/{proc.pid}/status").read_text()
        ignored = int(re.search(r"^SigIgn:\s*([0-9a-f]+)", status, re.M).group(1), 16)  # type: ignore[union-attr]
        assert not ignored & 1 << signal.SIGINT - 1, "the inner pytest ignores SIGINT: no Ctrl-C could reach it"
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C: the foreground group
        proc.wait(30)
        seconds = inner.gone_within() + (time.monotonic() - t0)
    out = inner.output()
    assert "KeyboardInterrupt" in out
    print(f"Ctrl-C -> pytest exited and everything gone in {seconds:.2f}s")
    inner.assert_clean([info])


# ------------------------------------------------------------------------------------ servers misbehave


def test_server_crashing_mid_session_fails_the_test_with_its_log(inner: Inner) -> None:
    inner.pytester.makepyfile(
        """
        import pytest
        from pytest_pdserve.spec import ClusterSpec

        @pytest.fixture
        def cluster(pd_cluster_factory):
            # Request 1 is the P/D-ready round trip at start, 2 test_first's; the engine dies during test_second's,
            # which gets its 500 whatever the machine's speed (an engine dead after test_first's had exited a second
            # later, before a loaded machine's test_second asked).
            return pd_cluster_factory(ClusterSpec(decode_env={"PDSERVE_SIM_ENGINE_DIES_ON_REQUEST": "3"}))

        def test_first(cluster, pdinfo):
            pdinfo(cluster)
            cluster.complete("hello " * 10, max_tokens=2)

        def test_second(cluster):
            cluster.complete("hello again " * 10, max_tokens=2)
        """
    )
    result = inner.run()
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    # The second request fails at once naming the dead server (health.py), with the engine's error from its log (a
    # hang would end as a timeout, with neither), and the report carries what the decode server and the proxy logged
    # during that test.
    assert "ServerDied: pdserve: decode-0 of cluster" in out
    assert "EngineCore encountered an issue" in out
    sections = out.split("pdserve decode-0 log (", 1)[1]
    assert '"POST /v1/completions HTTP/1.1" 500' in sections
    assert "decode_status=500" in sections
    [decode_log] = inner.run_logs().glob("*-decode-0.log")
    assert "EngineDeadError" in decode_log.read_text()  # the log is kept, with the root cause
    inner.assert_clean(inner.infos())


def test_hanging_server_times_out_with_clear_message(inner: Inner) -> None:
    inner.pytester.makepyfile(
        """
        import time
        from pytest_pdserve.spec import ClusterSpec

        def test_hang(pd_cluster_factory):
            t0 = time.monotonic()
            try:
                pd_cluster_factory(ClusterSpec(env={"PDSERVE_SIM_HANG": "1"}))
            finally:
                print(f"GAVE-UP-AFTER {time.monotonic() - t0:.3f}")
        """
    )
    # Prefill and decode both hang, so the server the timeout names is a hung one whichever it is, however far each
    # got in its start (with only decode-0 hung, a prefill-0 slower than the timeout on a loaded machine was named).
    result = inner.run("-s", f"--pd-startup-timeout={HANG_STARTUP_TIMEOUT_S}")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    seconds = float(out.split("GAVE-UP-AFTER ")[1].split()[0])
    print(f"gave up {seconds:.2f}s after the start, for --pd-startup-timeout={HANG_STARTUP_TIMEOUT_S}")
    # Never before the timeout; after it, only the kill (10x for a loaded machine, far below the default 1200 s).
    assert HANG_STARTUP_TIMEOUT_S <= seconds < 10 * HANG_STARTUP_TIMEOUT_S, seconds
    # Counted from the server's spawn; the timeout from the lease.
    named = re.search(r"(prefill|decode)-0: not ready after \d+\.\ds", out)
    assert named, out[-3000:]
    assert "raise --pd-startup-timeout" in out
    assert "still waiting for GET http://127.0.0.1:" in out
    assert "the server was killed" in out
    assert f"pdserve: starting {named.group(1)}-0: " in out  # its log's tail, from the line the plugin wrote first
    inner.gone_within()
    unheld_locks(inner.lease_dir)


def test_server_ignoring_sigterm_is_killed_after_the_shutdown_timeout(
    inner: Inner, monkeypatch: pytest.MonkeyPatch
) -> None:
    inner.pytester.makepyfile(
        """
        import time
        from pytest_pdserve.spec import ClusterSpec

        def test_up(pd_cluster_factory, pdinfo):
            cluster = pd_cluster_factory(ClusterSpec(env={"PDSERVE_SIM_IGNORE_SIGTERM": "1"}))
            pdinfo(cluster, end=time.time())
        """
    )
    # The option against a 600 s setting from the environment: a stop that ignored it would outlast the inner run.
    monkeypatch.setenv("PDSERVE_SHUTDOWN_TIMEOUT", "600")
    result = inner.run("--pd-shutdown-timeout=1")
    result.assert_outcomes(passed=1)
    [info] = inner.infos()
    teardown = inner.session_finished_at() - info["end"]
    print(f"teardown with SIGTERM ignored and --pd-shutdown-timeout=1: {teardown:.2f}s")
    # The 1 s grace, then SIGKILL: never sooner, and far below the 600 s a broken option would give.
    assert 1.0 <= teardown < BOUND_S, teardown
    inner.assert_clean([info])


# ------------------------------------------------------------------------------------------------- ports


def _listen(port: int) -> socket.socket | None:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    s.listen(1)
    return s


def test_port_bound_by_a_foreign_process_is_never_handed_out(inner: Inner, monkeypatch: pytest.MonkeyPatch) -> None:
    # A 120-port range whose lower 40 ports a foreign listener holds: a lease that ignored bound ports would
    # pick one of them for nearly every port it hands out (the cluster takes 37 ports).
    low = random.randrange(10000, 19000)
    sockets = [s for p in range(low, low + 40) if (s := _listen(p)) is not None]
    taken = {s.getsockname()[1] for s in sockets}
    monkeypatch.setenv("PDSERVE_PORT_RANGE", f"{low}-{low + 119}")
    inner.pytester.makepyfile(
        """
        def test_up(pd_cluster, pdinfo):
            pdinfo(pd_cluster)
            pd_cluster.complete("hello " * 10, max_tokens=2)
        """
    )
    try:
        result = inner.run()
    finally:
        for s in sockets:
            s.close()
    result.assert_outcomes(passed=1)
    [info] = inner.infos()
    _, used = cluster_resources(info)
    assert len(used) == 37
    assert all(low <= p <= low + 119 for p in used), sorted(used)
    assert not used & taken, sorted(used & taken)
    inner.assert_clean([info])


GRAB_CONFTEST = r"""
import socket
import pytest_pdserve.machine.leases as leases

_held = []

def _grab(port):
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen(1)
    _held.append(s)

def _wrap(fn, which):
    def wrapper(*args, **kwargs):
        lease = fn(*args, **kwargs)
        purpose = kwargs.get("purpose", "")
        if purpose.startswith(which + "-") and "decode-0" in purpose:
            _grab(lease.base)  # a foreign listener takes the port between lease and server start
        return lease
    return wrapper

leases.acquire_ports = _wrap(leases.acquire_ports, "http")
leases.acquire_port_span = _wrap(leases.acquire_port_span, "side")
"""


def test_port_taken_between_lease_and_bind_fails_with_a_hint(inner: Inner) -> None:
    (inner.pytester.path / "conftest.py").write_text(INNER_CONFTEST + GRAB_CONFTEST)
    inner.pytester.makepyfile(
        """
        from pytest_pdserve.spec import ClusterSpec

        def test_http_port_taken(pd_cluster_factory):
            pd_cluster_factory(ClusterSpec(name="http", env={"WHICH": "http"}))

        def test_side_channel_port_taken(pd_cluster_factory):
            pd_cluster_factory(ClusterSpec(name="side", env={"WHICH": "side"}))
        """
    )
    result = inner.run()
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    # HTTP port answering before the start: refused before spawning, naming the port.
    assert "decode-0: port " in out
    assert "is already answering before the server was started" in out
    # Side channel taken: the server exits with EADDRINUSE, and the hint names the cause.
    assert "NIXL side channel could not bind 127.0.0.1:" in out
    assert "[Errno 98]" in out
    assert "address already in use" in out.lower()
    assert "hint: a port the server needs is taken" in out
    # Each lease is taken again the moment it is made: every start lost its port, the last one's error stands
    # (running/port_race.py; a single lost race is tests/running/test_port_race.py's).
    assert out.count(f"(attempt {port_race.ATTEMPTS} of {port_race.ATTEMPTS})") == 2, out[-3000:]
    inner.gone_within()
    unheld_locks(inner.lease_dir)


# ------------------------------------------------------------------------------------------------ xdist


STRESS_TEST = """
import os, signal, time

def test_cluster(pd_cluster, pdinfo):
    info = pdinfo(pd_cluster, start=time.time())
    pd_cluster.complete("abc " * 20, max_tokens=2)
    pdinfo(pd_cluster, start=info["start"], end=time.time(), kill={kill})
    if {kill}:
        os.kill(os.getpid(), signal.SIGKILL)  # the worker dies mid-session, holding its GPUs and ports
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", range(STRESS_RUNS))
def test_xdist_on_two_gpus_never_double_books(inner: Inner, run: int) -> None:
    """-n 4 on 2 simulated GPUs: clusters (2 GPUs each) take turns, including after a worker is SIGKILLed."""
    for i in range(4):
        inner.pytester.makepyfile(**{f"test_mod{i}": STRESS_TEST.format(kill=i == 3)})
    # The fourth cluster waits for three to start, answer and stop one after another: seconds each, on a loaded
    # machine too; the wait's bound is far beyond that.
    result = inner.run("-n", "4", "--pd-simulate-gpus=2", "--pd-gpu-wait-timeout=300", timeout=480)
    result.assert_outcomes(passed=3, failed=1)
    assert "crashed" in result.stdout.str()  # xdist saw the killed worker
    infos = [i for i in inner.infos() if "end" in i]
    assert len(infos) == 4

    for a, ia in enumerate(infos):
        assert cluster_resources(ia)[0] == {"0", "1"}
        for ib in infos[a + 1 :]:
            if ia["start"] < ib["end"] and ib["start"] < ia["end"]:
                (ga, pa), (gb, pb) = cluster_resources(ia), cluster_resources(ib)
                assert not ga & gb, f"GPUs {ga & gb} double-booked by {ia['test']} and {ib['test']}"
                assert not pa & pb, f"ports {pa & pb} shared by {ia['test']} and {ib['test']}"
    inner.assert_clean(infos)
    assert unheld_locks(inner.lease_dir)  # the leases existed, and are all free again


# -------------------------------------------------------------------------------------------- bad input

#: (id, CLI args, env, ini lines, test body, fragments the message must contain). An empty test body
#: means a test that needs no cluster (the error must come at configuration time, a usage error).
BAD_INPUTS = [
    ("engine", ["--pd-engine=bogus"], {}, "", "", ["'bogus'", "vllm, sim, auto"]),
    ("startup-timeout-env", [], {"PDSERVE_STARTUP_TIMEOUT": "-1"}, "", "",
     ["environment variable PDSERVE_STARTUP_TIMEOUT", "'-1'"]),
    ("block-size", ["--pd-block-size=0"], {}, "", "", ["--pd-block-size", "'0'", "from 1 to 8192"]),
    ("utilization-env", [], {"GPU_MEMORY_UTILIZATION": "1.5"}, "", "",
     ["environment variable GPU_MEMORY_UTILIZATION", "(0, 1]"]),
    ("gpu-ids-env", [], {"PREFILL_GPU_ID": "a,b"}, "", "", ["environment variable PREFILL_GPU_ID", "'a,b'"]),
    ("simulate-gpus", ["--pd-simulate-gpus=banana"], {}, "", "", ["--pd-simulate-gpus", "banana"]),
    ("extra-args-quotes", [], {"VLLM_SERVE_EXTRA_ARGS": '--foo "a b'}, "", "",
     ["environment variable VLLM_SERVE_EXTRA_ARGS", "quot"]),
    ("ini-seed", [], {}, "pdserve_seed = -3", "", ["pdserve_seed", "'-3'", "from 0 to 4294967295"]),
    ("prefill-url", ["--pd-prefill-url=ftp://x"], {}, "", "", ["--pd-prefill-url", "ftp://x", "http://"]),
    ("backend", ["--attention-backend=FLASH ATTN"], {}, "", "", ["--attention-backend", "FLASH ATTN"]),
    ("proxy-command", ["--pd-proxy-command=python 'x"], {}, "", "", ["--pd-proxy-command", "quotes"]),
    ("marker", [], {}, "", "@pytest.mark.gpus('two')\ndef test_x():\n    pass",
     ["bad marker", "'two'", "whole number"]),
    ("spec-num-prefill", [], {}, "", "ClusterSpec(num_prefill=0)",
     ["ClusterSpec.num_prefill must be a whole number from 1 to 64, got 0"]),
    ("spec-extra-args-string", [], {}, "", 'ClusterSpec(extra_args="--x")', ["extra_args", "not the string '--x'"]),
    ("spec-owned-flag", [], {}, "", 'ClusterSpec(extra_args=["--port", "1"])', ["--port", "is a flag pdserve owns"]),
    ("spec-env-value", [], {}, "", 'ClusterSpec(env={"A": 1})', ["env value for A must be a string"]),
    ("port-range-env", [], {"PDSERVE_PORT_RANGE": "9-1"}, "", "",
     ["'9-1' from environment variable PDSERVE_PORT_RANGE is not a valid port_range", "LOW-HIGH"]),
    ("sim-knob-env", [], {}, "", 'ClusterSpec(env={"PDSERVE_SIM_STARTUP_DELAY": "soon"})',
     ["PDSERVE_SIM_STARTUP_DELAY='soon'", "exited with exit code 2"]),
]  # fmt: skip


@pytest.mark.parametrize(("args", "env", "ini", "body", "fragments"), [b[1:] for b in BAD_INPUTS],
                         ids=[b[0] for b in BAD_INPUTS])  # fmt: skip
def test_bad_input_gives_a_clear_error_and_leaves_nothing(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    env: dict[str, str],
    ini: str,
    body: str,
    fragments: list[str],
) -> None:
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK_ENV, mark)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    if body.startswith("ClusterSpec("):
        body = f"def test_x(pd_cluster_factory):\n    pd_cluster_factory({body})"
    pytester.makepyfile(
        f"import pytest\nfrom pytest_pdserve.spec import ClusterSpec\n\n{body or 'def test_x(): pass'}\n"
    )
    lease_dir = pytester.path / "leases"
    # A subprocess, not in-process: an inline run that imports httpcore's lazy submodules would leave the outer
    # session with a second copy after pytester restores sys.modules (raw httpcore errors escaping httpx).
    result = pytester.runpytest_subprocess(
        "--pd-engine=sim", f"--pd-lease-dir={lease_dir}", "-p", "no:cacheprovider", *args
    )
    out = result.stdout.str() + result.stderr.str()
    if body and "def test_x():" not in body:
        result.assert_outcomes(failed=1)
    else:
        assert result.ret == pytest.ExitCode.USAGE_ERROR, out[-2000:]
    for fragment in fragments:
        assert fragment in out, f"{fragment!r} missing from:\n{out[-3000:]}"
    assert not live_procs(mark)
    if lease_dir.exists():
        unheld_locks(lease_dir)
