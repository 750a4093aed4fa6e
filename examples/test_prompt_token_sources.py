"""The prompt_tokens_by_source arithmetic of vLLM's test_multi_connector_edge_cases.py, one assertion each.

On the decode server, per request: local_compute + local_cache_hit + external_kv_transfer == prompt tokens,
and which bucket gets what depends on the D-side prefix cache (vLLM can hit at most P-1 tokens, in whole blocks).
"""

from __future__ import annotations

import pytest

from pytest_pdserve.assertions import assert_kv_transferred, assert_prompt_token_sources
from pytest_pdserve.prompts import prompt_with_tokens


def test_cold_decode_pulls_every_prompt_token(pd_cluster):
    request = {"prompt": prompt_with_tokens(pd_cluster, 350, seed=20), "max_tokens": 4}
    assert_prompt_token_sources(pd_cluster, expect="cold_decode", request=request)


def test_full_hit_after_priming_decode(pd_cluster):
    request = {"prompt": prompt_with_tokens(pd_cluster, 350, seed=21), "max_tokens": 4}
    assert_prompt_token_sources(pd_cluster, expect="full_hit", request=request)


def test_partial_hit_after_priming_a_prefix(pd_cluster):
    prefix = prompt_with_tokens(pd_cluster, 300, seed=22)
    assert_prompt_token_sources(
        pd_cluster,
        expect="partial_hit",
        prime={"prompt": prefix, "max_tokens": 1},
        request={"prompt": prompt_with_tokens(pd_cluster, 450, seed=22, prefix=prefix), "max_tokens": 4},
    )


def test_direct_decode_computes_locally(pd_cluster):
    request = {"prompt": prompt_with_tokens(pd_cluster, 250, seed=24), "max_tokens": 4}
    assert_prompt_token_sources(pd_cluster, expect="direct_decode", request=request)


@pytest.mark.parametrize("tokens", [2, 127, 128, 130, 512])
def test_kv_moves_for_every_prompt_length(pd_cluster, tokens):
    # Guards against a silent fallback to local compute, as vLLM's version does with nixl bytes > 0.
    request = {"prompt": prompt_with_tokens(pd_cluster, tokens, seed=25 + tokens), "max_tokens": 4}
    assert_kv_transferred(pd_cluster, request)
