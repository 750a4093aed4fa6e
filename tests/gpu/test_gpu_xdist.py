"""``pytest -n 2``: two workers run two clusters at the same time on four disjoint GPUs (machine-wide leases)."""

from __future__ import annotations

from typing import Any

import pytest
from gpuproof import Inner, PhysicalGpus

pytestmark = [pytest.mark.cuda, pytest.mark.gpus(4)]

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
