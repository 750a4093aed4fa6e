"""``--pd-reuse`` on real GPUs: a kept cluster keeps its GPU memory across pytest runs, the next reuse run
attaches to the same processes, a run that needs the GPU gets it from the keeper, and ``pdserve stop --all``
leaves nothing on any GPU (nvidia-smi is the judge).

On a one-GPU machine the sessions run with ``--pd-share-gpus`` (both servers on the GPU).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from pytest_pdserve import cli
from pytest_pdserve.machine.gpu_probe import gpu_processes

from .gpuproof import Inner, PhysicalGpus

pytestmark = [pytest.mark.cuda, pytest.mark.gpus(1)]

REUSE_TEST = """
import os
from gpuinner import describe, record

def test_up(gpu_cluster):
    info = describe(gpu_cluster)
    info["reused"] = gpu_cluster.reused.kept_id if gpu_cluster.reused else None
    record(os.environ["RECORD_AS"], info)
"""


def _apps(pids: set[int]) -> list[list[Any]]:
    return [[a.pid, a.uuid] for a in gpu_processes() or [] if a.pid in pids]


def test_kept_cluster_holds_its_gpu_between_runs_and_gives_it_up(
    inner: Inner, physical_gpus: PhysicalGpus, evidence: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    inner.pytester.makepyfile(test_reuse=REUSE_TEST)
    reuse_dir = tmp_path / "reuse"
    reuse = ["--pd-reuse", "--pd-reuse-mode=force", f"--pd-reuse-dir={reuse_dir}", *physical_gpus.share_args]
    try:
        monkeypatch.setenv("RECORD_AS", "first")
        inner.run(*reuse).assert_outcomes(passed=1)
        first = inner.read("first")
        pids = {s["pid"] for s in first["servers"]}
        between = _apps(pids)  # no pytest runs now: only the keeper owns these servers
        assert sorted(between) == sorted([s["pid"], s["uuid"]] for s in first["servers"]), between

        monkeypatch.setenv("RECORD_AS", "second")
        t0 = time.monotonic()
        second_run = inner.run(*reuse)
        second_wall = time.monotonic() - t0
        second_run.assert_outcomes(passed=1)
        second = inner.read("second")
        assert second["reused"] is not None
        assert [(s["pid"], s["uuid"]) for s in second["servers"]] == [(s["pid"], s["uuid"]) for s in first["servers"]]

        # A run without --pd-reuse needs the GPU: it waits, the keeper stops the kept cluster, the run gets it.
        monkeypatch.setenv("RECORD_AS", "third")
        t0 = time.monotonic()
        third_run = inner.run(*physical_gpus.share_args)
        third_wall = time.monotonic() - t0
        third_run.assert_outcomes(passed=1)
        third = inner.read("third")
        assert not [a for a in third["apps"] if a[0] in pids], f"the kept servers still held the GPU: {third['apps']}"
        assert {s["uuid"] for s in third["servers"]} & {s["uuid"] for s in first["servers"]}
    finally:
        cli.main(["--dir", str(reuse_dir), "stop", "--all"])
    left = _apps(pids)
    assert not left, left
    evidence(
        gpus=physical_gpus.uuids, kept_pids=sorted(pids), apps_between_runs=between,
        second_run_wall_s=round(second_wall, 2), third_run_wall_s=round(third_wall, 2),
        first_started_s=first["started_seconds"], second_attach_s=second["started_seconds"],
        third_apps=third["apps"],
    )  # fmt: skip
