"""Determinism through P/D, the three ways vLLM's P/D tests check it (each request sequential, temperature 0).

Run on the simulator (default without vLLM) or real vLLM:  pytest examples --pd-engine=vllm
"""

from __future__ import annotations

import json

from _prompts import make_prompt

from pytest_pdserve.assertions import assert_cold_warm_match, assert_deterministic, assert_pd_matches_single


def test_same_request_twice(pd_cluster):
    assert_deterministic(pd_cluster, {"prompt": make_prompt(200, seed=2), "max_tokens": 16})


def test_pd_matches_single_instance(pd_cluster):
    # The first prefill server, asked directly, is a plain (non-disaggregated) vLLM instance.
    assert_pd_matches_single(pd_cluster, {"prompt": make_prompt(300, seed=3), "max_tokens": 16})


def test_cold_cache_matches_warm_cache(pd_cluster):
    assert_cold_warm_match(pd_cluster, {"prompt": make_prompt(400, seed=4), "max_tokens": 16})


def test_chat_completions_through_pd(pd_cluster):
    request = {"messages": [{"role": "user", "content": make_prompt(120, seed=5)}], "max_tokens": 12}
    assert_pd_matches_single(pd_cluster, request, endpoint="/v1/chat/completions")


def test_streaming_matches_non_streaming(pd_cluster):
    prompt = make_prompt(150, seed=6)
    plain = pd_cluster.complete(prompt, max_tokens=12)
    with pd_cluster.client.stream(
        "POST", "/v1/completions",
        json={"model": pd_cluster.model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True},
    ) as response:
        assert response.status_code == 200
        chunks = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    streamed = "".join(ch["text"] for c in chunks[:-1] for ch in json.loads(c)["choices"])
    assert streamed == plain["choices"][0]["text"]
