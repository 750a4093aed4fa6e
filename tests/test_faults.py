"""Faults a test causes on purpose (issue 47): ``ServerHandle.pause``/``resume``/``kill``/``restart``, the death
detection told of them, what is left at a test's end, and the assertions of what P/D does then, with the negative
control of each. On the simulator; examples/test_server_faults.py runs the faults on both engines
(tests/promises/test_examples.py).
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pytest_pdserve.assertions import (
    HUNG_MESSAGE,
    NOT_PD_READY_MESSAGE,
    SUCCEEDED_MESSAGE,
    assert_fails_fast,
    assert_kv_recomputed,
    assert_pd_ready,
)
from pytest_pdserve.cluster import PDCluster
from pytest_pdserve.errors import PDServeError
from pytest_pdserve.prompts import words
from pytest_pdserve.running import proctree
from pytest_pdserve.spec import ClusterSpec

#: Prefill starts a detached worker (its own session, the server token in its environment), as vLLM's EngineCore can
#: leave the group: a pause must reach it too.
SPEC = ClusterSpec(name="faults", kv_load_failure_policy="fail", prefill_env=(("PDSERVE_SIM_SPAWN_WORKERS", "1"),))


@pytest.fixture(scope="module")
def cluster(pd_cluster_factory: Any) -> PDCluster:
    cluster: PDCluster = pd_cluster_factory(SPEC)
    return cluster


def _wait(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.02)


def _states(pids: list[int]) -> set[str]:
    states = set()
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat").read_text()
        states.add(stat[stat.rindex(")") + 2])
    return states


def _tree(cluster: PDCluster, index: int = 0) -> list[int]:
    proc = cluster.prefill[index].process
    assert proc is not None
    return proctree.pids_with_env(proctree.SERVER_TOKEN_ENV, proc.server_token)


def test_pause_stops_the_whole_server_and_resume_continues_it(cluster: PDCluster) -> None:
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    pids = _tree(cluster)
    assert len(pids) >= 2, "the detached worker is part of the test"
    with prefill.paused():
        assert prefill.down == "paused by the test"
        _wait(lambda: _states(pids) == {"T"}, f"every process of prefill-0 stopped ({pids})")
        assert decode.process is not None
        assert _states([decode.process.pid or 0]) != {"T"}
    assert prefill.down is None
    _wait(lambda: "T" not in _states(pids), "prefill-0 continued")
    assert cluster.complete(words(30, seed=1), max_tokens=2)["usage"]["completion_tokens"] == 2


def test_a_request_waits_out_a_pause(cluster: PDCluster) -> None:
    """SGLang's heartbeat test, here: a short SIGSTOP of prefill aborts nothing. Not vacuous: the request is seen
    waiting in the paused prefill's socket (unread bytes) and unanswered before the resume."""
    prefill = cluster.prefill[0]
    with ThreadPoolExecutor(1) as pool:
        with prefill.paused():
            pending = pool.submit(cluster.complete, words(40, seed=2), max_tokens=3)
            _wait(lambda: prefill.unread_bytes() > 0, "the request reached the paused prefill")
            assert not pending.done()
        assert pending.result(timeout=120)["usage"]["completion_tokens"] == 3
    assert cluster.health.died is None


def test_a_paused_server_is_a_hang_to_assert_fails_fast(cluster: PDCluster) -> None:
    """The hang branch: a paused server cannot answer on any machine, so a short bound is no speed assertion. Its
    unanswered probe is not a death either (it is expected down)."""
    prefill = cluster.prefill[0]
    with prefill.paused(), pytest.raises(AssertionError) as hung:
        assert_fails_fast(prefill, {"prompt": "Red Hat is", "max_tokens": 1}, hang_after=2)
    assert str(hung.value) == HUNG_MESSAGE.format(
        target=f"prefill-0 ({prefill.url})", path="/v1/completions", hang_after=2
    )
    assert cluster.health.died is None


def test_a_killed_decode_fails_fast_and_a_restart_is_pd_ready(cluster: PDCluster) -> None:
    decode = cluster.decode[0]
    assert decode.process is not None
    old_pid, log_path = decode.process.pid, decode.log_path
    assert log_path is not None
    decode.kill()
    assert decode.down == "killed by the test"
    failed = assert_fails_fast(cluster, {"prompt": words(40, seed=3), "max_tokens": 2})
    assert failed.status == 502
    assert decode.url in failed.error or "decode" in failed.error, failed
    direct = assert_fails_fast(decode, {"prompt": "Red Hat is", "max_tokens": 1})
    assert direct.status is None
    assert direct.error.startswith("ConnectError"), direct
    assert cluster.health.died is None  # told: no ServerDied for the test's own kill
    seconds = decode.restart()
    assert seconds > 0
    assert decode.down is None
    assert decode.process is not None
    assert decode.process.pid != old_pid
    assert log_path.read_text().count("pdserve: starting decode-0:") == 2  # one log, appended to
    assert_pd_ready(cluster)


