"""What a user sees when each assertion fails: real pytest sessions against real simulator clusters.

The simulator's switches make each check fail for a real reason: FLASH_ATTN is not batch-invariant (warm-cache
runs differ), a decode server whose KV pulls fail (recompute policy: the request succeeds without a transfer),
and a decode server without prefix caching (nothing to hit, nothing shrinks).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

#: FLASH_ATTN exists on GPU platforms only (on the CPU platform it is refused before the start, as vLLM for CPU
#: would run CPU_ATTN): the inner session simulates two CUDA GPUs.
GPU_PLATFORM = "--pd-simulate-gpus=cuda:2"

INNER = """
import pytest
from pytest_pdserve.assertions import *
from pytest_pdserve.prompts import prompt_with_tokens
from pytest_pdserve.spec import ClusterSpec

#: Batch variance is a simulator fault asked for (vLLM's FLASH_ATTN was deterministic on the H200 for the tiny model).
FLAKY = ClusterSpec(
    attention_backend="FLASH_ATTN", env=(("PDSERVE_SIM_NONDETERMINISTIC_BACKENDS", "FLASH_ATTN"),), name="flash"
)
NO_PULL = ClusterSpec(kv_load_failure_policy="recompute", decode_env={"PDSERVE_SIM_FAIL_KV_PULL": "1"}, name="nopull")
NO_CACHE = ClusterSpec(decode_extra_args=("--no-enable-prefix-caching",), name="nocache")
BLOCK_128 = ClusterSpec(block_size=128, name="b128")


def request(cluster, tokens=400, seed=0):
    return {"prompt": prompt_with_tokens(cluster, tokens, seed=seed), "max_tokens": 12}


def test_deterministic_fails(pd_cluster_factory):
    c = pd_cluster_factory(FLAKY)
    assert_deterministic(c, request(c, seed=1))


def test_cold_warm_fails(pd_cluster_factory):
    c = pd_cluster_factory(FLAKY)
    assert_cold_warm_match(c, request(c, seed=2))


def test_kv_transferred_fails(pd_cluster_factory):
    c = pd_cluster_factory(NO_PULL)
    assert_kv_transferred(c, request(c, seed=3))


def test_transfer_shrinks_fails(pd_cluster_factory):
    c = pd_cluster_factory(NO_CACHE)
    assert_transfer_shrinks(c, request(c, seed=4))


def test_prefix_cache_hit_fails(pd_cluster_factory):
    c = pd_cluster_factory(NO_CACHE)
    assert_prefix_cache_hit(c.decode[0], request(c, seed=5), prime=True)


def test_prompt_sources_fail(pd_cluster_factory):
    c = pd_cluster_factory(NO_CACHE)
    assert_prompt_token_sources(c, expect="full_hit", request=request(c, seed=6))


def test_vacuous_full_hit_fails(pd_cluster_factory):
    c = pd_cluster_factory(BLOCK_128)
    short = {"prompt": prompt_with_tokens(c, 37, seed=7), "max_tokens": 4}
    assert_prompt_token_sources(c, expect="full_hit", request=short)


def test_deterministic_passes_on_triton(pd_cluster_factory):
    c = pd_cluster_factory(ClusterSpec(attention_backend="TRITON_ATTN", name="triton"))
    assert_deterministic(c, request(c, seed=1))
    assert_cold_warm_match(c, request(c, seed=2))
"""


@pytest.fixture(scope="module")
def failures(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One inner pytest session for the whole module (as a user runs it); each case reads its part."""
    root = tmp_path_factory.mktemp("inner")
    (root / "test_inner.py").write_text(INNER)
    (root / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_") and k != "ATTENTION_BACKEND"}
    proc = subprocess.run(
        # Clusters broken on purpose: the start-up P/D round trip would refuse NO_PULL before its assertion runs.
        [sys.executable, "-m", "pytest", "--pd-engine=sim", f"--pd-lease-dir={root / 'leases'}", "-rfE",
         "--no-pd-ready-check", GPU_PLATFORM],
        cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    return proc.stdout + proc.stderr


def _section(text: str, test: str) -> str:
    start = text.index(f"_ {test} _")
    end = text.find("\n___", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_outcomes(failures: str) -> None:
    assert "7 failed, 1 passed" in failures, failures[-3000:]


def test_determinism_failure_shows_divergence_backend_and_hint(failures: str) -> None:
    text = _section(failures, "test_deterministic_fails")
    assert "outputs differ at token" in text
    assert "FLASH_ATTN" in text
    assert "hint: FLASH_ATTN is not batch-invariant on Hopper" in text
    assert "pdserve decode-0 log" in text  # the servers' lines from this test travel with the failure


def test_cold_warm_failure(failures: str) -> None:
    text = _section(failures, "test_cold_warm_fails")
    assert "outputs differ at token" in text
    assert "VLLM_BATCH_INVARIANT=1" in text


def test_kv_transfer_failure_says_the_request_did_not_go_through_pd(failures: str) -> None:
    text = _section(failures, "test_kv_transferred_fails")
    assert "no KV transfer: the request did not go through P/D" in text
    assert "vllm:nixl_bytes_transferred_sum" in text  # the table: metric | before | after | delta | expected


def test_transfer_shrink_failure(failures: str) -> None:
    text = _section(failures, "test_transfer_shrinks_fails")
    assert "not fewer than the first" in text


def test_prefix_cache_failure_is_reported_as_vacuous(failures: str) -> None:
    text = _section(failures, "test_prefix_cache_hit_fails")
    assert "prefix-cache" in text
    assert "vacuous" in text or "no prefix-cache hit" in text


def test_prompt_sources_failure_shows_the_arithmetic(failures: str) -> None:
    text = _section(failures, "test_prompt_sources_fail")
    assert "prompt token sources do not match expect='full_hit'" in text
    assert "local_cache_hit" in text


def test_vacuous_full_hit_fails_naming_its_precondition(failures: str) -> None:
    """Issue 14: a 37-token prompt at block 128 "passed" full_hit with no hit at all."""
    text = _section(failures, "test_vacuous_full_hit_fails")
    assert "precondition not met: expect='full_hit' needs a prompt longer than one block" in text
    assert "it has 37 tokens and block_size=128" in text


@pytest.mark.parametrize(
    "test", ["test_deterministic_fails", "test_kv_transferred_fails", "test_vacuous_full_hit_fails"]
)
def test_failures_show_the_message_not_plugin_source(failures: str, test: str) -> None:
    """``__tracebackhide__``: the traceback stops at the test's own line; no plugin frames or source."""
    text = _section(failures, test).split("- Captured", 1)[0].split("pdserve decode-0 log", 1)[0]
    assert "pytest_pdserve/" not in text, text
    assert "__tracebackhide__" not in text, text
    assert "def assert_" not in text, text
    assert text.count("\nE ") >= 1, text


def test_no_internal_errors(failures: str) -> None:
    assert "INTERNALERROR" not in failures
