"""Determinism of real vLLM through P/D, per attention backend and model: the GPU proof's matrix (docs/hardware.md).

Run by ``scripts/gpu-proof.sh --engine=vllm`` once per backend (``ATTENTION_BACKEND=FLASHINFER``, ``FLASH_ATTN``,
``TRITON_ATTN``) on one GPU (``--pd-share-gpus``), for the tiny Llama and the tiny hybrid (NemotronH, set up as
vLLM's run_mamba_prefix_cache_test.sh sets it up). Each test is one cell: repeat, P/D against a single server,
cold against warm prefix cache, and batch sizes 1 / 4 / 16. A cell that fails says where the outputs diverged
and whether it was a tie flip or a confident flip; that verdict is what the record keeps. With
``$PDSERVE_GPU_PROOF_DIR`` set, every cell also appends one JSON line (backend, model, cell, verdict, the first
lines of a failure) to ``evidence.jsonl`` there, so a run's matrix can be read without its logs.

Skipped unless the session runs real vLLM on a GPU: on the simulator every cell is deterministic by
construction, which would prove nothing here (tests/assertions/test_assertions.py covers the checks themselves).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_pdserve.assertions import (
    assert_batch_invariant,
    assert_cold_warm_match,
    assert_deterministic,
    assert_pd_matches_single,
)
from pytest_pdserve.prompts import prompt_with_tokens
from pytest_pdserve.spec import ClusterSpec

#: Like every proof under tests/gpu: skipped with the plugin's own reason where there is no CUDA GPU, before a
#: cluster starts.
pytestmark = pytest.mark.cuda

#: The two tiny models. The hybrid is set up as vLLM 0.26's mamba script sets it up (``--mamba-cache-mode all``,
#: which the command builder maps for the versions that renamed or dropped it): the configuration whose P/D
#: determinism made that script pick FLASHINFER on Hopper.
MODELS: dict[str, Callable[[], ClusterSpec]] = {
    "llama": lambda: ClusterSpec(name="determinism-llama"),
    "hybrid": lambda: ClusterSpec.hybrid_ssm(name="determinism-hybrid", mamba_cache_mode="all"),
}


@pytest.fixture(scope="module", params=list(MODELS))
def cluster(request: pytest.FixtureRequest, pd_cluster_factory: Any) -> Any:
    started = pd_cluster_factory(MODELS[request.param]())
    if started.engine != "vllm" or started.platform not in ("cuda", "rocm"):
        pytest.skip(f"the determinism matrix is for real vLLM on a GPU; this cluster is "
                    f"{started.engine} on {started.platform}")  # fmt: skip
    return started


@contextlib.contextmanager
def verdict(request: pytest.FixtureRequest, cluster: Any) -> Iterator[None]:
    """Append this cell's verdict to ``$PDSERVE_GPU_PROOF_DIR/evidence.jsonl`` (when set), pass or fail."""
    t0 = time.monotonic()
    outcome: dict[str, Any] = {"verdict": "passed"}
    try:
        yield
    except BaseException as exc:
        outcome = {"verdict": "failed", "detail": str(exc).strip().splitlines()[:12]}
        raise
    finally:
        proof_dir = os.environ.get("PDSERVE_GPU_PROOF_DIR")
        if proof_dir:
            row = {
                "test": request.node.nodeid, "matrix": "determinism", "backend": cluster.attention_backend,
                "model": request.node.callspec.params["cluster"], "cell": request.node.originalname,
                "block_size": cluster.block_size, "seconds": round(time.monotonic() - t0, 2), **outcome,
            }  # fmt: skip
            Path(proof_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(proof_dir) / "evidence.jsonl", "a", encoding="utf-8") as fh:
                fh.write(json.dumps(row) + "\n")


def body(cluster: Any, tokens: int, seed: int) -> dict[str, Any]:
    return {"prompt": prompt_with_tokens(cluster, tokens, seed=seed), "max_tokens": 32}


def test_repeat(request: pytest.FixtureRequest, cluster: Any) -> None:
    with verdict(request, cluster):
        assert_deterministic(cluster, body(cluster, 300, 1), repeats=3)


def test_pd_matches_single(request: pytest.FixtureRequest, cluster: Any) -> None:
    with verdict(request, cluster):
        assert_pd_matches_single(cluster, body(cluster, 300, 2))


def test_cold_matches_warm(request: pytest.FixtureRequest, cluster: Any) -> None:
    with verdict(request, cluster):
        assert_cold_warm_match(cluster, body(cluster, 400, 3))


def test_batch_sizes(request: pytest.FixtureRequest, cluster: Any) -> None:
    fillers = [body(cluster, 250 + 10 * i, 100 + i) for i in range(15)]
    with verdict(request, cluster):
        assert_batch_invariant(cluster, body(cluster, 300, 4), fillers, batch_sizes=(1, 4, 16))
