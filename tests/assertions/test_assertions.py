"""Assertion helpers against fake servers that count prompt tokens like vLLM does.

Each fake keeps a block prefix cache over whitespace "tokens" and updates vLLM's counters
(prefix cache, prompt tokens by source, NIXL histogram sums) per request; a fake proxy routes
like the real one (prefill with max_tokens=1, then decode with P's kv_transfer_params).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from pytest_pdserve import assertions as A
from pytest_pdserve.metrics import MetricsSnapshot, parse_metrics
from pytest_pdserve.proxy import prefill_body

METRICS = Path(__file__).parents[1] / "data" / "metrics"
BLOCK = 4
BYTES_PER_BLOCK = 1000
LONG = "one two three four five six seven eight nine ten"  # 10 tokens: 2 full blocks


def load(name: str) -> MetricsSnapshot:
    return parse_metrics((METRICS / name).read_text(), source=name)


@dataclass
class FakeEngine:
    """Counts like vLLM: whole-block prefix hits, at most P-1 tokens; remote prefill over NIXL."""

    name: str
    nixl: bool = True
    caching: bool = True
    reset_supported: bool = True
    token_ids: bool = True  # return token_ids/logprobs when asked
    reject_extras: bool = False  # HTTP 400 on return_token_ids, like an old server
    script: list[list[int]] = field(default_factory=list)  # outputs to return, in order
    received: list[dict[str, Any]] = field(default_factory=list)
    counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=lambda: defaultdict(float))
    cache: set[tuple[str, ...]] = field(default_factory=set)

    def add(self, name: str, value: float, **labels: str) -> None:
        self.counters[(name, tuple(sorted(labels.items())))] += value

    def render(self) -> str:
        lines: list[str] = []
        for src in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            self.add("vllm:prompt_tokens_by_source_total", 0, source=src)
        for name in (
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
        ):
            self.add(name, 0)
        self.add("vllm:request_success_total", 0, finished_reason="length")
        if self.nixl:
            self.add("vllm:nixl_bytes_transferred_sum", 0)
            self.add("vllm:nixl_bytes_transferred_count", 0)
        lines.append(f'vllm:cache_config_info{{block_size="{BLOCK}",engine="0"}} 1.0')
        for (name, labels), value in sorted(self.counters.items()):
            inner = ",".join(f'{k}="{v}"' for k, v in labels)
            lines.append(f"{name}{{{inner}}} {value}" if inner else f"{name} {value}")
            if name.endswith("_total"):
                lines.append(f"{name[:-6]}_created{{{inner}}} 1.7e9" if inner else f"{name[:-6]}_created 1.7e9")
        return "\n".join(lines) + "\n"

    def hit(self, words: list[str]) -> int:
        limit = (len(words) - 1) // BLOCK * BLOCK
        n = 0
        while self.caching and n + BLOCK <= limit and tuple(words[: n + BLOCK]) in self.cache:
            n += BLOCK
        return n

    def serve(self, body: dict[str, Any]) -> httpx.Response:
        self.received.append(body)
        if self.reject_extras and "return_token_ids" in body:
            return httpx.Response(400, json={"error": {"message": "unknown field return_token_ids"}})
        words = body["prompt"].split()
        p = len(words)
        kv = body.get("kv_transfer_params") or {}
        hit = self.hit(words)
        self.add("vllm:prefix_cache_queries_total", p)
        self.add("vllm:prefix_cache_hits_total", hit)
        self.add("vllm:prompt_tokens_total", p)
        if kv.get("do_remote_prefill"):
            external = p - hit
            blocks = -(-p // BLOCK) - hit // BLOCK
            self.add("vllm:prompt_tokens_by_source_total", hit, source="local_cache_hit")
            self.add("vllm:prompt_tokens_by_source_total", external, source="external_kv_transfer")
            if self.nixl:
                self.add("vllm:nixl_bytes_transferred_sum", blocks * BYTES_PER_BLOCK)
                self.add("vllm:nixl_bytes_transferred_count", 1)
        else:
            self.add("vllm:prompt_tokens_by_source_total", hit, source="local_cache_hit")
            self.add("vllm:prompt_tokens_by_source_total", p - hit, source="local_compute")
        for n in range(BLOCK, p + 1, BLOCK):
            self.cache.add(tuple(words[:n]))
        max_tokens = int(body.get("max_tokens", 16))
        ids = self.script.pop(0) if self.script else [(sum(map(len, words)) + i) % 50 for i in range(max_tokens)]
        self.add("vllm:generation_tokens_total", len(ids))
        self.add("vllm:request_success_total", 1, finished_reason="length")
        choice: dict[str, Any] = {"index": 0, "text": "".join(f" w{t}" for t in ids), "finish_reason": "length"}
        if self.token_ids and body.get("return_token_ids"):
            choice["token_ids"] = ids
        if self.token_ids and body.get("logprobs"):
            choice["logprobs"] = {
                "tokens": [f" w{t}" for t in ids],
                "token_logprobs": [-0.01 * (i + 1) for i in range(len(ids))],
                "top_logprobs": [{f" w{t}": -0.01 * (i + 1), " alt": -3.0} for i, t in enumerate(ids)],
            }
        answer: dict[str, Any] = {"choices": [choice], "usage": {"prompt_tokens": p, "completion_tokens": len(ids)}}
        if kv.get("do_remote_decode"):
            answer["kv_transfer_params"] = {"do_remote_prefill": True, "remote_engine_id": self.name}
        return httpx.Response(200, json=answer)

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=self.render())
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake-model"}]})
        if request.url.path == "/reset_prefix_cache" and request.method == "POST":
            if not self.reset_supported:
                return httpx.Response(404, json={"detail": "Not Found"})
            self.cache.clear()
            return httpx.Response(200, json={"success": True})
        if request.url.path == "/v1/completions":
            return self.serve(json.loads(request.content))
        return httpx.Response(404)


@dataclass
class FakeHandle:
    role: str
    name: str
    url: str
    client: httpx.Client
    engine: FakeEngine | None = None

    def metrics(self) -> MetricsSnapshot:
        return parse_metrics(self.client.get("/metrics").text, source=self.url + "/metrics")


def handle_for(role: str, engine: FakeEngine, port: int) -> FakeHandle:
    url = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=url, transport=httpx.MockTransport(engine.handle))
    return FakeHandle(role, engine.name, url, client, engine)


@dataclass
class FakeCluster:
    prefill: tuple[FakeHandle, ...]
    decode: tuple[FakeHandle, ...]
    proxy: FakeHandle
    model: str = "fake-model"
    block_size: int = BLOCK
    attention_backend: str | None = None
    engine: str = "sim"

    @property
    def client(self) -> httpx.Client:
        return self.proxy.client


def make_cluster(n_prefill: int = 1, n_decode: int = 1, **decode_kw: Any) -> FakeCluster:
    prefill = tuple(handle_for("prefill", FakeEngine(f"prefill-{i}"), 8100 + i) for i in range(n_prefill))
    decode = tuple(handle_for("decode", FakeEngine(f"decode-{i}", **decode_kw), 8200 + i) for i in range(n_decode))
    turn = {"p": 0, "d": 0}

    def route(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        p = prefill[turn["p"] % len(prefill)].engine
        d = decode[turn["d"] % len(decode)].engine
        turn["p"] += 1
        turn["d"] += 1
        assert p is not None
        assert d is not None
        p_resp = p.serve(prefill_body(body))
        if p_resp.status_code >= 400:
            return p_resp
        body["kv_transfer_params"] = p_resp.json()["kv_transfer_params"]
        return d.serve(body)

    proxy_client = httpx.Client(base_url="http://127.0.0.1:8000", transport=httpx.MockTransport(route))
    return FakeCluster(prefill, decode, FakeHandle("proxy", "proxy", "http://127.0.0.1:8000", proxy_client))


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    c = make_cluster()
    yield c
    for h in (*c.prefill, *c.decode, c.proxy):
        h.client.close()


def decode_engine(c: FakeCluster, i: int = 0) -> FakeEngine:
    engine = c.decode[i].engine
    assert engine is not None
    return engine


# --- determinism ---------------------------------------------------------------------------


def test_deterministic_sets_sampling_defaults_and_returns_outputs(cluster: FakeCluster) -> None:
    result = A.assert_deterministic(cluster, {"prompt": LONG, "max_tokens": 5})
    assert len(result.outputs) == 2
    assert result.outputs[0].token_ids == result.outputs[1].token_ids
    assert result.outputs[0].token_ids is not None
    sent = decode_engine(cluster).received[0]
    assert sent["temperature"] == 0
    assert sent["seed"] == 0
    assert sent["model"] == "fake-model"
    assert sent["return_token_ids"] is True
    assert sent["logprobs"] == 5
    # Deltas prove both runs reached the decode server.
    assert [d["decode-0"].request_success() for d in result.deltas] == [1, 1]


def test_deterministic_keeps_caller_values(cluster: FakeCluster) -> None:
    A.assert_deterministic(cluster, {"prompt": LONG, "temperature": 0.5, "seed": 7, "logprobs": 2})
    sent = decode_engine(cluster).received[0]
    assert (sent["temperature"], sent["seed"], sent["logprobs"]) == (0.5, 7, 2)


def test_divergence_message_shows_token_window_and_hint(cluster: FakeCluster) -> None:
    decode_engine(cluster).script = [[1, 2, 3, 4, 5], [1, 2, 3, 9, 5]]
    with pytest.raises(AssertionError) as exc_info:
        A.assert_deterministic(cluster, {"prompt": LONG, "max_tokens": 5})
    message = str(exc_info.value)
    assert message.startswith("not deterministic: outputs differ at token 3 (run 1: 5, run 2: 5 tokens)")
    assert "common prefix: ...' w1 w2 w3'" in message
    assert "run 1: ' w4 w5'..." in message
    assert "run 2: ' w9 w5'..." in message
    assert "token ids at 3: run 1=4 run 2=9" in message
    assert "run 1: {' w4': -0.0400, ' alt': -3.0000}" in message
    assert "engine=sim attention_backend=auto" in message
    assert message.endswith(A.FLASH_ATTN_HINT)


@pytest.mark.parametrize(("backend", "hint"), [("FLASH_ATTN", True), ("auto", True), ("TRITON_ATTN", False)])
def test_hint_only_for_flash_attn_or_auto(cluster: FakeCluster, backend: str, hint: bool) -> None:
    cluster.attention_backend = backend
    decode_engine(cluster).script = [[1, 2], [1, 3]]
    with pytest.raises(AssertionError) as exc_info:
        A.assert_deterministic(cluster, {"prompt": LONG, "max_tokens": 2})
    assert (A.FLASH_ATTN_HINT in str(exc_info.value)) is hint
    assert f"attention_backend={backend}" in str(exc_info.value)


def test_text_only_fallback_when_no_token_ids() -> None:
    c = make_cluster(token_ids=False)
    decode_engine(c).script = [[1, 2, 3], [1, 2, 4]]
    with pytest.raises(AssertionError) as exc_info:
        A.assert_deterministic(c, {"prompt": LONG, "max_tokens": 3})
    message = str(exc_info.value)
    assert "outputs differ at character 8" in message
    assert "(no token ids returned: compared text only)" in message


def test_server_rejecting_token_ids_gets_plain_request() -> None:
    c = make_cluster(reject_extras=True)
    result = A.assert_deterministic(c, {"prompt": LONG, "max_tokens": 3})
    assert result.outputs[0].token_ids is None
    assert result.outputs[0].text == result.outputs[1].text != ""
    assert "return_token_ids" not in decode_engine(c).received[-1]


def test_deterministic_with_plain_client(cluster: FakeCluster) -> None:
    result = A.assert_deterministic(cluster.client, {"prompt": LONG, "model": "m"}, repeats=3)
    assert len(result.outputs) == 3
    assert result.deltas == ({}, {}, {})
    with pytest.raises(ValueError, match="repeats=1 must be >= 2"):
        A.assert_deterministic(cluster.client, {"prompt": LONG}, repeats=1)


def test_streaming_requests_are_collected() -> None:
    events = [
        {"choices": [{"index": 0, "text": " a", "token_ids": [1]}]},
        {"choices": [{"index": 0, "text": " b", "token_ids": [2], "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
    ]
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    transport = httpx.MockTransport(
        lambda r: httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})
    )
    with httpx.Client(base_url="http://127.0.0.1:1", transport=transport) as client:
        out = A.complete(client, {"prompt": "x", "stream": True})
    assert (out.text, out.token_ids, out.prompt_tokens, out.finish_reason) == (" a b", (1, 2), 3, "length")


def test_http_error_names_target_and_status(cluster: FakeCluster) -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(503, text="engine dead"))
    with (
        httpx.Client(base_url="http://127.0.0.1:1", transport=transport) as client,
        pytest.raises(AssertionError, match=r"http://127.0.0.1:1 \(/v1/completions\) failed with HTTP 503: engine"),
    ):
        A.complete(client, {"prompt": "x"})


# --- P/D vs single instance ------------------------------------------------------------------


def test_pd_matches_single_sends_reference_to_prefill_directly(cluster: FakeCluster) -> None:
    result = A.assert_pd_matches_single(cluster, {"prompt": LONG, "max_tokens": 4})
    assert result.labels == ("P/D", "single prefill-0")
    prefill = cluster.prefill[0].engine
    assert prefill is not None
    direct = prefill.received[-1]
    assert "kv_transfer_params" not in direct
    assert direct["max_tokens"] == 4


def test_pd_mismatch_is_labelled(cluster: FakeCluster) -> None:
    decode_engine(cluster).script = [[7, 7]]
    with pytest.raises(
        AssertionError,
        match=r"^P/D output differs from single-instance output: outputs differ at "
        r"token 0 \(P/D: 2, single prefill-0: 2 tokens\)",
    ):
        A.assert_pd_matches_single(cluster, {"prompt": LONG, "max_tokens": 2})


def test_logprob_tolerance_accepts_a_near_tie_flip(cluster: FakeCluster) -> None:
    # P/D picks a different token at 1; the fake's top-1 logprobs at 0..1 are equal, so it passes.
    decode_engine(cluster).script = [[1, 2, 3]]
    prefill = cluster.prefill[0].engine
    assert prefill is not None
    prefill.script = [[0], [1, 5, 6]]  # first: the P/D prefill step; second: the direct reference
    result = A.assert_pd_matches_single(cluster, {"prompt": LONG, "max_tokens": 3}, logprob_tolerance=0.5)
    assert result.outputs[0].token_ids != result.outputs[1].token_ids


def test_logprob_tolerance_fails_on_drift() -> None:
    c = make_cluster()
    d = decode_engine(c)
    original = d.serve

    def shifted(body: dict[str, Any]) -> httpx.Response:
        resp = original(body)
        data = resp.json()
        data["choices"][0]["logprobs"]["top_logprobs"][1][" w1"] = -2.0
        return httpx.Response(200, json=data)

    d.serve = shifted  # type: ignore[method-assign]
    d.script = [[1, 1, 1]]
    prefill = c.prefill[0].engine
    assert prefill is not None
    prefill.script = [[0], [1, 1, 1]]
    with pytest.raises(AssertionError) as exc_info:
        A.assert_pd_matches_single(c, {"prompt": LONG, "max_tokens": 3}, logprob_tolerance=0.5)
    message = str(exc_info.value)
    assert message.startswith(
        "P/D output differs from single-instance output: "
        "top-1 logprob drift 1.9800 at token 1 exceeds the tolerance 0.5"
    )
    assert "top logprobs at 1:" in message


def test_logprob_tolerance_without_logprobs_is_not_vacuous() -> None:
    c = make_cluster(token_ids=False)
    with pytest.raises(AssertionError, match="logprob_tolerance needs top logprobs, but P/D returned none"):
        A.assert_pd_matches_single(c, {"prompt": LONG}, logprob_tolerance=1.5)


# --- cold vs warm ----------------------------------------------------------------------------


def test_cold_warm_match_proves_the_warm_hit(cluster: FakeCluster) -> None:
    A.complete(cluster.client, {"prompt": LONG})  # something cached before: reset must clear it
    result = A.assert_cold_warm_match(cluster, {"prompt": LONG, "max_tokens": 3})
    cold, warm = result.deltas
    assert sum(d.prefix_cache_hits() for d in cold.values()) == 0
    assert warm["decode-0"].prefix_cache_hits() == 8


def test_cold_warm_short_prompt_is_vacuous(cluster: FakeCluster) -> None:
    with pytest.raises(AssertionError) as exc_info:
        A.assert_cold_warm_match(cluster, {"prompt": "a b c", "max_tokens": 3})
    message = str(exc_info.value)
    assert message.startswith("precondition not met: assert_cold_warm_match needs a prompt longer than one block")
    assert "it has 3 tokens and block_size=4" in message


def test_cold_run_that_hits_without_reset_endpoint_says_how_to_fix() -> None:
    c = make_cluster(reset_supported=False)
    prefill = c.prefill[0].engine
    assert prefill is not None
    prefill.reset_supported = False
    A.complete(c.client, {"prompt": LONG})
    with pytest.raises(
        AssertionError,
        match=r"cold run already hit the prefix cache \(16 tokens\); "
        r"prefill-0, decode-0 cannot reset \(start vLLM with VLLM_SERVER_DEV_MODE=1",
    ):
        A.assert_cold_warm_match(c, {"prompt": LONG})


def test_cold_warm_custom_reset_is_called(cluster: FakeCluster) -> None:
    calls: list[int] = []
    A.assert_cold_warm_match(cluster, {"prompt": LONG}, reset=lambda: calls.append(1))
    assert calls == [1]


# --- prefix cache / transfer -----------------------------------------------------------------


def test_prefix_cache_hit_with_prime(cluster: FakeCluster) -> None:
    result = A.assert_prefix_cache_hit(cluster.decode[0], {"prompt": LONG}, prime=True, min_hit_tokens=8)
    assert result.deltas[0]["decode-0"].prefix_cache_hits() == 8
    assert decode_engine(cluster).received[0]["model"] == "fake-model"  # looked up from /v1/models


def test_prefix_cache_miss_shows_table(cluster: FakeCluster) -> None:
    with pytest.raises(AssertionError) as exc_info:
        A.assert_prefix_cache_hit(cluster.decode[0], {"prompt": LONG})
    message = str(exc_info.value)
    assert message.startswith(A.NO_CACHE_HIT_MESSAGE.format(server="decode-0", hits=0, min_hit_tokens=1))
    assert "  decode-0:\n    metric " in message
    assert "vllm:prefix_cache_queries_total | 0      |    10 |    10 |      > 0  ok" not in message
    rows = {line.split("|")[0].strip(): line for line in message.splitlines() if "|" in line}
    assert rows["vllm:prefix_cache_queries_total"].rstrip().endswith("ok")
    assert rows["vllm:prefix_cache_hits_total"].rstrip().endswith("<-- FAIL")
    assert [c.strip() for c in rows["vllm:prefix_cache_hits_total"].split("|")[1:5]] == [
        "0",
        "0",
        "0",
        ">= 1  <-- FAIL",
    ]


def test_prefix_cache_check_is_vacuous_when_server_not_queried(
    cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(A, "SETTLE_TIMEOUT", 0.3)  # it waits for a query that never comes
    with pytest.raises(AssertionError, match=r"^vacuous: no prefix-cache queries on decode-0"):
        A.assert_prefix_cache_hit(cluster.decode[0], lambda: A.complete(cluster.prefill[0], {"prompt": LONG}))


def test_prefix_cache_check_rejects_proxy(cluster: FakeCluster) -> None:
    with pytest.raises(ValueError, match="proxy is the proxy, which has no prefix cache"):
        A.assert_prefix_cache_hit(cluster.proxy, {"prompt": LONG})


def test_kv_transferred(cluster: FakeCluster) -> None:
    result = A.assert_kv_transferred(cluster, {"prompt": LONG})
    assert result.deltas[0]["decode-0"].nixl_bytes_transferred() == 3 * BYTES_PER_BLOCK


def test_kv_transferred_fails_without_nixl_metrics() -> None:
    c = make_cluster(nixl=False)
    with pytest.raises(AssertionError) as exc_info:
        A.assert_kv_transferred(c, {"prompt": LONG})
    message = str(exc_info.value)
    assert message.startswith("no KV transfer: the request did not go through P/D (the decode servers expose no")
    assert "vllm:nixl_bytes_transferred_sum" in message
    assert "absent" in message


def test_kv_transferred_fails_when_decode_computed_locally(
    cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only one server counts the request, so the wait for two runs out: keep it short.
    monkeypatch.setattr(A, "SETTLE_TIMEOUT", 0.3)
    # Route the "proxy" straight to decode: no kv_transfer_params, so nothing moves.
    cluster.proxy = handle_for("proxy", decode_engine(cluster), 8000)
    with pytest.raises(AssertionError, match=r"no KV transfer: .*no decode server received KV over NIXL"):
        A.assert_kv_transferred(cluster, {"prompt": LONG})


def test_transfer_shrinks(cluster: FakeCluster) -> None:
    result = A.assert_transfer_shrinks(cluster, {"prompt": LONG})
    first, second = (d["decode-0"].nixl_bytes_transferred() for d in result.deltas)
    assert (first, second) == (3000, 1000)


def test_transfer_shrinks_follows_round_robin_to_the_same_decode() -> None:
    c = make_cluster(n_decode=2)
    result = A.assert_transfer_shrinks(c, {"prompt": LONG})
    assert len(result.outputs) == 3  # decode-0 (cold), decode-1 (cold), decode-0 (warm)


def test_transfer_not_shrunk_without_decode_cache() -> None:
    c = make_cluster(caching=False)
    with pytest.raises(
        AssertionError,
        match=r"^the repeated request moved 3000 NIXL bytes, not fewer than the first "
        r"\(3000\)",
    ):
        A.assert_transfer_shrinks(c, {"prompt": LONG})


# --- prompt token sources ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expect", "p", "b", "prefix", "hit", "want"),
    [
        ("cold_decode", 10, 4, None, None, (0, 0, 10)),
        ("full_hit", 10, 4, None, None, (0, 8, 2)),
        ("full_hit", 8, 4, None, None, (0, 4, 4)),  # P multiple of B: at most P-1 can hit
        ("full_hit", 3, 4, None, None, (0, 0, 3)),
        ("full_hit", 361, 128, None, None, (0, 256, 105)),
        ("partial_hit", 10, 4, 5, None, (0, 4, 6)),
        ("partial_hit", 10, 4, 10, None, (0, 8, 2)),
        ("direct_decode", 10, 4, None, 4, (6, 4, 0)),
    ],
)
def test_expected_prompt_token_sources(
    expect: str, p: int, b: int, prefix: int | None, hit: int | None, want: tuple[int, int, int]
) -> None:
    got = A.expected_prompt_token_sources(
        expect, prompt_tokens=p, block_size=b, prefix_tokens=prefix, local_cache_hit=hit
    )
    assert (got["local_compute"], got["local_cache_hit"], got["external_kv_transfer"]) == want


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"expect": "warm"}, "expect='warm' is not valid; accepted: cold_decode, full_hit"),
        ({"expect": "partial_hit"}, "needs prefix_tokens >= 1"),
        ({"expect": "cold_decode", "block_size": 0}, "block_size=0 must be >= 1"),
    ],
)
def test_expected_sources_reject_bad_input(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"prompt_tokens": 10, "block_size": 4, **kwargs}
    expect = args.pop("expect")
    with pytest.raises(ValueError, match=message):
        A.expected_prompt_token_sources(expect, **args)


def test_sources_from_saved_vllm_metrics() -> None:
    before, after, repeat = (
        load(n) for n in ("decode_before.txt", "decode_after_transfer.txt", "decode_after_repeat.txt")
    )
    A.assert_prompt_token_sources(after - before, expect="cold_decode", prompt_tokens=361, block_size=128)
    A.assert_prompt_token_sources(repeat - after, expect="full_hit", prompt_tokens=361, block_size=128)
    with pytest.raises(AssertionError) as exc_info:
        A.assert_prompt_token_sources(repeat - after, expect="cold_decode", prompt_tokens=361, block_size=128)
    message = str(exc_info.value)
    assert message.startswith(
        "prompt token sources do not match expect='cold_decode' (prompt_tokens=361, block_size=128)"
    )
    rows = {line.split("|")[0].strip(): line for line in message.splitlines() if "|" in line}
    hit_row = rows['vllm:prompt_tokens_by_source_total{source="local_cache_hit"}']
    assert [c.strip() for c in hit_row.split("|")[1:5]] == ["0", "256", "256", "== 0  <-- FAIL"]
    ext_row = rows['vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}']
    assert [c.strip() for c in ext_row.split("|")[1:5]] == ["404", "509", "105", "== 361  <-- FAIL"]


def test_sources_with_delta_need_counts() -> None:
    delta = load("decode_after_transfer.txt") - load("decode_before.txt")
    with pytest.raises(ValueError, match="prompt_tokens and block_size are required"):
        A.assert_prompt_token_sources(delta, expect="cold_decode")


@pytest.mark.parametrize("expect", ["cold_decode", "full_hit", "direct_decode"])
def test_sources_scenarios_on_cluster(expect: str) -> None:
    c = make_cluster(n_decode=2)
    result = A.assert_prompt_token_sources(c, expect=expect, request={"prompt": LONG})
    assert result.outputs[-1].prompt_tokens == 10


def test_sources_partial_hit_on_cluster(cluster: FakeCluster) -> None:
    A.assert_prompt_token_sources(
        cluster, expect="partial_hit", request={"prompt": LONG}, prime={"prompt": "one two three four five"}
    )


def test_sources_cluster_failure_names_the_decode_server() -> None:
    c = make_cluster()
    A.complete(c.decode[0], {"prompt": LONG, "model": "m"})  # D already has the prompt: not cold
    with pytest.raises(AssertionError) as exc_info:
        A.assert_prompt_token_sources(c, expect="cold_decode", request={"prompt": LONG})
    message = str(exc_info.value)
    assert message.startswith("precondition not met: expect='cold_decode' needs a prompt decode-0 has not cached")
    assert "\n  decode-0:\n" in message


def test_sources_full_hit_on_a_prompt_of_one_block_fails_naming_the_precondition(cluster: FakeCluster) -> None:
    """Issue 14's vacuous pass: expected hit ((P-1)//B)*B = 0, so the split matched without any hit."""
    with pytest.raises(AssertionError) as exc_info:
        A.assert_prompt_token_sources(cluster, expect="full_hit", request={"prompt": "a b c"})
    assert str(exc_info.value).startswith(
        "precondition not met: expect='full_hit' needs a prompt longer than one block: it has 3 tokens and block_size=4"
    )


