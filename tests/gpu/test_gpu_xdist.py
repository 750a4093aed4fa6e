"""``pytest -n 2``: two workers run two clusters at the same time on four disjoint GPUs (machine-wide leases);
with one GPU visible the second worker waits for it (with a message), or skips with ``--pd-gpu-wait=skip``."""

from __future__ import annotations

from typing import Any

import pytest

from .gpuproof import Inner, PhysicalGpus, find_line

pytestmark = pytest.mark.cuda

XDIST_TEST = """
import json, os, time
from pathlib import Path

import httpx
import pytest
from gpuinner import compute_apps, describe, record


def wait_for(kind, me):
    # Bounded two-phase barrier: the other worker's file of this kind, as soon as it exists.
    deadline = time.monotonic() + 180
    proof = Path(os.environ["PROOF_DIR"])
    while True:
        found = [p for p in proof.glob(f"{kind}-*.json") if p.name != f"{kind}-{me}.json"]
        if found:
            return json.loads(found[0].read_text())
        assert time.monotonic() < deadline, f"no other worker wrote {kind}: both tests ran on one worker?"
        time.sleep(0.05)


@pytest.mark.parametrize("n", [0, 1])
def test_cluster(n, gpu_cluster):
    info = describe(gpu_cluster)
    me = info["worker"]
    record(f"up-{me}", info)
    other = wait_for("up", me)
    # Both clusters are up now: the other worker's servers answer while ours run.
    answers = [httpx.get(s["url"] + "/version", timeout=30, trust_env=False).status_code for s in other["servers"]]
    record(f"overlap-{me}", {"t": time.time(), "other": other["worker"], "answers": answers, "apps": compute_apps()})
    wait_for("overlap", me)  # keep ours up until the other worker has checked it
"""


@pytest.mark.gpus(4)
def test_two_xdist_workers_run_two_clusters_on_four_disjoint_gpus(
    inner: Inner, physical_gpus: PhysicalGpus, evidence: Any
) -> None:
    inner.pytester.makepyfile(test_xdist=XDIST_TEST)
    result = inner.run("-n", "2")
    result.assert_outcomes(passed=2)
    workers = sorted(p.stem.split("-", 1)[1] for p in inner.results.glob("up-*.json"))
    assert workers == ["gw0", "gw1"], workers
    ups = {w: inner.read(f"up-{w}") for w in workers}
    overlaps = {w: inner.read(f"overlap-{w}") for w in workers}
    uuids: list[str] = []
    for w, info in ups.items():
        for s in info["servers"]:
            expected = physical_gpus.by_token(s["handle_gpus"][0])
            assert s["uuid"] == expected, f"{w} {s['name']} runs on {s['uuid']}, its token names {expected}"
            uuids.append(s["uuid"])
        assert overlaps[w]["answers"] == [200, 200], overlaps[w]
    assert len(set(uuids)) == 4, f"the two clusters share a GPU: {uuids}"
    every_server = sorted([s["pid"], s["uuid"]] for info in ups.values() for s in info["servers"])
    for w, ov in overlaps.items():
        seen = sorted(a for a in ov["apps"] if a in every_server)
        assert seen == every_server, f"at {w}'s overlap check nvidia-smi did not list all four servers: {ov['apps']}"
    evidence(
        clusters={
            w: {
                "ready_wall": info["wall"], "started_seconds": info["started_seconds"],
                "overlap_wall": overlaps[w]["t"],
                "servers": [{k: s[k] for k in ("name", "handle_gpus", "uuid", "pid")} for s in info["servers"]],
            }
            for w, info in ups.items()
        },
        both_up_from_wall=max(info["wall"] for info in ups.values()),
        overlap_apps=overlaps["gw0"]["apps"],
    )  # fmt: skip


CONTEND_TEST = """
import json, os, time
from pathlib import Path

import pytest
from gpuinner import GPU_ENV, describe, record
from pytest_pdserve.spec import ClusterSpec


def others(kind, me):
    proof = Path(os.environ["PROOF_DIR"])
    return [p for p in proof.glob(f"{kind}-*.json") if p.name != f"{kind}-{me}.json"]


@pytest.mark.parametrize("n", [0, 1])
def test_cluster(n, pd_cluster_factory):
    me = os.environ["PYTEST_XDIST_WORKER"]
    record(f"asking-{me}", {"t": time.time()})
    try:
        cluster = pd_cluster_factory(ClusterSpec(env=GPU_ENV, name="gpu"))
    except BaseException as exc:  # the skip under --pd-gpu-wait=skip
        record(f"refused-{me}", {"t": time.time(), "why": str(exc)})
        raise
    record(f"up-{me}", describe(cluster))
    if os.environ["CONTEND_MODE"] == "skip":
        # Keep the GPU until the other worker has asked for it and been refused (bounded).
        deadline = time.monotonic() + 120
        while not others("refused", me) and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        deadline = time.monotonic() + 120
        while not others("asking", me) and time.monotonic() < deadline:
            time.sleep(0.05)
        # timing: the other worker is now waiting for the GPU: its message is what this test proves (GPU host only)
        time.sleep(2)
    record(f"done-{me}", {"t": time.time()})
"""


