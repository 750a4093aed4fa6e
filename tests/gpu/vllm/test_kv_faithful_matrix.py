"""The break matrix of docs/faithful-kv.md on real vLLM on a GPU, per attention backend: the GPU column.

Run by ``scripts/gpu-proof.sh --engine=vllm`` (suite ``faithful``) once per backend (``ATTENTION_BACKEND=FLASH_ATTN``,
``TRITON_ATTN``, ``FLASHINFER``) on one GPU (``--pd-share-gpus``). The cells are tests/assertions/test_kv_faithful.py's:
a correct cluster passes `assert_kv_faithful` (its measured P/D-against-direct distance is printed: the GPU tolerance in
docs/faithful-kv.md comes from these lines), and every way P/D can hand decode the wrong KV fails it, or the cluster
does not start.

Skipped unless the session runs real vLLM on a GPU (the simulator and vLLM for CPU run the matrix in
tests/assertions/test_kv_faithful.py).
"""

from __future__ import annotations

from typing import Any

import pytest
from assertions.test_kv_faithful import BAD_HYBRID, BAD_LLAMA, NOT_STARTED, _by_hand, _gone, _swap_first_block

from pytest_pdserve.assertions import CONFIDENT_FLIP, assert_kv_faithful, assert_pd_matches_single
from pytest_pdserve.prompts import prompt_with_tokens
from pytest_pdserve.spec import ClusterSpec

#: Like every proof under tests/gpu: skipped with the plugin's own reason where there is no CUDA GPU.
pytestmark = pytest.mark.cuda

KV_MISMATCH = "decode did not compute with the right KV"


def _on_gpu(cluster: Any) -> Any:
    if cluster.engine != "vllm" or cluster.platform not in ("cuda", "rocm"):
        pytest.skip(f"the GPU column is real vLLM on a GPU; this cluster is {cluster.engine} on {cluster.platform}")
    return cluster


@pytest.fixture(scope="module")
def cluster(pd_cluster: Any) -> Any:
    return _on_gpu(pd_cluster)


def _get(factory: Any, spec: ClusterSpec) -> Any:
    return _on_gpu(factory(spec))


def body(cluster: Any, tokens: int, seed: int) -> dict[str, Any]:
    return {"prompt": prompt_with_tokens(cluster, tokens, seed=seed), "max_tokens": 8}


def _report(cluster: Any, name: str, result: Any) -> None:
    print(f"\nfaithful-kv {name}: backend={cluster.attention_backend} distance={result.distance:.3g} "
          f"tolerance={result.tolerance} context_effect={result.context_effect:.3g} split={result.split}")  # fmt: skip


def test_a_correct_cluster_passes(cluster: Any) -> None:
    for seed, tokens in ((1, 300), (2, 600), (3, 129)):
        _report(cluster, f"llama {tokens} tokens", assert_kv_faithful(cluster, body(cluster, tokens, seed)))


def test_blocks_of_another_prompt_fail(cluster: Any) -> None:
    route, release = _swap_first_block(cluster)
    try:
        with pytest.raises(AssertionError, match=KV_MISMATCH):
            assert_kv_faithful(cluster, body(cluster, 300, 4), route=route)
    finally:
        release()


@pytest.fixture(scope="module")
def bad_llama(pd_cluster_factory: Any) -> Any:
    return _get(pd_cluster_factory, ClusterSpec(prefill_extra_args=BAD_LLAMA, kv_load_failure_policy="recompute",
                                                name="bad-llama"))  # fmt: skip


def test_prefill_serving_other_weights_fails(bad_llama: Any) -> None:
    with pytest.raises(AssertionError, match=KV_MISMATCH):
        assert_kv_faithful(bad_llama, body(bad_llama, 300, 5))
    with pytest.raises(AssertionError) as info:
        assert_pd_matches_single(bad_llama, body(bad_llama, 300, 6), single=bad_llama.decode[0])
    assert f"verdict: {CONFIDENT_FLIP}" in str(info.value)


def test_a_failed_pull_recomputed_fails_as_not_transferred(bad_llama: Any) -> None:
    with pytest.raises(AssertionError, match="KV not transferred: decode loaded 0 of the"):
        assert_kv_faithful(bad_llama, body(bad_llama, 300, 7), route=_by_hand(bad_llama, _gone))


@pytest.fixture(scope="module")
def hybrid(pd_cluster_factory: Any) -> Any:
    return _get(pd_cluster_factory, ClusterSpec.hybrid_ssm(name="faithful-hybrid"))


def test_a_correct_hybrid_cluster_passes(hybrid: Any) -> None:
    for seed, tokens in ((10, 300), (11, 40)):
        _report(hybrid, f"hybrid {tokens} tokens", assert_kv_faithful(hybrid, body(hybrid, tokens, seed)))


def test_hybrid_prefill_serving_other_weights_fails(pd_cluster_factory: Any) -> None:
    bad = _get(pd_cluster_factory, ClusterSpec.hybrid_ssm(prefill_extra_args=BAD_HYBRID, name="bad-hybrid"))
    with pytest.raises(AssertionError, match=KV_MISMATCH):
        assert_kv_faithful(bad, body(bad, 300, 12))


@pytest.mark.parametrize(
    "spec",
    [
        ClusterSpec(prefill_env=(("VLLM_KV_CACHE_LAYOUT", "NHD"),), name="layout-mismatch"),
        ClusterSpec.hybrid_ssm(prefill_env={"VLLM_SSM_CONV_STATE_LAYOUT": "SD"}, name="conv-mismatch"),
    ],
    ids=["kv-cache-layout", "conv-state-layout"],
)
def test_a_layout_set_on_one_side_does_not_start(pd_cluster_factory: Any, spec: ClusterSpec) -> None:
    """On a GPU both KV layouts may start, and then the NIXL handshake refuses the pair (no request moves KV: the
    start's round trip fails); a backend without LBNHC refuses NHD at start; a hybrid without DS is refused at start."""
    with pytest.raises(NOT_STARTED):
        pd_cluster_factory(spec)