def test_sources_arithmetic_preconditions_on_a_delta() -> None:
    delta = load("decode_before.txt") - load("decode_before.txt")
    with pytest.raises(AssertionError, match="precondition not met: expect='full_hit'"):
        A.assert_prompt_token_sources(delta, expect="full_hit", prompt_tokens=37, block_size=128)
    with pytest.raises(AssertionError, match="needs a primed prefix of at least one block"):
        A.assert_prompt_token_sources(delta, expect="partial_hit", prompt_tokens=300, block_size=128, prefix_tokens=100)
    with pytest.raises(AssertionError, match="needs a primed prefix shorter than the prompt"):
        A.assert_prompt_token_sources(delta, expect="partial_hit", prompt_tokens=300, block_size=128, prefix_tokens=300)


def test_sources_partial_hit_needs_the_prime_to_be_a_prefix(cluster: FakeCluster) -> None:
    with pytest.raises(AssertionError, match="needs prime= to be a prefix of request="):
        A.assert_prompt_token_sources(
            cluster, expect="partial_hit", request={"prompt": LONG}, prime={"prompt": "five six seven eight nine"}
        )


def test_prefix_cache_hit_on_a_short_prompt_fails_naming_the_precondition(cluster: FakeCluster) -> None:
    with pytest.raises(AssertionError, match="precondition not met: assert_prefix_cache_hit needs a prompt longer"):
        A.assert_prefix_cache_hit(cluster.decode[0], {"prompt": "a b c"}, prime=True)


