"""Which physical GPU each server gets, proven by the UUID the server itself reports (GPU-mode simulator).

The UUIDs come from ``GET /version`` of each server (torch's ``get_device_properties(0).uuid`` inside it) and
are held against ``nvidia-smi --query-gpu=index,uuid`` read by the outer test, and against the pids nvidia-smi
lists as compute apps while the cluster runs.
"""

from __future__ import annotations

from typing import Any

import pytest

from .gpuproof import Inner, PhysicalGpus, find_line, gate_seconds, ready_seconds

pytestmark = pytest.mark.cuda

CLUSTER_TEST = """
from gpuinner import describe, record

def test_cluster(gpu_cluster):
    record("cluster", describe(gpu_cluster))
"""


def check_server(server: dict[str, Any], apps: list[list[Any]], gpus: PhysicalGpus) -> str:
    """The server reports the UUID its ``CUDA_VISIBLE_DEVICES`` token names, and nvidia-smi lists it there."""
    assert len(server["handle_gpus"]) == 1, server
    expected = gpus.by_token(server["handle_gpus"][0])
    assert server["uuid"] == expected, f"{server['name']} runs on {server['uuid']}, its token names {expected}"
    assert server["cvd"] == ",".join(server["handle_gpus"]), server
    assert [server["pid"], expected] in apps, f"nvidia-smi lists no pid {server['pid']} on {expected}: {apps}"
    return str(expected)


@pytest.mark.gpus(2)
def test_prefill_and_decode_run_on_distinct_physical_gpus(
    inner: Inner, physical_gpus: PhysicalGpus, evidence: Any
) -> None:
    inner.pytester.makepyfile(test_inner=CLUSTER_TEST)
    result = inner.run()
    result.assert_outcomes(passed=1)
    info = inner.read("cluster")
    prefill, decode = info["servers"]
    p_uuid = check_server(prefill, info["apps"], physical_gpus)
    d_uuid = check_server(decode, info["apps"], physical_gpus)
    assert p_uuid != d_uuid, f"prefill and decode share {p_uuid}"
    gates = gate_seconds(result.outlines)
    assert len(gates) == 1, result.outlines
    evidence(
        nvidia_smi=physical_gpus.raw.strip().splitlines(), servers=info["servers"], compute_apps=info["apps"],
        ready_line=find_line(result.outlines, r"pdserve: cluster .* ready in .*").group(0),
        ready_seconds=ready_seconds(result.outlines), teardown_gate_seconds=gates[0],
    )  # fmt: skip


@pytest.mark.gpus(2)
@pytest.mark.parametrize("form", ["indices", "uuids"])
def test_callers_reordered_visible_devices_are_honoured(
    form: str, inner: Inner, physical_gpus: PhysicalGpus, evidence: Any
) -> None:
    """``CUDA_VISIBLE_DEVICES=1,0`` (or the same as UUIDs): prefill gets GPU 1, decode GPU 0."""
    gpu0, gpu1 = physical_gpus.uuids[:2]
    cvd = "1,0" if form == "indices" else f"{gpu1},{gpu0}"
    inner.pytester.makepyfile(test_inner=CLUSTER_TEST)
    result = inner.run(cvd=cvd)
    result.assert_outcomes(passed=1)
    find_line(result.outlines, rf"pdserve: inventory cuda: 2 GPUs \(CUDA_VISIBLE_DEVICES={cvd}\)")
    prefill, decode = inner.read("cluster")["servers"]
    apps = inner.read("cluster")["apps"]
    assert check_server(prefill, apps, physical_gpus) == gpu1
    assert check_server(decode, apps, physical_gpus) == gpu0
    tokens = (["1"], ["0"]) if form == "indices" else ([gpu1], [gpu0])
    assert (prefill["handle_gpus"], decode["handle_gpus"]) == tokens
    evidence(caller_cvd=cvd, servers=[{k: s[k] for k in ("name", "handle_gpus", "cvd", "uuid", "pid")}
                                      for s in (prefill, decode)])  # fmt: skip


@pytest.mark.gpus(2)
def test_decode_gpu_id_alone_leases_another_gpu_for_prefill(
    inner: Inner, physical_gpus: PhysicalGpus, evidence: Any
) -> None:
    """``--pd-decode-gpu-ids=1`` alone: decode on GPU 1, prefill on a leased GPU of its own (GPU 0), not on all."""
    gpu0, gpu1 = physical_gpus.uuids[:2]
    inner.pytester.makepyfile(test_inner=CLUSTER_TEST)
    result = inner.run("--pd-decode-gpu-ids=1")
    result.assert_outcomes(passed=1)
    info = inner.read("cluster")
    prefill, decode = info["servers"]
    assert check_server(prefill, info["apps"], physical_gpus) == gpu0
    assert check_server(decode, info["apps"], physical_gpus) == gpu1
    find_line(result.outlines, r"GPUs \[.*\] released after a [0-9.]+s gate")
    evidence(servers=[{k: s[k] for k in ("name", "handle_gpus", "cvd", "uuid", "pid")} for s in (prefill, decode)])


