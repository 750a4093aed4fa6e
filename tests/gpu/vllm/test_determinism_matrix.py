"""Determinism of real vLLM through P/D, per attention backend: the GPU proof's matrix (docs/hardware.md).

Run by ``scripts/gpu-proof.sh --engine=vllm`` once per backend (``ATTENTION_BACKEND=FLASH_ATTN``, then
``TRITON_ATTN``) on one GPU (``--pd-share-gpus``). Each test is one cell: repeat, P/D against a single server,
cold against warm prefix cache, and batch sizes 1 / 4 / 16. A cell that fails says where the outputs diverged
and whether it was a tie flip or a confident flip; that verdict is what the record keeps.

Skipped unless the session runs real vLLM on a GPU: on the simulator every cell is deterministic by
construction, which would prove nothing here (tests/test_assertions.py covers the checks themselves).
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_pdserve.assertions import (
    assert_batch_invariant,
    assert_cold_warm_match,
    assert_deterministic,
    assert_pd_matches_single,
)
from pytest_pdserve.prompts import prompt_with_tokens


@pytest.fixture(scope="module")
def cluster(pd_cluster: Any) -> Any:
    if pd_cluster.engine != "vllm" or pd_cluster.platform not in ("cuda", "rocm"):
        pytest.skip(f"the determinism matrix is for real vLLM on a GPU; this cluster is "
                    f"{pd_cluster.engine} on {pd_cluster.platform}")  # fmt: skip
    return pd_cluster


def body(cluster: Any, tokens: int, seed: int) -> dict[str, Any]:
    return {"prompt": prompt_with_tokens(cluster, tokens, seed=seed), "max_tokens": 32}


def test_repeat(cluster: Any) -> None:
    assert_deterministic(cluster, body(cluster, 300, 1), repeats=3)


def test_pd_matches_single(cluster: Any) -> None:
    assert_pd_matches_single(cluster, body(cluster, 300, 2))


def test_cold_matches_warm(cluster: Any) -> None:
    assert_cold_warm_match(cluster, body(cluster, 400, 3))


def test_batch_sizes(cluster: Any) -> None:
    fillers = [body(cluster, 250 + 10 * i, 100 + i) for i in range(15)]
    assert_batch_invariant(cluster, body(cluster, 300, 4), fillers, batch_sizes=(1, 4, 16))