SSE_CAPTURE = Path(__file__).parents[1] / "data" / "vllm-cpu" / "decode-sse-stream.txt"


@pytest.mark.skipif(not SSE_CAPTURE.is_file(), reason="no real vLLM SSE capture in tests/data/vllm-cpu yet")
def test_real_vllm_sse_stream_is_collected() -> None:
    text = SSE_CAPTURE.read_text()
    transport = httpx.MockTransport(
        lambda r: httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
    )
    with httpx.Client(base_url="http://127.0.0.1:1", transport=transport) as client:
        out = A.complete(client, {"prompt": "x", "stream": True})
    pieces = [
        json.loads(line[6:])["choices"][0]["text"]
        for line in text.splitlines()
        if line.startswith("data: {") and json.loads(line[6:]).get("choices")
    ]
    assert out.text == "".join(pieces) != ""
    assert out.token_ids is None  # not requested in that capture: text-only comparison
    assert out.finish_reason is not None


def _flip_pair(gap_a: float, gap_b: float) -> tuple[A.Completion, A.Completion]:
    a = A.Completion("x y", token_ids=(1, 2), top_logprobs=({"x": -0.1, "q": -2.0}, {"y": -0.5, "z": -0.5 - gap_a}))
    b = A.Completion("x z", token_ids=(1, 3), top_logprobs=({"x": -0.1, "q": -2.0}, {"z": -0.5, "y": -0.5 - gap_b}))
    return a, b