@pytest.mark.gpus(1)
def test_one_visible_gpu_skips_a_two_gpu_cluster_naming_share_gpus(
    inner: Inner, physical_gpus: PhysicalGpus, evidence: Any
) -> None:
    """One GPU visible (the machine's last): a 1P x 1D cluster and ``gpus(2)`` skip, naming the count (and the
    cluster's reason ``--pd-share-gpus``); ``gpus(1)`` runs."""
    last = str(len(physical_gpus.uuids) - 1)
    inner.pytester.makepyfile(
        test_two="""
import pytest

def test_cluster_needs_two(gpu_cluster):
    raise AssertionError("a 2-GPU cluster must not start with one GPU visible")

@pytest.mark.gpus(2)
def test_marked_two():
    raise AssertionError("gpus(2) must skip with one GPU visible")

@pytest.mark.gpus(1)
def test_marked_one():
    pass
"""
    )
    result = inner.run("test_two.py", cvd=last)
    result.assert_outcomes(passed=1, skipped=2)
    factory_skip = find_line(result.outlines, r"SKIPPED .*cluster gpu needs 2 GPUs.*").group(0)
    assert "1 visible" in factory_skip, factory_skip
    assert f"CUDA_VISIBLE_DEVICES={last}" in factory_skip, factory_skip
    assert "--pd-share-gpus" in factory_skip, factory_skip
    marker_re = rf"SKIPPED .*needs 2 GPUs, 1 visible: CUDA_VISIBLE_DEVICES={last}"
    marker_skip = find_line(result.outlines, marker_re).group(0)
    find_line(result.outlines, r"PASSED .*test_marked_one|test_two.py::test_marked_one PASSED")
    evidence(caller_cvd=last, factory_skip=factory_skip, marker_skip=marker_skip)


@pytest.mark.gpus(1)
@pytest.mark.parametrize("form", ["index", "uuid"])
def test_share_gpus_runs_both_servers_on_the_callers_one_gpu(
    form: str, inner: Inner, physical_gpus: PhysicalGpus, evidence: Any
) -> None:
    """``--pd-share-gpus`` with ``CUDA_VISIBLE_DEVICES`` naming one GPU (index or UUID): both servers on it,
    started one after the other, each with ``--gpu-memory-utilization 0.4``, both listed by nvidia-smi."""
    last = len(physical_gpus.uuids) - 1
    uuid = physical_gpus.uuids[last]
    cvd = str(last) if form == "index" else uuid
    inner.pytester.makepyfile(test_inner=CLUSTER_TEST)
    result = inner.run("--pd-share-gpus", cvd=cvd)
    result.assert_outcomes(passed=1)
    find_line(result.outlines, rf"pdserve: inventory cuda: 1 GPU \(CUDA_VISIBLE_DEVICES={cvd}\)")
    find_line(result.outlines, r"pdserve: gpu: servers share a GPU; starting them one after another")
    info = inner.read("cluster")
    prefill, decode = info["servers"]
    for server in (prefill, decode):
        assert check_server(server, info["apps"], physical_gpus) == uuid
        assert server["handle_gpus"] == [cvd], server
        assert server["gpu_memory_utilization"] == "0.4", server
    assert prefill["pid"] != decode["pid"]
    # Memory of both is on the one GPU: nvidia-smi lists each pid there with memory in use.
    used = {pid: mib for pid, gpu, mib in info["apps_mib"] if gpu == uuid}
    for server in (prefill, decode):
        mib = used.get(server["pid"], "0")
        assert mib.isdigit(), (server, info["apps_mib"])
        assert int(mib) > 0, (server, info["apps_mib"])
    gates = gate_seconds(result.outlines)
    assert len(gates) == 1, result.outlines
    evidence(
        caller_cvd=cvd, servers=[{k: s[k] for k in ("name", "handle_gpus", "cvd", "uuid", "pid", "ready_seconds",
                                                      "gpu_memory_utilization")} for s in (prefill, decode)],
        compute_apps=info["apps_mib"], ready_seconds=ready_seconds(result.outlines), teardown_gate_seconds=gates[0],
    )  # fmt: skip


def test_gpu_count_markers_run_what_fits_and_skip_the_rest(
    inner: Inner, physical_gpus: PhysicalGpus, evidence: Any
) -> None:
    """``gpus(n)`` runs a cluster on the n visible GPUs (shared on one); ``gpus(n+1)`` and
    ``distributed(num_gpus=n+1)`` skip, naming the count."""
    n = len(physical_gpus.uuids)
    inner.pytester.makepyfile(
        test_markers=f"""
import pytest
from gpuinner import describe, record

@pytest.mark.gpus({n})
def test_fits(gpu_cluster):
    record("cluster", describe(gpu_cluster))

@pytest.mark.gpus({n + 1})
def test_too_many():
    raise AssertionError("must be skipped")

@pytest.mark.distributed(num_gpus={n + 1})
def test_too_many_distributed():
    raise AssertionError("must be skipped")
"""
    )
    result = inner.run(*physical_gpus.share_args)
    result.assert_outcomes(passed=1, skipped=2)
    reasons = [line for line in result.outlines if line.startswith("SKIPPED")]
    assert len(reasons) == 2, result.outlines
    plural = "GPU" if n == 1 else "GPUs"
    assert all(f"needs {n + 1} GPUs, {n} visible" in r for r in reasons), reasons
    info = inner.read("cluster")
    assert len({s["uuid"] for s in info["servers"]}) == min(n, 2), info["servers"]
    evidence(visible=f"{n} {plural}", skips=reasons, passed=[line for line in result.outlines if "PASSED" in line])
