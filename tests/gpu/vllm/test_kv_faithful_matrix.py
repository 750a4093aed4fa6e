"""The break matrix of docs/faithful-kv.md on real vLLM on a GPU, per attention backend: the GPU column.

Run by ``scripts/gpu-proof.sh --engine=vllm`` (suite ``faithful``) once per backend (``ATTENTION_BACKEND=FLASH_ATTN``,
``TRITON_ATTN``, ``FLASHINFER``) on one GPU (``--pd-share-gpus``). The cells are tests/assertions/test_kv_faithful.py's:
a correct cluster passes `assert_kv_faithful` (its measured P/D-against-direct distance is printed: the GPU tolerance in
docs/faithful-kv.md comes from these lines), and every way P/D can hand decode the wrong KV fails it, or the cluster
does not start. With ``$PDSERVE_GPU_PROOF_DIR`` set, every cell appends JSON lines to ``evidence.jsonl`` there: each
correct comparison's distance (centered, as the check compares) and largest raw first-token logprob difference, and
each negative control's verdict with the distance its failure named, so the tolerance can be judged against both.

Skipped unless the session runs real vLLM on a GPU (the simulator and vLLM for CPU run the matrix in
tests/assertions/test_kv_faithful.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
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


def _record(**row: Any) -> None:
    """One line of ``$PDSERVE_GPU_PROOF_DIR/evidence.jsonl`` (when set)."""
    proof_dir = os.environ.get("PDSERVE_GPU_PROOF_DIR")
    if proof_dir:
        Path(proof_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(proof_dir) / "evidence.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"matrix": "faithful-kv", **row}) + "\n")


def _raw_max_diff(result: Any) -> float:
    """The largest |P/D - direct| first-token logprob over the tokens both top-k lists hold (not centered)."""
    pd, direct = result.pd.top_logprobs[0], result.direct.top_logprobs[0]
    common = pd.keys() & direct.keys()
    return max((abs(pd[t] - direct[t]) for t in common), default=math.inf)


def _report(cluster: Any, model: str, tokens: int, result: Any) -> None:
    raw = _raw_max_diff(result)
    print(f"\nfaithful-kv {model} {tokens} tokens: backend={cluster.attention_backend} distance={result.distance:.3g} "
          f"raw_max_abs={raw:.3g} tolerance={result.tolerance} context_effect={result.context_effect:.3g} "
          f"split={result.split}")  # fmt: skip
    _record(backend=cluster.attention_backend, model=model, cell="correct", tokens=tokens,
            prompt_tokens=result.prompt_tokens, distance=result.distance, raw_max_abs=raw,
            tolerance=result.tolerance, context_effect=result.context_effect, split=result.split,
            same_tokens=result.pd.token_ids == result.direct.token_ids,
            transferred=result.transferred_tokens)  # fmt: skip


@contextlib.contextmanager
def caught(cluster: Any, model: str, cell: str, match: str) -> Iterator[None]:
    """The cell must fail the check with *match*; its verdict and the distance its message names are recorded."""
    with pytest.raises(AssertionError, match=match) as info:
        yield
    message = str(info.value)
    named = re.search(r"by (.+?) over the top", message)
    _record(backend=cluster.attention_backend, model=model, cell=cell, verdict="caught",
            distance=named.group(1) if named else None, message=message.strip().splitlines()[0][:300])  # fmt: skip


def _measure_all(cluster: Any, model: str, cases: Any, **kwargs: Any) -> None:
    """Every case is checked and recorded before the cell fails, so one prompt over the tolerance still leaves the
    others' distances (the measurement the tolerance is set from)."""
    failed = []
    for seed, tokens in cases:
        try:
            _report(cluster, model, tokens, assert_kv_faithful(cluster, body(cluster, tokens, seed), **kwargs))
        except AssertionError as exc:
            named = re.search(r"by (.+?) over the top", str(exc))
            _record(backend=cluster.attention_backend, model=model, cell="correct", tokens=tokens, verdict="failed",
                    distance=named.group(1) if named else None, message=str(exc).strip().splitlines()[0][:300],
                    **kwargs)  # fmt: skip
            failed.append(f"{tokens} tokens: {str(exc).strip().splitlines()[0]}")
    assert not failed, "\n".join(failed)


