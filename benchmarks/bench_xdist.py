"""xdist scaling: 8 cluster-bound modules on a simulated inventory of 8 GPUs, ``-n 4`` vs ``-n 1``.

Each module owns a cluster (1P x 1D = 2 GPUs; a distinct ``ClusterSpec`` per module, stopped by a module-scoped
fixture via ``pd_cluster_factory.stop`` so a worker frees its GPUs before its next module). Each module has two
tests that send a few requests and hold the cluster ~``HOLD/2`` s each. ``--dist loadfile`` keeps a module on
one worker. Every test writes a record: worker, module, the CUDA_VISIBLE_DEVICES of its P and D (read from
``/proc/<pid>/environ``), and its wall-clock window; the benchmark checks that no GPU token is held by two
tests whose windows overlap.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from _common import InnerProject, load_average, print_table, probe_env, summary, write_result

MODULES = 8
HOLD = 2.0

CONFTEST = r"""
import json, os, time, uuid
from pathlib import Path

import pytest
from pytest_pdserve import ClusterSpec


def _cvd(pid):
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for entry in raw.split(b"\0"):
        if entry.startswith(b"CUDA_VISIBLE_DEVICES="):
            return entry.split(b"=", 1)[1].decode()
    return None


@pytest.fixture(scope="module")
def module_cluster(request, pd_cluster_factory):
    spec = ClusterSpec(env={"BENCH_MODULE": request.module.__name__})
    t0 = time.time()
    cluster = pd_cluster_factory(spec)
    cluster.bench_start = (t0, time.time())
    yield cluster
    pd_cluster_factory.stop(spec)


@pytest.fixture
def hold(module_cluster, request):
    start = time.time()
    yield module_cluster
    for i in range(3):
        module_cluster.complete(f"{request.node.name} {i} " * 8, max_tokens=4)
    time.sleep(float(os.environ["BENCH_HOLD"]))
    rec = {
        "test": request.node.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "master"),
        "module": request.module.__name__, "start": start, "end": time.time(),
        "cluster_start": module_cluster.bench_start, "started_seconds": module_cluster.started_seconds,
        "gpus": {s.name: _cvd(s.process.pid) for s in (*module_cluster.prefill, *module_cluster.decode)},
        "handle_gpus": {s.name: list(s.gpus) for s in (*module_cluster.prefill, *module_cluster.decode)},
    }
    Path(os.environ["BENCH_RECORDS"], f"{uuid.uuid4().hex}.json").write_text(json.dumps(rec))
"""

MODULE = """
def test_a(hold):
    pass


def test_b(hold):
    pass
"""


def check_no_sharing(records: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """(number of overlapping pairs checked, violations)."""
    problems: list[str] = []
    overlapping = 0
    for i, a in enumerate(records):
        for b in records[i + 1 :]:
            if a["module"] == b["module"]:
                continue
            if a["start"] < b["end"] and b["start"] < a["end"]:
                overlapping += 1
                ga = {t for v in a["gpus"].values() if v for t in v.split(",")}
                gb = {t for v in b["gpus"].values() if v for t in v.split(",")}
                if ga & gb:
                    problems.append(f"{a['test']} and {b['test']} share GPU {sorted(ga & gb)}")
    for r in records:
        tokens = [t for v in r["gpus"].values() if v for t in v.split(",")]
        if None in r["gpus"].values() or len(set(tokens)) != len(tokens):
            problems.append(f"{r['test']}: P and D GPUs {r['gpus']} missing or shared within the cluster")
    return overlapping, problems


def run(quick: bool = False) -> dict[str, Any]:
    modules = 4 if quick else MODULES
    hold = 0.5 if quick else HOLD / 2
    workers = 2 if quick else 4
    project = InnerProject("xdist")
    project.write("conftest.py", CONFTEST)
    for i in range(modules):
        project.write(f"test_mod{i}.py", MODULE)
    env = probe_env(None, BENCH_RECORDS=str(project.records), BENCH_HOLD=str(hold))
    load_before = load_average()
    runs: dict[str, dict[str, Any]] = {}
    try:
        for n in (workers, 1):
            project.clear_records()
            wall = project.run("-n", str(n), "--dist", "loadfile", env=env, timeout=600)
            records = project.read_records()
            overlapping, problems = check_no_sharing(records)
            startup = [r["started_seconds"] for r in records if r["test"].endswith("test_a")]
            runs[f"-n {n}"] = {
                "wall_s": wall, "tests": len(records), "overlapping_pairs": overlapping, "violations": problems,
                "cluster_startup": summary(startup), "hold_s_total": sum(r["end"] - r["start"] for r in records),
                "workers_used": sorted({r["worker"] for r in records}), "records": records,
            }  # fmt: skip
    finally:
        project.cleanup()
    par, ser = runs[f"-n {workers}"], runs["-n 1"]
    speedup = ser["wall_s"] / par["wall_s"]
    ideal_hold = ser["hold_s_total"] / workers
    rows = []
    for name, r in runs.items():
        rows.append([
            name, f"{r['wall_s']:.1f}", f"{r['hold_s_total']:.1f}", f"{r['cluster_startup']['median']:.2f}",
            r["tests"], r["overlapping_pairs"], "none" if not r["violations"] else "; ".join(r["violations"]),
        ])  # fmt: skip
    print_table(
        f"xdist: {modules} modules x 2 tests, cluster per module (2 of 8 simulated GPUs), hold {hold * 2:g}s per "
        f"module, --dist loadfile (TARGET speedup >= 3x at -n 4, no GPU shared)",
        ["run", "wall s", "sum of test time s", "cluster start median s", "tests", "overlapping pairs", "GPU sharing"],
        rows,
    )
    print(
        f"speedup -n {workers} vs -n 1: {speedup:.2f}x  (nproc={os.cpu_count()}; "
        f"hold-only lower bound at -n {workers}: {ideal_hold:.1f}s)"
    )
    data = {
        "modules": modules, "hold_per_test_s": hold, "workers": workers, "speedup": speedup,
        "load_before": load_before, "load_after": load_average(), "runs": runs,
    }  # fmt: skip
    print(f"-> {write_result('xdist', data)}")
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 modules, -n 2, short holds")
    run(parser.parse_args().quick)


if __name__ == "__main__":
    main()
