"""A test module written from the README alone, as a vLLM contributor would (issue 45), run on the simulator and on
vLLM for CPU: what passes on one passes on the other, refused or matched by the same rule (pytest_pdserve/rules/).

:data:`MODULE` covers what the contributor of issue 45 ported and could not do from the docs: MultiConnector cases
(a child without ``kv_role``, the OffloadingConnector on the CPU platform), the hybrid-SSM setup (the HND layout run
as LBHNC and said so, a short prompt on CPU, the long-prompt prefix cache where the platform allows it), the NHD layout
and ``--mamba-cache-mode all`` refused before any start in vLLM's words, a 2P x 1D cluster that overrides the
session's ``VLLM_SERVE_EXTRA_ARGS=--max-model-len,2048`` (the README's CI recipe), the metrics accessors and
``MetricsDelta``, and the session's engine before any cluster (``session_engine()`` in ``skipif``, ``pd_engine``).

The simulator tier runs the whole module (5 simulated clusters); the real-vLLM tier runs its refusals and the engine
test (``-k``), which start no server: every refusal is decided before a start, so the tier pays no real start. The
whole module was run on vLLM for CPU by hand (docs/differential.md has the result).
"""

from __future__ import annotations

import pytest

MODULE = r"""
from __future__ import annotations

import pytest

from pytest_pdserve import session_engine
from pytest_pdserve.assertions import assert_deterministic, assert_kv_transferred, assert_transfer_shrinks
from pytest_pdserve.errors import ClusterSpecError, VllmRefuses
from pytest_pdserve.metrics import MetricsDelta, MetricsSnapshot, wait_settled
from pytest_pdserve.prompts import prompt_with_tokens
from pytest_pdserve.spec import ClusterSpec

ENGINE = session_engine()  # known before any cluster starts: usable in skipif
ON_CPU = ENGINE.platform == "cpu"
NIXL_CHILD = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
OFFLOAD_CHILD = {
    "kv_connector": "OffloadingConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 28},
}


def _release() -> tuple[int, int]:
    major, minor = (ENGINE.vllm_version or "0.0").split(".")[:2]
    return int(major), int(minor)


# ------------------------------------------------------------------ before any cluster: refused in vLLM's words


def test_the_engine_is_known_before_any_cluster(pd_engine):
    assert pd_engine == ENGINE
    assert pd_engine.name in ("sim", "vllm")
    assert pd_engine.platform in ("cpu", "cuda", "rocm")
    assert pd_engine.vllm_version is not None


def test_refused_a_multiconnector_child_without_kv_role():
    with pytest.raises(ClusterSpecError, match="Please specify kv_role when kv_connector is set"):
        ClusterSpec(kv_connector="MultiConnector", kv_connector_extra_config={"connectors": [{"kv_connector": "X"}]})


@pytest.mark.skipif(not ON_CPU, reason="the OffloadingConnector's CPU tier runs on GPU platforms")
def test_refused_an_offloading_connector_on_the_cpu_platform(pd_cluster_factory):
    spec = ClusterSpec(name="offload", kv_connector="MultiConnector",
                       kv_connector_extra_config={"connectors": [NIXL_CHILD, OFFLOAD_CHILD]})  # fmt: skip
    with pytest.raises(VllmRefuses, match="CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"):
        pd_cluster_factory(spec)


@pytest.mark.skipif(not ON_CPU, reason="GPU backends take NHD")
def test_refused_the_nhd_layout_on_the_cpu_platform(pd_cluster_factory):
    with pytest.raises(VllmRefuses, match=r"VLLM_KV_CACHE_LAYOUT=NHD does not satisfy every supported set"):
        pd_cluster_factory(ClusterSpec(name="nhd", env={"VLLM_KV_CACHE_LAYOUT": "NHD"}))


@pytest.mark.skipif(_release() < (0, 32), reason="vLLM before 0.32 takes --mamba-cache-mode all")
def test_refused_mamba_cache_mode_all_from_vllm_032(pd_cluster_factory):
    with pytest.raises(VllmRefuses, match="invalid choice: 'all'"):
        pd_cluster_factory(ClusterSpec.hybrid_ssm(name="mamba-all", mamba_cache_mode="all"))


# ------------------------------------------------------------------ clusters that run


def request(cluster, tokens, seed):
    return {"prompt": prompt_with_tokens(cluster, tokens, seed=seed), "max_tokens": 4, "seed": 42}


def test_metrics_api(pd_cluster):
    decode = pd_cluster.decode[0]
    before = decode.metrics()
    assert isinstance(before, MetricsSnapshot)
    pd_cluster.complete(request(pd_cluster, 300, 1)["prompt"], max_tokens=2)
    after = wait_settled(decode.metrics)
    delta = after - before
    assert isinstance(delta, MetricsDelta)
    assert delta.prompt_tokens_by_source("external_kv_transfer") > 0
    assert delta.nixl_bytes_transferred() > 0
    assert delta.prefix_cache_queries() > 0
    assert after.block_size() == pd_cluster.block_size
    assert set(pd_cluster.metrics()) == {"prefill-0", "decode-0"}


def test_a_multiconnector_of_nixl_transfers(pd_cluster_factory):
    cluster = pd_cluster_factory(ClusterSpec(name="multi", kv_connector="MultiConnector",
                                             kv_connector_extra_config={"connectors": [NIXL_CHILD]}))  # fmt: skip
    assert_kv_transferred(cluster, request(cluster, 300, 2))


@pytest.mark.skipif(ON_CPU, reason="the OffloadingConnector's CPU tier does not run on the CPU platform")
def test_a_multiconnector_with_offloading_transfers(pd_cluster_factory):
    cluster = pd_cluster_factory(ClusterSpec(name="multi-offload", kv_connector="MultiConnector",
                                             kv_connector_extra_config={"connectors": [NIXL_CHILD, OFFLOAD_CHILD]}))
    assert_kv_transferred(cluster, request(cluster, 300, 3))


@pytest.fixture(scope="module")
def hybrid(pd_cluster_factory):
    return pd_cluster_factory(ClusterSpec.hybrid_ssm())


def test_hybrid_short_prompt_transfers_and_repeats(hybrid):
    req = request(hybrid, 40, 4)  # under one block: runs on vLLM for CPU too
    assert_kv_transferred(hybrid, req)
    assert_deterministic(hybrid, req)


def test_hybrid_runs_hnd_as_lbhnc_and_says_so(hybrid):
    if _release() >= (0, 32):  # the 5D layouts: HND is an alias
        assert any("VLLM_KV_CACHE_LAYOUT HND runs as LBHNC" in note for note in hybrid.notes), hybrid.notes
        assert "VLLM_KV_CACHE_LAYOUT HND runs as LBHNC" in hybrid.describe()


@pytest.mark.skipif(ON_CPU, reason="vLLM for CPU's Mamba kernel dies on a prefill of more than one block")
def test_hybrid_long_prompt_prefix_cache(hybrid):
    req = request(hybrid, 1200, 5)
    assert_transfer_shrinks(hybrid, req)
    assert_deterministic(hybrid, req)


def test_two_prefills_one_decode_with_its_own_max_model_len(pd_cluster_factory):
    # The session gives --max-model-len 2048 in VLLM_SERVE_EXTRA_ARGS; this cluster's own value wins, and says so.
    cluster = pd_cluster_factory(ClusterSpec(name="2p1d", num_prefill=2, max_model_len=1024))
    assert len(cluster.prefill) == 2
    for server in (*cluster.prefill, *cluster.decode):
        assert server.client.get("/v1/models").json()["data"][0]["max_model_len"] == 1024
    assert "--max-model-len: 1024 from ClusterSpec.max_model_len overrides '--max-model-len 2048'" in cluster.describe()
    for i in range(4):  # round robin over both prefills
        assert_kv_transferred(cluster, request(cluster, 300, 10 + i))
"""