@pytest.mark.parametrize(
    ("gap_a", "gap_b", "tolerance", "verdict"),
    [
        (0.001, 0.002, None, A.TIE_FLIP),
        (0.001, 0.2, None, A.CONFIDENT_FLIP),  # one run was sure: not a tie
        (0.04, 0.04, 0.01, A.CONFIDENT_FLIP),
        (0.04, 0.04, 0.05, A.TIE_FLIP),
    ],
)
def test_classify_flip(gap_a: float, gap_b: float, tolerance: float | None, verdict: str) -> None:
    a, b = _flip_pair(gap_a, gap_b)
    div = A.first_divergence(a, b)
    assert div is not None
    flip = A.classify_flip(a, b, div, tolerance)
    assert (flip.index, flip.token_a, flip.token_b, flip.verdict) == (1, 2, 3, verdict)
    assert flip.gap == pytest.approx(max(gap_a, gap_b))


def test_classify_flip_without_logprobs_is_unknown() -> None:
    a, b = A.Completion("x y", token_ids=(1, 2)), A.Completion("x z", token_ids=(1, 3))
    div = A.first_divergence(a, b)
    assert div is not None
    assert A.classify_flip(a, b, div).verdict == A.UNKNOWN_FLIP


def test_deterministic_rejects_a_non_positive_tie_tolerance(cluster: FakeCluster) -> None:
    with pytest.raises(ValueError, match="tie_tolerance=0 must be > 0"):
        A.assert_deterministic(cluster, {"prompt": LONG}, tie_tolerance=0)


