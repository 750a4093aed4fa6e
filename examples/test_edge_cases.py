"""Port of vLLM's tests/v1/kv_connector/nixl_integration/test_edge_cases.py onto pd_cluster.

vLLM's version needs run_edge_case_test.sh to start the servers on fixed GPUs 4/5 and ports 8001/8002/8192.
Here the plugin leases GPUs and ports, and each comparison is one assertion that explains a mismatch.
"""

from __future__ import annotations

import pytest

from pytest_pdserve.assertions import assert_pd_matches_single
from pytest_pdserve.prompts import prompt_with_tokens

SHORT_PROMPT = "Red Hat is "  # fewer tokens than one KV block


@pytest.fixture(scope="module")
def prompt(pd_cluster):
    return prompt_with_tokens(pd_cluster, 300, seed=10)


def test_short_prompt_below_block_size(pd_cluster):
    # (1) proxy == prefill-direct for a prompt shorter than a block.
    assert_pd_matches_single(pd_cluster, {"prompt": SHORT_PROMPT, "max_tokens": 16})


def test_full_prefix_hit_on_decode(pd_cluster, prompt):
    # (2) Prime D directly with the prompt, then the proxy (P/D) must equal decode-direct.
    decode = pd_cluster.decode[0]
    decode.complete(prompt, max_tokens=16)  # this test's cache_salt: no other test shares the hit
    assert_pd_matches_single(pd_cluster, {"prompt": prompt, "max_tokens": 16}, single=decode)


def test_partial_prefix_hit_on_decode(pd_cluster, prompt):
    # (3) A longer prompt that extends the cached one (a partial hit on D): proxy == prefill-direct.
    pd_cluster.decode[0].complete(prompt, max_tokens=1)
    long_prompt = prompt_with_tokens(pd_cluster, 500, seed=11, prefix=prompt)
    assert_pd_matches_single(pd_cluster, {"prompt": long_prompt, "max_tokens": 16})