@pytest.mark.gpus(1)
@pytest.mark.parametrize("mode", ["wait", "skip"])
def test_two_xdist_workers_on_one_gpu_wait_for_it_or_skip(
    mode: str, inner: Inner, physical_gpus: PhysicalGpus, evidence: Any
) -> None:
    """``-n 2``, one GPU visible, ``--pd-share-gpus``: one worker's cluster holds the GPU; the other waits for it
    with a message and runs once the first worker's session has released it, or skips with ``--pd-gpu-wait=skip``."""
    last = len(physical_gpus.uuids) - 1
    uuid = physical_gpus.uuids[last]
    inner.pytester.makepyfile(test_contend=CONTEND_TEST)
    inner.monkeypatch.setenv("CONTEND_MODE", mode)
    extra = ["--pd-gpu-wait=skip"] if mode == "skip" else []
    result = inner.run("-n", "2", "--pd-share-gpus", *extra, cvd=str(last))
    ups = {p.stem.split("-", 1)[1]: inner.read(p.stem) for p in sorted(inner.results.glob("up-*.json"))}
    for w, info in ups.items():
        assert {s["uuid"] for s in info["servers"]} == {uuid}, f"{w}: {info['servers']}"
    if mode == "skip":
        result.assert_outcomes(passed=1, skipped=1)
        refused = [inner.read(p.stem) for p in inner.results.glob("refused-*.json")]
        assert len(refused) == 1, refused
        assert "--pd-gpu-wait=skip" in refused[0]["why"], refused
        find_line(result.outlines, r"SKIPPED .*no 1 free GPU for cluster gpu .*--pd-gpu-wait=skip")
        evidence(mode=mode, skip=refused[0]["why"], holder=list(ups))
        return
    result.assert_outcomes(passed=2)
    assert sorted(ups) == ["gw0", "gw1"], ups
    first, second = sorted(ups, key=lambda w: ups[w]["wall"])
    done_first = inner.read(f"done-{first}")["t"]
    assert ups[second]["wall"] > done_first, "the second worker's cluster came up while the first still held the GPU"
    log = (inner.last_log_dir / second / "pdserve.log").read_text()
    waiting = find_line(log.splitlines(), r"pdserve: waiting for 1 free GPU\(s\) .*").group(0)
    assert uuid in waiting, waiting
    evidence(
        mode=mode, first=first, second=second, waiting_message=waiting,
        first_done_to_second_ready_s=round(ups[second]["wall"] - done_first, 3),
        second_started_seconds=ups[second]["started_seconds"],
        by_worker={w: [{k: s[k] for k in ("name", "handle_gpus", "uuid", "pid")} for s in info["servers"]]
                   for w, info in ups.items()},
    )  # fmt: skip


QUEUE_TEST = """
import os, time
from pathlib import Path

import pytest
from gpuinner import describe, record


@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_cluster(n, gpu_cluster):
    me = os.environ["PYTEST_XDIST_WORKER"]
    record(f"up-{me}", describe(gpu_cluster))
    proof = Path(os.environ["PROOF_DIR"])
    deadline = time.monotonic() + 120
    while len(list(proof.glob("asking-*.json"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)  # keep the GPUs until every worker has asked for some
    time.sleep(1)  # timing: the last asker is waiting now (GPU host only)
    record(f"done-{me}", {"t": time.time()})
"""

ASKING_CONFTEST_ADDON = """

@pytest.fixture(autouse=True)
def _asking():
    import os, time
    from gpuinner import record
    record(f"asking-{os.environ['PYTEST_XDIST_WORKER']}", {"t": time.time()})
"""


@pytest.mark.gpus(4)
def test_four_xdist_workers_on_four_gpus_two_run_two_wait(
    inner: Inner, physical_gpus: PhysicalGpus, evidence: Any
) -> None:
    """``-n 4`` with four 1P x 1D clusters on four GPUs: two run at once on disjoint GPUs, two wait (with a message)
    and run when a pair is released."""
    from .gpuproof import INNER_CONFTEST

    inner.pytester.makeconftest(INNER_CONFTEST + ASKING_CONFTEST_ADDON)
    inner.pytester.makepyfile(test_queue=QUEUE_TEST)
    result = inner.run("-n", "4", cvd="0,1,2,3")
    result.assert_outcomes(passed=4)
    ups = {p.stem.split("-", 1)[1]: inner.read(p.stem) for p in inner.results.glob("up-*.json")}
    done = {w: inner.read(f"done-{w}")["t"] for w in ups}
    assert sorted(ups) == ["gw0", "gw1", "gw2", "gw3"], ups
    order = sorted(ups, key=lambda w: ups[w]["wall"])
    first_two, last_two = order[:2], order[2:]
    uuids = [s["uuid"] for w in first_two for s in ups[w]["servers"]]
    assert len(set(uuids)) == 4, f"the two clusters that ran at once share a GPU: {uuids}"
    first_release = min(done[w] for w in first_two)
    for w in last_two:
        assert ups[w]["wall"] > first_release, f"{w} came up while both first clusters still held their GPUs"
    waiting = {}
    for w in last_two:
        log = (inner.last_log_dir / w / "pdserve.log").read_text()
        waiting[w] = find_line(log.splitlines(), r"pdserve: waiting for 2 free GPU\(s\) .*").group(0)
    evidence(
        order=order, waiting=waiting,
        up_after_first_release_s={w: round(ups[w]["wall"] - first_release, 3) for w in last_two},
        by_worker={w: [{k: s[k] for k in ("name", "handle_gpus", "uuid", "pid")} for s in ups[w]["servers"]]
                   for w in order},
    )  # fmt: skip