#: The refusals and the session engine: no server starts (what the real-vLLM tier runs).
NO_START = "refused or engine_is_known"


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str) -> pytest.RunResult:
    monkeypatch.setenv("VLLM_SERVE_EXTRA_ARGS", "--max-model-len,2048")
    pytester.makepyfile(test_from_the_readme=MODULE)
    dirs = (f"--pd-lease-dir={pytester.path / 'leases'}", f"--pd-log-dir={pytester.path / 'logs'}")
    return pytester.runpytest_subprocess(*dirs, "-p", "no:cacheprovider", "-rs", *args, timeout=1500)


def test_the_readme_module_passes_on_the_simulator(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run(pytester, monkeypatch, "--pd-engine=sim")
    # On the CPU platform: the offloading and long-hybrid cases skip, as on vLLM for CPU.
    result.assert_outcomes(passed=10, skipped=2)
    result.stdout.fnmatch_lines(["*SKIPPED*the OffloadingConnector's CPU tier does not run on the CPU platform*"])


def test_the_readme_modules_refusals_on_the_simulators_gpu_platform(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a simulated GPU the CPU platform's refusals do not apply: those tests skip, and the offloading case runs."""
    result = _run(pytester, monkeypatch, "--pd-engine=sim", "--pd-simulate-gpus=cuda:2", "-k",
                  f"{NO_START} or offloading_transfers")  # fmt: skip
    result.assert_outcomes(passed=4, skipped=2)


def test_the_readme_modules_refusals_on_real_vllm(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, real_vllm: str
) -> None:
    """The same refusals on vLLM for CPU: decided before any start, so no real server starts."""
    result = _run(pytester, monkeypatch, "--pd-engine=vllm", f"--pd-vllm-executable={real_vllm}", "-k", NO_START)
    result.assert_outcomes(passed=5)
    assert "pdserve: starting" not in result.stdout.str()  # no progress line: nothing started
