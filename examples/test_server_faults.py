"""Faults a test causes on purpose, and what P/D must do about each (on the simulator and on real vLLM).

A server of the cluster is paused (SIGSTOP: hung, its ports open), killed (SIGKILL: a crash) or restarted, from the
test; the plugin's own death detection is told, so what the requests meet is the test's to assert on:

* a short pause of prefill aborts nothing: a request sent meanwhile is answered once it resumes;
* with a server gone, a request fails at once with an error that names the cause, instead of hanging;
* after a restart the cluster is P/D-ready again: KV moves from prefill to decode;
* under ``kv_load_failure_policy=recompute`` a decode whose prefill died after answering still answers, and the
  check says the KV was recomputed, not transferred (an accuracy check alone cannot tell them apart).

The cluster is one of its own (faults do not touch the other examples' ``pd_cluster``); a server left down at the end
of a test is resumed, or its cluster stopped, by the plugin.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pytest_pdserve.assertions import assert_fails_fast, assert_kv_recomputed, assert_pd_ready
from pytest_pdserve.prompts import words
from pytest_pdserve.spec import ClusterSpec

FAULTS = ClusterSpec(name="faults", kv_load_failure_policy="recompute")


@pytest.fixture(scope="module")
def cluster(pd_cluster_factory):
    cluster = pd_cluster_factory(FAULTS)
    if cluster.reused is not None or cluster.attached:
        pytest.skip("faults need servers this run started, not a kept (--pd-reuse) or attached cluster")
    return cluster


def wait_until(condition, what, timeout=300.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def test_a_short_pause_of_prefill_aborts_nothing(cluster):
    prefill = cluster.prefill[0]
    with ThreadPoolExecutor(1) as pool:
        with prefill.paused():
            pending = pool.submit(cluster.complete, words(40, seed=1), max_tokens=4)
            wait_until(lambda: prefill.unread_bytes() > 0, "the request reached the paused prefill")
            assert not pending.done()
        assert pending.result()["usage"]["completion_tokens"] == 4


def test_a_dead_prefill_fails_requests_fast_decode_recomputes_and_a_restart_recovers(cluster):
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    prompt = words(60, seed=3)
    # P/D by hand, as the proxy does it: prefill computes the prompt's KV, keeps it and says where it is...
    params = prefill.complete(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    with prefill.killed():  # ...and dies before decode pulls it (killed() restarts it after the block)
        # Through the proxy, a request fails at once, and the proxy's answer names the server it could not reach.
        failed = assert_fails_fast(cluster, {"prompt": words(40, seed=2), "max_tokens": 4})
        assert failed.status == 502, failed
        # Decode (kv_load_failure_policy=recompute) answers anyway: it recomputed the prompt, and the check says so.
        out = assert_kv_recomputed(
            cluster, lambda: decode.complete(prompt, max_tokens=4, kv_transfer_params=params["kv_transfer_params"])
        )
        assert out["usage"]["completion_tokens"] == 4
    assert_pd_ready(cluster)  # P/D-ready again after the restart, not only HTTP-ready