def test_assertions_export_the_cluster_classes_themselves() -> None:
    """One PDCluster: what the assertions export is what ``pytest_pdserve`` exports (issue 17)."""
    import pytest_pdserve

    assert A.PDCluster is pytest_pdserve.PDCluster
    assert A.ServerHandle is pytest_pdserve.ServerHandle


def test_no_private_name_is_imported_across_modules() -> None:
    import ast

    package = Path(A.__file__).resolve().parent.parent
    found = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pytest_pdserve"):
                found += [f"{path.relative_to(package)}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert not found


# --------------------------------------------------------------------------------------- batch invariance


def batch_bodies(n: int) -> list[dict[str, Any]]:
    return [{"prompt": " ".join(f"filler{i}x{j}" for j in range(40)), "max_tokens": 8} for i in range(n)]


def test_batch_invariant_sends_each_batch_and_compares_the_probe(cluster: FakeCluster) -> None:
    probe = {"prompt": " ".join(f"probe{j}" for j in range(40)), "max_tokens": 8}
    result = A.assert_batch_invariant(cluster, probe, batch_bodies(3), batch_sizes=(1, 2, 4))
    assert result.labels == ("batch of 1", "batch of 2", "batch of 4")
    assert len({out.text for out in result.outputs}) == 1
    received = decode_engine(cluster).received
    assert len(received) == 1 + 2 + 4  # every probe and filler reached decode, through P/D
    assert sum(1 for body in received if body["prompt"] == probe["prompt"]) == 3


def test_batch_invariant_names_the_batch_size_that_changed_the_output(cluster: FakeCluster) -> None:
    probe = {"prompt": " ".join(f"probe{j}" for j in range(40)), "max_tokens": 8}
    engine = decode_engine(cluster)
    plain_serve = engine.serve

    def batch_dependent(body: dict[str, Any]) -> httpx.Response:
        # The probe's output changes once the engine has served anything else: the batch of 2 differs.
        first = not engine.received
        response = plain_serve(body)
        if body["prompt"] != probe["prompt"] or first:
            return response
        answer = response.json()
        choice = answer["choices"][0]
        choice["text"] = " w9" * 8
        if "token_ids" in choice:
            choice["token_ids"] = [9] * 8
        return httpx.Response(200, json=answer)

    engine.serve = batch_dependent  # type: ignore[method-assign]
    with pytest.raises(AssertionError) as err:
        A.assert_batch_invariant(cluster, probe, batch_bodies(1), batch_sizes=(1, 2))
    assert "output depends on the batch size" in str(err.value)
    assert "batch of 2" in str(err.value)


@pytest.mark.parametrize(
    ("sizes", "fillers", "message"),
    [((1,), 0, "at least two sizes"), ((1, 0), 0, "whole numbers >= 1"), ((1, True), 0, "whole numbers >= 1"),
     ((1, 8), 3, "3 fillers for a batch of 8: need 7")],
)  # fmt: skip
def test_batch_invariant_refuses_what_cannot_compare(
    cluster: FakeCluster, sizes: tuple[int, ...], fillers: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        A.assert_batch_invariant(cluster, {"prompt": "a b c"}, batch_bodies(fillers), batch_sizes=sizes)
