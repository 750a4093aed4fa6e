"""Determinism through P/D, the three ways vLLM's P/D tests check it (each request sequential, temperature 0).

Run on the simulator (the default without vLLM) or on real vLLM:  pytest examples --pd-engine=vllm
Prompts are sized in tokens of the served model (`prompt_with_tokens`), so block arithmetic is the same everywhere.
"""

from __future__ import annotations

import json

from pytest_pdserve.assertions import (
    assert_cold_warm_match,
    assert_deterministic,
    assert_kv_faithful,
    assert_pd_matches_single,
)
from pytest_pdserve.prompts import prompt_with_tokens, words


def test_same_request_twice(pd_cluster):
    assert_deterministic(pd_cluster, {"prompt": prompt_with_tokens(pd_cluster, 200, seed=2), "max_tokens": 16})


def test_pd_matches_single_instance(pd_cluster):
    # The first prefill server, asked directly, is a plain (non-disaggregated) vLLM instance.
    assert_pd_matches_single(pd_cluster, {"prompt": prompt_with_tokens(pd_cluster, 300, seed=3), "max_tokens": 16})


def test_decode_computed_with_the_right_kv(pd_cluster):
    # The first token's logprobs through P/D equal a direct serve's on the decode server: the KV decode received was
    # the KV it would have computed (not just some KV that moved); the prompt's changed beginning must show.
    assert_kv_faithful(pd_cluster, {"prompt": prompt_with_tokens(pd_cluster, 300, seed=7), "max_tokens": 8})


def test_cold_cache_matches_warm_cache(pd_cluster):
    assert_cold_warm_match(pd_cluster, {"prompt": prompt_with_tokens(pd_cluster, 400, seed=4), "max_tokens": 16})


def test_chat_completions_through_pd(pd_cluster):
    request = {"messages": [{"role": "user", "content": words(30, seed=5)}], "max_tokens": 12}
    assert_pd_matches_single(pd_cluster, request, endpoint="/v1/chat/completions")


def test_streaming_matches_non_streaming(pd_cluster):
    prompt = prompt_with_tokens(pd_cluster, 150, seed=6)
    plain = pd_cluster.complete(prompt, max_tokens=12)
    body = {"model": pd_cluster.model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
    with pd_cluster.client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        chunks = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    streamed = "".join(choice["text"] for c in chunks[:-1] for choice in json.loads(c)["choices"])
    assert streamed == plain["choices"][0]["text"]