def test_a_kv_load_from_a_dead_prefill_fails_fast_under_policy_fail(cluster: PDCluster) -> None:
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    prompt = words(60, seed=4)
    params = prefill.complete(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    with prefill.killed():
        failed = assert_fails_fast(
            decode, {"prompt": prompt, "max_tokens": 2, "kv_transfer_params": params["kv_transfer_params"]}
        )
    assert failed.status == 500, failed
    assert_pd_ready(cluster)


def test_the_fault_assertions_fail_where_nothing_is_wrong(cluster: PDCluster) -> None:
    """Negative controls: a healthy request does not "fail fast"; a transfer is not a recompute; a server that gets
    no KV is not P/D-ready."""
    with pytest.raises(AssertionError) as succeeded:
        assert_fails_fast(cluster, {"prompt": words(20, seed=5), "max_tokens": 1})
    assert str(succeeded.value) == SUCCEEDED_MESSAGE.format(
        target=f"the cluster's proxy ({cluster.proxy.url})", path="/v1/completions"
    )
    with pytest.raises(AssertionError, match="the KV was not recomputed on decode: no KV load failed"):
        assert_kv_recomputed(cluster, lambda: cluster.complete(words(40, seed=6), max_tokens=2))
    not_decode = types.SimpleNamespace(
        prefill=cluster.prefill, decode=(cluster.decode[0], cluster.prefill[0]), proxy=cluster.proxy,
        client=cluster.client, model=cluster.model, block_size=cluster.block_size, engine=cluster.engine,
        attention_backend=cluster.attention_backend,
    )  # fmt: skip
    with pytest.raises(AssertionError) as not_ready:
        assert_pd_ready(not_decode)  # prefill-0 posing as a decode server gets no KV
    assert str(not_ready.value).startswith(NOT_PD_READY_MESSAGE.format(servers="prefill-0"))


def test_recompute_is_told_from_a_transfer(pd_cluster_factory: Any) -> None:
    """kv_load_failure_policy=recompute: decode answers a request whose prefill died after answering, and the check
    says so from decode's counters (a failed load, 0 external_kv_transfer tokens)."""
    cluster: PDCluster = pd_cluster_factory(ClusterSpec(name="recompute", kv_load_failure_policy="recompute"))
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    prompt = words(60, seed=7)
    params = prefill.complete(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    with prefill.killed():
        out = assert_kv_recomputed(
            cluster, lambda: decode.complete(prompt, max_tokens=2, kv_transfer_params=params["kv_transfer_params"])
        )
    assert out["usage"]["completion_tokens"] == 2
    assert_pd_ready(cluster)


def test_attached_and_reused_servers_cannot_be_signalled(cluster: PDCluster) -> None:
    decode = cluster.decode[0]
    process, decode.process = decode.process, None  # what attach mode and a reused kept cluster hand out
    try:
        for fault in (decode.pause, decode.kill, decode.restart):
            with pytest.raises(PDServeError, match="pdserve did not start it in this run"):
                fault()
        assert decode.down is None
    finally:
        decode.process = process


# ------------------------------------------------------------------------------------------ the death detection
# and a test's end, in inner sessions: what the plugin does after a test and in other tests is what is checked.

CONFTEST = """
import pytest
from pytest_pdserve.spec import ClusterSpec

@pytest.fixture(scope="session")
def faulty(pd_cluster_factory):
    return pd_cluster_factory(ClusterSpec(name="faulty"))
"""

TESTS = """
import os, signal

PIDS = []

def test_leaves_prefill_paused(faulty):
    faulty.prefill[0].pause()

def test_next_test_meets_it_resumed(faulty):
    assert faulty.prefill[0].down is None
    assert faulty.complete("Red Hat is", max_tokens=2)["usage"]["completion_tokens"] == 2

def test_leaves_decode_killed(faulty):
    PIDS.append(faulty.decode[0].process.pid)
    faulty.decode[0].kill()

def test_next_test_gets_a_fresh_cluster(faulty):
    assert faulty.decode[0].process.pid not in PIDS
    assert faulty.complete("Red Hat is", max_tokens=2)["usage"]["completion_tokens"] == 2

def test_a_kill_the_plugin_was_not_told_of_is_a_death(faulty):
    os.killpg(faulty.decode[0].process.pid, signal.SIGKILL)
    faulty.complete("Red Hat is", max_tokens=2)
"""


def test_a_fault_left_at_a_tests_end_does_not_reach_the_next_and_an_untold_kill_is_a_death(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_faulty=TESTS)
    result = pytester.runpytest_subprocess(
        "--pd-engine=sim", f"--pd-lease-dir={tmp_path / 'leases'}", f"--pd-log-dir={tmp_path / 'logs'}",
        "-p", "no:cacheprovider", "-rA", timeout=600,
    )  # fmt: skip
    result.assert_outcomes(passed=4, failed=1)
    result.stdout.fnmatch_lines([
        "*pdserve: prefill-0 of cluster faulty: resumed (test_faulty.py::test_leaves_prefill_paused left it paused)*",
        "*pdserve: stopping cluster faulty: test_faulty.py::test_leaves_decode_killed left decode-0 down (killed by "
        "the test)*",
        "*ServerDied: pdserve: decode-0 of cluster 'faulty' exited with signal 9 (SIGKILL)*",
    ])  # fmt: skip
