"""Port of vLLM's tests/v1/kv_connector/nixl_integration/test_edge_cases.py onto pd_cluster.

vLLM's version needs run_edge_case_test.sh to start the servers on fixed GPUs 4/5 and ports 8001/8002/8192.
Here the plugin leases GPUs and ports, and each comparison is one assertion that explains a mismatch.
"""

from __future__ import annotations

from _prompts import make_prompt

from pytest_pdserve.assertions import assert_pd_matches_single

SHORT_PROMPT = "Red Hat is "  # fewer tokens than one KV block
PROMPT = make_prompt(300, seed=10)
LONG_PROMPT = PROMPT + " " + make_prompt(200, seed=11)  # extends PROMPT: a partial hit on D


def test_short_prompt_below_block_size(pd_cluster):
    # (1) proxy == prefill-direct for a prompt shorter than a block.
    assert_pd_matches_single(pd_cluster, {"prompt": SHORT_PROMPT, "max_tokens": 16})


def test_full_prefix_hit_on_decode(pd_cluster):
    # (2) Prime D directly with PROMPT, then the proxy (P/D) must equal decode-direct.
    decode = pd_cluster.decode[0]
    decode.client.post(
        "/v1/completions", json={"model": pd_cluster.model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    ).raise_for_status()
    assert_pd_matches_single(pd_cluster, {"prompt": PROMPT, "max_tokens": 16}, single=decode)


def test_partial_prefix_hit_on_decode(pd_cluster):
    # (3) LONG_PROMPT extends PROMPT (cached on D by the previous test or primed here): proxy == prefill-direct.
    pd_cluster.decode[0].client.post(
        "/v1/completions", json={"model": pd_cluster.model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    ).raise_for_status()
    assert_pd_matches_single(pd_cluster, {"prompt": LONG_PROMPT, "max_tokens": 16})
