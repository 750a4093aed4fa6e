"""P/D across two real simulator processes: NIXL-pull arithmetic, equality with a single server, failures."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import pytest

from ._simproc import NIXL_KVC, SimServer, free_port, metric, sim_processes, words

BLOCK = 128
BYTES_PER_BLOCK = BLOCK * 1024  # 131072, the tiny Llama's figure in vllm-cpu.md (served with --dtype float32)
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
RESPONSE_KEYS = {
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
    "remote_prefill_cached_tokens",
    "remote_registration_generation",  # from vLLM 0.33 (test_sim_vllm034.py)
}


def _kvc(**extra: Any) -> str:
    return json.dumps({**json.loads(NIXL_KVC), **extra})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimServer]]:
    """Prefill P, decode D (policy fail), and variants, all on 127.0.0.1 with distinct side-channel ports."""

    def side(port: int) -> dict[str, str]:
        return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}

    common = ("--block-size", str(BLOCK), "--dtype", "float32")
    with sim_processes(tmp_path_factory.mktemp("pd")) as start:
        servers = {
            "p": start(*common, "--kv-transfer-config", _kvc(kv_role="kv_producer"), env=side(free_port())),
            "d": start(*common, "--kv-transfer-config", _kvc(kv_role="kv_consumer"), env=side(free_port())),
            "d_recompute": start(
                *common, "--kv-transfer-config", _kvc(kv_load_failure_policy="recompute"), env=side(free_port())
            ),
            "d_failpull": start(
                *common, "--kv-transfer-config", NIXL_KVC, env={**side(free_port()), "PDSERVE_SIM_FAIL_KV_PULL": "1"}
            ),
            "p_triton": start(
                *common,
                "--kv-transfer-config",
                NIXL_KVC,
                "--attention-backend",
                "triton_attn",
                # CPU_ATTN runs on the CPU platform whatever is asked; TRITON_ATTN on a GPU takes float32 (FLASHINFER
                # does not: sim/attention.py).
                env={**side(free_port()), "PDSERVE_SIM_PLATFORM": "cuda"},
            ),
            "p_short_lease": start(
                *common,
                "--kv-transfer-config",
                _kvc(kv_connector_extra_config={"kv_lease_duration": 0.3}),
                env=side(free_port()),
            ),
        }
        for server in servers.values():
            server.wait_ready()
        yield servers


def prefill(
    p: SimServer, prompt: str | list[dict[str, str]], endpoint: str = "/v1/completions", **body: Any
) -> dict[str, Any]:
    """What the toy proxy sends to P (max_tokens=1, do_remote_decode)."""
    key = "messages" if endpoint.endswith("chat/completions") else "prompt"
    r = p.post(
        endpoint,
        {key: prompt, "max_tokens": 1, "temperature": 0, "stream": False, "kv_transfer_params": PREFILL_PARAMS, **body},
    )
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert isinstance(params, dict)
    return params


def decode(d: SimServer, prompt: str, params: Mapping[str, Any], max_tokens: int = 10) -> httpx.Response:
    """What the toy proxy sends to D."""
    return d.complete(prompt, max_tokens=max_tokens, kv_transfer_params=dict(params))


def delta(before: Any, after: Any, name: str, **labels: str) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def test_pd_transfer_arithmetic_and_equality(cluster: dict[str, SimServer]) -> None:
    p, d = cluster["p"], cluster["d"]
    prompt = words(360, tag="pd")  # 361 tokens = 2 full blocks + 105
    reference = p.complete(prompt, max_tokens=10).json()["choices"][0]["text"]

    m0 = d.metrics()
    params = prefill(p, prompt)
    assert set(params) == RESPONSE_KEYS
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["remote_host"] == "127.0.0.1"
    assert (
        params["remote_port"] == httpx.get(p.url + "/version", timeout=60).json()["pdserve_sim"]["side_channel"]["port"]
    )
    assert (params["transfer_mode"], params["tp_size"], params["dcp_size"], params["pp_size"]) == ("pull", 1, 1, 1)
    assert params["remote_num_tokens"] == 361
    assert len(params["remote_block_ids"]) == 1
    assert len(params["remote_block_ids"][0]) == 3
    assert params["remote_prefill_cached_tokens"] == 256  # P's own prefix cache (the reference request)
    r1 = decode(d, prompt, params)
    assert r1.status_code == 200, r1.text
    assert r1.json()["choices"][0]["text"] == reference
    m1 = d.metrics()
    assert delta(m0, m1, "vllm:nixl_bytes_transferred_sum") == 3 * BYTES_PER_BLOCK
    assert delta(m0, m1, "vllm:nixl_bytes_transferred_count") == 1
    assert delta(m0, m1, "vllm:nixl_num_descriptors_sum") == 3 * 4  # blocks x layers x (K, V)
    assert delta(m0, m1, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 361
    assert delta(m0, m1, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0
    assert delta(m0, m1, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 0
    assert delta(m0, m1, "vllm:prompt_tokens_cached_by_source_total", source="p2p") == 361
    assert delta(m0, m1, "vllm:external_prefix_cache_hits_total") == 361
    assert delta(m0, m1, "vllm:external_prefix_cache_queries_total") == 361

    # the same prompt again: D's own prefix cache holds 2 blocks, so only the partial block moves
    r2 = decode(d, prompt, prefill(p, prompt))
    assert r2.json()["choices"][0]["text"] == reference
    m2 = d.metrics()
    transfer1 = delta(m0, m1, "vllm:nixl_bytes_transferred_sum")
    transfer2 = delta(m1, m2, "vllm:nixl_bytes_transferred_sum")
    assert 0 < transfer2 < transfer1
    assert transfer2 == BYTES_PER_BLOCK
    assert delta(m1, m2, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 256
    assert delta(m1, m2, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 105
    assert delta(m1, m2, "vllm:prompt_tokens_cached_by_source_total", source="device") == 256
    assert delta(m1, m2, "vllm:prompt_tokens_cached_by_source_total", source="p2p") == 105
    assert delta(m1, m2, "vllm:prefix_cache_hits_total") == 256
    # D notified P, so P freed the leased blocks
    assert metric(p.metrics(), "vllm:kv_cache_usage_perc") == 0


def test_short_prompt_and_streaming_and_chat_through_pd(cluster: dict[str, SimServer]) -> None:
    p, d = cluster["p"], cluster["d"]
    prompt = "Red Hat is "
    reference = p.complete(prompt, max_tokens=8).json()["choices"][0]["text"]
    m0 = d.metrics()
    params = prefill(p, prompt)
    with httpx.stream(
        "POST",
        d.url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True, "kv_transfer_params": params},
        timeout=60,
    ) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference
    m1 = d.metrics()
    assert delta(m0, m1, "vllm:nixl_bytes_transferred_sum") == BYTES_PER_BLOCK  # one partial block
    assert delta(m0, m1, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 5  # BOS + 4 pieces

    messages = [{"role": "user", "content": "tell me about P/D"}]
    chat_ref = p.post("/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0}).json()
    chat_params = prefill(p, messages, endpoint="/v1/chat/completions")
    chat = d.post(
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": 6, "temperature": 0, "kv_transfer_params": chat_params},
    ).json()
    assert chat["choices"][0]["message"]["content"] == chat_ref["choices"][0]["message"]["content"]
    assert delta(m1, d.metrics(), "vllm:nixl_bytes_transferred_count") == 1


def test_direct_request_on_decode_computes_locally(cluster: dict[str, SimServer]) -> None:
    d = cluster["d"]
    prompt = words(99, tag="direct")  # 100 tokens
    m0 = d.metrics()
    assert d.complete(prompt, max_tokens=2).status_code == 200
    m1 = d.metrics()
    assert delta(m0, m1, "vllm:prompt_tokens_by_source_total", source="local_compute") == 100
    assert delta(m0, m1, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert delta(m0, m1, "vllm:nixl_bytes_transferred_count") == 0


def _bogus(params: Mapping[str, Any]) -> dict[str, Any]:
    return {**params, "remote_port": free_port()}  # nothing listens there: "prefill server gone"


def test_unreachable_prefill_with_fail_policy(cluster: dict[str, SimServer]) -> None:
    p, d = cluster["p"], cluster["d"]
    prompt = words(50, tag="gone")
    m0 = d.metrics()
    r = decode(d, prompt, _bogus(prefill(p, prompt)))
    assert r.status_code == 500
    assert r.json()["error"]["code"] == 500
    assert r.json()["error"]["type"] == "InternalServerError"
    assert delta(m0, d.metrics(), "vllm:nixl_num_failed_transfers_total") == 1
    assert "KV load failure (failure_policy=fail, 51 tokens affected)" in d.log()
    assert httpx.get(d.url + "/health", timeout=60).status_code == 200
    assert d.complete(prompt, max_tokens=2).status_code == 200


def test_unreachable_prefill_with_recompute_policy(cluster: dict[str, SimServer]) -> None:
    p, d = cluster["p"], cluster["d_recompute"]
    prompt = words(50, tag="recompute")
    reference = p.complete(prompt, max_tokens=10).json()["choices"][0]["text"]
    m0 = d.metrics()
    r = decode(d, prompt, _bogus(prefill(p, prompt)))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference
    m1 = d.metrics()
    assert delta(m0, m1, "vllm:prompt_tokens_by_source_total", source="local_compute") == 51
    assert delta(m0, m1, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0


def test_fail_kv_pull_switch(cluster: dict[str, SimServer]) -> None:
    p, d = cluster["p"], cluster["d_failpull"]
    prompt = words(20, tag="failpull")
    m0 = d.metrics()
    assert decode(d, prompt, prefill(p, prompt)).status_code == 500
    assert delta(m0, d.metrics(), "vllm:nixl_num_failed_transfers_total") == 1
    assert "PDSERVE_SIM_FAIL_KV_PULL" in d.log()


def test_attention_backend_mismatch_fails_handshake(cluster: dict[str, SimServer]) -> None:
    p, d = cluster["p_triton"], cluster["d"]
    prompt = words(20, tag="mismatch")
    r = decode(d, prompt, prefill(p, prompt))
    assert r.status_code == 500
    assert "NIXL compatibility hash mismatch" in d.log()


def test_expired_lease(cluster: dict[str, SimServer]) -> None:
    p, d = cluster["p_short_lease"], cluster["d"]
    prompt = words(20, tag="lease")
    params = prefill(p, prompt)
    held = p.metrics()
    # Blocks held for D until the 0.3 s lease ends: still held at this scrape, or already expired (a loaded CI
    # machine scraped after the lease had ended: the expiry counter only counts leases that held blocks).
    assert metric(held, "vllm:kv_cache_usage_perc") > 0 or metric(held, "vllm:nixl_num_kv_expired_reqs_total") >= 1
    deadline = time.monotonic() + 30  # a bound for a broken expiry, not a speed: it expires after 0.3 s
    while metric(p.metrics(), "vllm:nixl_num_kv_expired_reqs_total") < 1:
        assert time.monotonic() < deadline, "lease never expired"
        time.sleep(0.05)
    assert metric(p.metrics(), "vllm:kv_cache_usage_perc") == 0
    r = decode(d, prompt, params)
    assert r.status_code == 500
    assert "unknown or its KV lease expired" in d.log()