def test_a_correct_cluster_passes(cluster: Any) -> None:
    _measure_all(cluster, "llama", ((1, 300), (2, 600), (3, 129), (4, 257), (5, 385), (6, 513), (7, 1025), (8, 200)))
    # The cold split (the direct serve computes the whole prompt at once): how much the split itself moves the numbers.
    _measure_all(cluster, "llama", ((1, 300), (2, 600)), split="cold")


def test_blocks_of_another_prompt_fail(cluster: Any) -> None:
    route, release = _swap_first_block(cluster)
    try:
        with caught(cluster, "llama", "blocks of another prompt", KV_MISMATCH):
            assert_kv_faithful(cluster, body(cluster, 300, 4), route=route)
    finally:
        release()


@pytest.fixture(scope="module")
def bad_llama(pd_cluster_factory: Any) -> Any:
    return _get(pd_cluster_factory, ClusterSpec(prefill_extra_args=BAD_LLAMA, kv_load_failure_policy="recompute",
                                                name="bad-llama"))  # fmt: skip


def test_prefill_serving_other_weights_fails(bad_llama: Any) -> None:
    with caught(bad_llama, "llama", "prefill serves other weights", KV_MISMATCH):
        assert_kv_faithful(bad_llama, body(bad_llama, 300, 5))
    with caught(bad_llama, "llama", "prefill serves other weights (129 tokens)", KV_MISMATCH):
        assert_kv_faithful(bad_llama, body(bad_llama, 129, 8))
    with pytest.raises(AssertionError) as info:
        assert_pd_matches_single(bad_llama, body(bad_llama, 300, 6), single=bad_llama.decode[0])
    assert f"verdict: {CONFIDENT_FLIP}" in str(info.value)


def test_a_failed_pull_recomputed_fails_as_not_transferred(bad_llama: Any) -> None:
    with caught(bad_llama, "llama", "a failed pull recomputed", "KV not transferred: decode loaded 0 of the"):
        assert_kv_faithful(bad_llama, body(bad_llama, 300, 7), route=_by_hand(bad_llama, _gone))


@pytest.fixture(scope="module")
def hybrid(pd_cluster_factory: Any) -> Any:
    return _get(pd_cluster_factory, ClusterSpec.hybrid_ssm(name="faithful-hybrid"))


def test_a_correct_hybrid_cluster_passes(hybrid: Any) -> None:
    _measure_all(hybrid, "hybrid", ((10, 300), (11, 40), (12, 129), (13, 600), (14, 257)))


def test_hybrid_prefill_serving_other_weights_fails(pd_cluster_factory: Any) -> None:
    bad = _get(pd_cluster_factory, ClusterSpec.hybrid_ssm(prefill_extra_args=BAD_HYBRID, name="bad-hybrid"))
    with caught(bad, "hybrid", "prefill serves other weights", KV_MISMATCH):
        assert_kv_faithful(bad, body(bad, 300, 12))
    with caught(bad, "hybrid", "prefill serves other weights (129 tokens)", KV_MISMATCH):
        assert_kv_faithful(bad, body(bad, 129, 13))


@pytest.mark.parametrize(
    "spec",
    [
        ClusterSpec.hybrid_ssm(prefill_env={"VLLM_SSM_CONV_STATE_LAYOUT": "SD"}, name="conv-mismatch"),
        ClusterSpec(prefill_env=(("VLLM_KV_CACHE_LAYOUT", "NHD"),), name="layout-mismatch"),
    ],
    ids=["conv-state-layout", "kv-cache-layout"],  # the refusal before a start first; the other costs a start
)
def test_a_layout_set_on_one_side_does_not_start(pd_cluster_factory: Any, spec: ClusterSpec) -> None:
    """On a GPU both KV layouts may start, and then the NIXL handshake refuses the pair (no request moves KV: the
    start's round trip fails); a backend without LBNHC refuses NHD at start; a hybrid without DS is refused at start."""
    with pytest.raises(NOT_STARTED) as info:
        pd_cluster_factory(spec)
    _record(backend=os.environ.get("ATTENTION_BACKEND"), model=spec.model_kind, cell=f"{spec.name}: one side's layout",
            verdict="refused", message=str(info.value).strip().splitlines()[0][:300])  # fmt: skip
