"""The plugin inside the wrappers vLLM's CI runs pytest in (issue 47), each an inner session on the simulator.

vLLM 0.34.0's AMD wrapper (``.buildkite/scripts/hardware_ci/run-amd-test.sh``) exports ``PYTEST_TIMEOUT=2400`` and
``PYTEST_ADDOPTS`` with ``--timeout-method=thread``, ``-o faulthandler_timeout=1500`` and ``-p amd_ci_fast_exit``,
whose trylast ``pytest_unconfigure`` runs the atexit handlers and calls ``os._exit`` (no interpreter teardown); its
MoRIIO P/D e2e runs under pytest-shard (``--shard-id``/``--num-shards``). Each case checks what must hold there:
the tests pass, no process of the run is left when pytest is gone, and the servers' logs are complete.
"""

from __future__ import annotations

import json
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from _pdsession import GONE_WITHIN_S, Inner, live_procs, wait_for

from .test_vllm_modules import MODULES_VERSION, fetch_modules

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

#: amd_ci_fast_exit.py of vLLM 0.34.0 (.buildkite/scripts/hardware_ci/), its exit path as it is; without the native
#: fault reporter it loads from the CI image (a C library; vLLM's own plugin runs without it where it is missing).
FAST_EXIT = """
import atexit, os, sys
import pytest

_outer = None
_session = None

@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    global _outer
    if _outer is None:
        _outer = config

def pytest_sessionfinish(session, exitstatus):
    global _session
    if session.config is _outer:
        _session = session

@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if config is not _outer or _session is None:
        return
    if os.environ.get("VLLM_CI_FAST_EXIT") == "0":
        return
    status = int(_session.exitstatus)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        atexit._run_exitfuncs()
    except BaseException as exc:
        print(f"[amd-ci] exit handler failed: {exc!r}", file=sys.stderr)
    print(f"[amd-ci] pytest finished with exit {status}; leaving without native teardown", file=sys.stderr,
          flush=True)
    sys.stdout.flush()
    os._exit(status)
"""

#: run-amd-test.sh's PYTEST_ADDOPTS, as it builds it (its defaults; the pipeline may override the two timeouts).
AMD_ADDOPTS = (
    "--color=yes --durations=25 --durations-min=1.0 -o faulthandler_timeout=1500 --timeout-method=thread"
    " -p amd_ci_fast_exit"
)
#: What tests/conftest.py keeps out of every inner session (a test that sets PYTEST_ADDOPTS replaces it).
QUIET = "-p no:hypothesispytest -p no:anyio"
ANSI = re.compile(r"\x1b\[[0-9;]*m")

TWO_CLUSTERS = """
from pytest_pdserve.spec import ClusterSpec

def test_session_cluster(pd_cluster):
    assert pd_cluster.complete("Red Hat is", max_tokens=2)["usage"]["completion_tokens"] == 2

def test_another_cluster(pd_cluster_factory):
    other = pd_cluster_factory(ClusterSpec(name="other", num_decode=2))
    assert other.complete("Red Hat is", max_tokens=2)["usage"]["completion_tokens"] == 2
"""


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Inner:
    return Inner(pytester, monkeypatch)


def _servers_logs_complete(inner: Inner) -> list[Path]:
    """Every simulator's log ends with uvicorn's last words: it was stopped (SIGTERM, its grace) and flushed before
    the run ended, not cut off by a kill."""
    logs = [p for p in inner.run_logs().glob("*.log") if re.search(r"-(prefill|decode)-\d+\.log$", p.name)]
    assert logs, list(inner.run_logs().iterdir())
    for log in logs:
        assert log.read_text().rstrip().splitlines()[-1].startswith("INFO:     Finished server process ["), log
    return logs


def _nothing_left(inner: Inner) -> None:
    """At once, not after a wait: the plugin stops its servers before pytest exits, not its watchdog or guard after
    (they clean up after a pytest that died; here none did)."""
    assert live_procs(inner.mark) == {}


def test_amd_ci_fast_exit_leaves_nothing_running_and_logs_complete(inner: Inner, tmp_path: Path) -> None:
    inner.pytester.makepyfile(amd_ci_fast_exit=FAST_EXIT, test_pd=TWO_CLUSTERS)
    junit = tmp_path / "junit.xml"
    result = inner.run("-p", "amd_ci_fast_exit", "-rA", f"--junitxml={junit}", timeout=600)
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*2 passed*"])
    result.stderr.fnmatch_lines(["[[]amd-ci[]] pytest finished with exit 0; leaving without native teardown"])
    _nothing_left(inner)
    assert len(_servers_logs_complete(inner)) == 5  # 1P x 1D and 1P x 2D
    assert [case.get("name") for case in ET.parse(junit).getroot().iter("testcase")] == [
        "test_session_cluster",
        "test_another_cluster",
    ]


STUCK = """
import time
import pytest

def test_ok(pd_cluster):
    assert pd_cluster.complete("Red Hat is", max_tokens=2)["usage"]["completion_tokens"] == 2

# timing: fires on any machine, wherever it finds the test: the body never ends (the start is not billed to it)
@pytest.mark.timeout(5)
def test_stuck(pd_cluster):
    time.sleep(3600)  # timing: the overrun under test
"""


