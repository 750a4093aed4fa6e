"""HTTP routes, response shapes, metric names and single-server prefix-cache arithmetic."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ._simproc import NIXL_KVC, Metrics, SimServer, free_port, metric, sim_processes, words

# vllm.md section 1.5 / vllm-cpu.md "Metrics seen": the families the simulator must expose.
REFERENCE_COUNTERS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:prompt_tokens_by_source",
    "vllm:prompt_tokens_cached",
    "vllm:prompt_tokens_cached_by_source",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:num_preemptions",
)
REFERENCE_GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
)
NIXL_HISTOGRAMS = (
    "vllm:nixl_xfer_time_seconds",
    "vllm:nixl_post_time_seconds",
    "vllm:nixl_bytes_transferred",
    "vllm:nixl_num_descriptors",
)
NIXL_COUNTERS = (
    "vllm:nixl_num_failed_transfers",
    "vllm:nixl_num_failed_notifications",
    "vllm:nixl_num_kv_expired_reqs",
    "vllm:nixl_num_notifications_after_expiry",
)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimServer]]:
    """A plain server (block 128, alias name), an api-key + dev-mode server, and a NIXL server."""
    with sim_processes(tmp_path_factory.mktemp("routes")) as start:
        plain = start(
            "--block-size",
            "128",
            "--served-model-name",
            "alias",
            "--max-model-len",
            "1024",
            "--enable-prompt-tokens-details",
            model="org/tiny",
        )
        secured = start("--api-key", "sekrit", env={"VLLM_SERVER_DEV_MODE": "1"})
        nixl = start(
            "--kv-transfer-config",
            NIXL_KVC,
            env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
        )
        yield {"plain": plain.wait_ready(), "secured": secured.wait_ready(), "nixl": nixl.wait_ready()}


def _free() -> int:
    from ._simproc import free_port

    return free_port()


def test_health_models_version(servers: dict[str, SimServer]) -> None:
    s = servers["plain"]
    assert httpx.get(s.url + "/health", timeout=60).status_code == 200
    models = httpx.get(s.url + "/v1/models", timeout=60).json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert {k: card[k] for k in ("id", "object", "owned_by", "root", "max_model_len")} == {
        "id": "alias",
        "object": "model",
        "owned_by": "vllm",
        "root": "org/tiny",
        "max_model_len": 1024,
    }
    version = httpx.get(s.url + "/version", timeout=60).json()
    assert version["version"] == "0.34.0"
    sim = version["pdserve_sim"]
    assert (sim["block_size"], sim["attention_backend"], sim["served_model_name"]) == (
        128,
        "CPU_ATTN",
        "alias",
    )
    assert sim["pid"] == s.proc.pid
    assert sim["device"] is None


def test_completion_shape_and_determinism(servers: dict[str, SimServer]) -> None:
    s = servers["plain"]
    r = s.complete("Red Hat is", return_token_ids=True, logprobs=2, max_tokens=5)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == "alias"
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 5
    assert choice["prompt_token_ids"][0] == 0
    assert len(choice["prompt_token_ids"]) == 4
    assert body["usage"] == {
        "prompt_tokens": 4,
        "total_tokens": 9,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": None,
    }
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert all(len(top) == 2 for top in lp["top_logprobs"])
    assert "".join(lp["tokens"]) == choice["text"]
    assert body["kv_transfer_params"] is None
    # temperature 0: same text again, and the same ids when sent as token ids (no BOS added then)
    again = s.complete(choice["prompt_token_ids"], max_tokens=5).json()["choices"][0]["text"]
    assert again == choice["text"]
    assert s.complete("Red Hat is", max_tokens=16).json()["usage"]["completion_tokens"] == 16  # default 16
    assert len(s.post("/v1/completions", {"prompt": "x"}).json()["choices"][0]["text"]) > 0


def test_seeded_sampling(servers: dict[str, SimServer]) -> None:
    s = servers["plain"]
    texts = {
        s.complete("sample me", temperature=1.0, seed=seed, max_tokens=8).json()["choices"][0]["text"]
        for seed in (1, 1, 2)
    }
    assert len(texts) == 2  # seed 1 twice is reproducible, seed 2 differs


def test_n_choices_as_vllm_serves_them(servers: dict[str, SimServer]) -> None:
    """``n`` > 1 (vLLM's ParentRequest fan-out, measured on vLLM for CPU 0.32): n choices indexed 0..n-1, usage
    counting the prompt once and every choice's tokens, seeded children seeded ``seed + i``, stream chunks carrying
    their choice's index (chat's role chunk once per choice first), greedy n > 1 refused."""
    s = servers["plain"]
    body = s.complete("pick several", temperature=1.0, seed=5, n=3, max_tokens=4, return_token_ids=True).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    usage = body["usage"]
    n_prompt = len(body["choices"][0]["prompt_token_ids"])
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (n_prompt, 12)
    assert len({tuple(c["token_ids"]) for c in body["choices"]}) == 3  # children sample apart
    child = s.complete("pick several", temperature=1.0, seed=6, max_tokens=4, return_token_ids=True).json()
    assert child["choices"][0]["token_ids"] == body["choices"][1]["token_ids"]  # child 1 runs with seed 5 + 1

    greedy = s.complete("pick several", temperature=0, n=2, max_tokens=4)
    assert greedy.status_code == 400
    assert greedy.json()["error"]["message"] == "n must be 1 when using greedy sampling, got 2."

    for route, over in (("/v1/completions", {"prompt": "pick several"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "pick"}]})):  # fmt: skip
        stream = {**over, "n": 2, "max_tokens": 3, "temperature": 1.0, "stream": True,
                  "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", s.url + route, json=stream, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        indices = [c["choices"][0]["index"] for c in chunks if c["choices"]]
        roles = 2 if route.endswith("chat/completions") else 0
        assert indices == [0, 1] * (3 + roles // 2), indices
        finished = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert finished == [0, 1]
        assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_streaming_matches_non_streaming(servers: dict[str, SimServer]) -> None:
    s = servers["plain"]
    full = s.complete("stream this", max_tokens=6).json()["choices"][0]["text"]
    with httpx.stream(
        "POST",
        s.url + "/v1/completions",
        json={
            "prompt": "stream this",
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=60,
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-1]["choices"] == []
    text_chunks = chunks[:-1]
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == full
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-2:] == [None, "length"]


def test_chat_completion(servers: dict[str, SimServer]) -> None:
    s = servers["plain"]
    body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4, "temperature": 0}
    r = s.post("/v1/chat/completions", body).json()
    assert r["object"] == "chat.completion"
    assert r["id"].startswith("chatcmpl-")
    msg = r["choices"][0]["message"]
    assert msg["role"] == "assistant"
    assert len(msg["content"].split()) == 4
    # "user: hi there\nassistant: " tokenized without BOS
    assert r["usage"]["prompt_tokens"] == 7
    with httpx.stream("POST", s.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line and line != "data: [DONE]"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == msg["content"]


@pytest.mark.parametrize(
    ("body", "status", "err_type", "needle"),
    [
        ({"prompt": "x", "model": "nope"}, 404, "NotFoundError", "The model `nope` does not exist."),
        ({"prompt": "x", "max_tokens": 0}, 400, "BadRequestError", "max_tokens"),
        ({"prompt": "x", "max_tokens": 5000}, 400, "BadRequestError", "cannot be greater than max_model_len=1024"),
        ({"prompt": []}, 400, "BadRequestError", "prompt"),
        ({"prompt": "x", "logprobs": 21}, 400, "BadRequestError", "max allowed: 20"),
    ],
)
def test_request_errors_have_vllm_shape(
    servers: dict[str, SimServer], body: dict[str, object], status: int, err_type: str, needle: str
) -> None:
    r = servers["plain"].post("/v1/completions", body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["type"] == err_type
    assert err["code"] == status
    assert needle in err["message"]


def test_unknown_route_and_dev_endpoint_absent(servers: dict[str, SimServer]) -> None:
    s = servers["plain"]
    assert httpx.post(s.url + "/reset_prefix_cache", timeout=60).status_code == 404
    assert httpx.get(s.url + "/nope", timeout=60).json() == {"detail": "Not Found"}


def test_prefix_cache_arithmetic_361_tokens(servers: dict[str, SimServer]) -> None:
    s = servers["plain"]
    prompt = words(360, tag="pc")  # 360 pieces + BOS = 361 tokens
    before = s.metrics()
    first = s.complete(prompt, max_tokens=3).json()
    mid = s.metrics()
    second = s.complete(prompt, max_tokens=3).json()
    after = s.metrics()

    def delta(a: Metrics, b: Metrics, name: str, **labels: str) -> float:
        return metric(b, name, **labels) - metric(a, name, **labels)

    assert first["usage"]["prompt_tokens"] == 361
    assert delta(before, mid, "vllm:prefix_cache_queries_total") == 361
    assert delta(before, mid, "vllm:prefix_cache_hits_total") == 0
    assert delta(mid, after, "vllm:prefix_cache_queries_total") == 361
    assert delta(mid, after, "vllm:prefix_cache_hits_total") == 256
    assert delta(mid, after, "vllm:prompt_tokens_cached_by_source_total", source="device") == 256
    assert delta(mid, after, "vllm:prompt_tokens_by_source_total", source="local_compute") == 105
    assert delta(mid, after, "vllm:generation_tokens_total") == 3
    assert delta(mid, after, "vllm:request_success_total", finished_reason="length") == 1
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 256}
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


def test_metric_names_match_reference(servers: dict[str, SimServer]) -> None:
    plain = servers["plain"].metrics()
    names = {name for name, _ in plain}
    for family in REFERENCE_COUNTERS:
        assert {family + "_total", family + "_created"} <= names, family
    for family in REFERENCE_GAUGES:
        assert family in names, family
    assert not any(n.startswith("vllm:nixl_") for n in names)
    info = [labels for name, labels in plain if name == "vllm:cache_config_info"]
    assert ("block_size", "128") in info[0]
    assert ("enable_prefix_caching", "True") in info[0]
    nixl = {name for name, _ in servers["nixl"].metrics()}
    for family in NIXL_HISTOGRAMS:
        assert {family + "_sum", family + "_count", family + "_bucket"} <= nixl, family
    for family in NIXL_COUNTERS:
        assert family + "_total" in nixl, family
    assert metric(servers["plain"].metrics(), "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0


def test_api_key_guards_v1_only(servers: dict[str, SimServer]) -> None:
    s = servers["secured"]
    assert httpx.get(s.url + "/v1/models", timeout=60).status_code == 401
    assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=60).json() == {
        "error": "Unauthorized"
    }
    ok = httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer sekrit"}, timeout=60)
    assert ok.status_code == 200
    assert ok.json()["data"][0]["id"] == "tiny-sim"
    assert httpx.get(s.url + "/health", timeout=60).status_code == 200
    assert httpx.get(s.url + "/metrics", timeout=60).status_code == 200


def test_reset_prefix_cache_in_dev_mode(servers: dict[str, SimServer]) -> None:
    s = servers["secured"]
    auth = {"Authorization": "Bearer sekrit"}
    prompt = words(40, tag="reset")
    s.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0}, headers=auth)
    hits = metric(s.metrics(), "vllm:prefix_cache_hits_total")
    r = httpx.post(s.url + "/reset_prefix_cache", timeout=60)
    assert r.status_code == 200
    assert r.json() == {"success": True}
    s.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0}, headers=auth)
    assert metric(s.metrics(), "vllm:prefix_cache_hits_total") == hits  # cache was emptied: no new hit
    s.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0}, headers=auth)
    assert metric(s.metrics(), "vllm:prefix_cache_hits_total") == hits + 32  # block 16: (41-1)//16*16


def test_log_has_vllm_like_lines(servers: dict[str, SimServer]) -> None:
    # A request of its own: the test passes alone too (-k), not only after the module's other tests.
    assert servers["plain"].complete("hello", max_tokens=1).status_code == 200
    needles = (
        "Started server process",
        "Uvicorn running on http://127.0.0.1:",
        "non-default args",
        '"POST /v1/completions HTTP/1.1" 200',
        "Finished request cmpl-",
    )
    deadline = time.monotonic() + 60  # the access line may land just after the response
    while any(n not in servers["plain"].log() for n in needles) and time.monotonic() < deadline:
        time.sleep(0.05)
    log = servers["plain"].log()
    for needle in needles:
        assert needle in log, needle
    assert Path(servers["plain"].log_path).exists()