def test_timeout_method_thread_and_faulthandler_timeout(inner: Inner, monkeypatch: pytest.MonkeyPatch) -> None:
    """AMD CI's timeouts. A passing test is not disturbed by them; a test that overruns is ended by pytest-timeout's
    thread method, which dumps the stacks and calls ``os._exit(1)``: pytest dies without a teardown, and the
    plugin's watchdog stops what it left (so a timed-out CI job leaves no server on the machine)."""
    monkeypatch.setenv("PYTEST_TIMEOUT", "2400")
    monkeypatch.setenv("PYTEST_ADDOPTS", f"{QUIET} -o faulthandler_timeout=1500 --timeout-method=thread")
    inner.pytester.makepyfile(test_stuck=STUCK)
    result = inner.run("-v", timeout=600)
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*test_stuck.py::test_ok PASSED*"])
    out = result.stdout.str() + result.stderr.str()
    assert re.search(r"\+{5,} Timeout \+{5,}", out), out[-3000:]  # the thread method's stack dump, then os._exit
    assert "timeout: 2400.0s" in out
    assert "timeout method: thread" in out
    wait_for(lambda: not live_procs(inner.mark), GONE_WITHIN_S, "no process of the timed-out run left")


SHARDED = """
import json, os
import pytest

@pytest.mark.parametrize("case", range(6))
def test_case(pd_cluster, case, pdinfo):
    pdinfo(pd_cluster, case=case, worker=os.environ.get("PYTEST_XDIST_WORKER"))
    assert pd_cluster.complete(f"case {case}", max_tokens=2)["usage"]["completion_tokens"] == 2
"""


def test_pytest_shard_beside_xdist(inner: Inner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two shards of one suite (``--shard-id``/``--num-shards``, as vLLM's MoRIIO e2e), each with two xdist workers:
    every case runs in exactly one shard, on a cluster of its worker's own (its own leased ports), and each shard
    leaves nothing running."""
    monkeypatch.setenv("PYTEST_ADDOPTS", QUIET)  # pytest-shard loads (tests/conftest.py keeps it out elsewhere)
    inner.pytester.makepyfile(test_sharded=SHARDED)
    ran: dict[int, set[int]] = {}
    for shard in (0, 1):
        for f in inner.info_dir.glob("*.json"):
            f.unlink()
        result = inner.run(f"--shard-id={shard}", "--num-shards=2", "-n", "2", timeout=600)
        assert result.ret == 0, result.stdout.str()[-3000:]
        infos = [json.loads(p.read_text()) for p in inner.info_dir.glob("*.json")]
        ran[shard] = {i["case"] for i in infos}
        result.stdout.fnmatch_lines([f"*{len(ran[shard])} passed*"])
        ports = {i["worker"]: {s["port"] for s in i["servers"]} for i in infos}
        if len(ports) == 2:  # both workers ran cases: their clusters share no port
            first, second = ports.values()
            assert not first & second, ports
        wait_for(lambda: not live_procs(inner.mark), GONE_WITHIN_S, f"no process of shard {shard} left")
    assert ran[0] | ran[1] == set(range(6))
    assert not ran[0] & ran[1], ran
    assert ran[0], "shard 0 ran nothing: the split proves nothing"
    assert ran[1], "shard 1 ran nothing: the split proves nothing"


def test_vllms_module_under_the_amd_wrappers_pytest_addopts(
    inner: Inner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """vLLM 0.34.0's test_edge_cases.py, by the command docs/migrating.md gives its MI300 step, with PYTEST_ADDOPTS and
    PYTEST_TIMEOUT exactly as run-amd-test.sh exports them (fast exit, thread timeouts, colour): it passes with KV
    moved, and leaves nothing running."""
    modules = fetch_modules(MODULES_VERSION)
    shutil.copytree(modules, inner.pytester.path / "nixl_integration")
    inner.pytester.makepyfile(amd_ci_fast_exit=FAST_EXIT)
    monkeypatch.setenv("PYTEST_TIMEOUT", "2400")
    monkeypatch.setenv("PYTEST_ADDOPTS", f"{QUIET} {AMD_ADDOPTS}")
    result = inner.run(
        "nixl_integration/test_edge_cases.py", "--pd-export-env", "--pd-preset=vllm-edge-case", timeout=600
    )
    out = ANSI.sub("", result.stdout.str())
    assert result.ret == 0, out[-3000:]
    assert re.search(r"=+ 1 passed", out), out[-3000:]
    assert re.search(r"KV moved prefill -> decode in nixl_integration/test_edge_cases\.py: external_kv_transfer "
                     r"[1-9]", out), out[-3000:]  # fmt: skip
    assert "timeout method: thread" in out
    result.stderr.fnmatch_lines(["*[[]amd-ci[]] pytest finished with exit 0; leaving without native teardown*"])
    _nothing_left(inner)
    _servers_logs_complete(inner)
