"""Hybrid (Mamba) models: Mamba state moved by P/D, the one-token prefill backoff, align-mode prefix hits."""

from __future__ import annotations

import asyncio

import httpx

from pytest_pdserve.sim.app import AppState, build_app
from pytest_pdserve.sim.cli import parse_serve_args
from pytest_pdserve.sim.engine import Engine
from pytest_pdserve.sim.faults import SimEnv

from ._simproc import NIXL_KVC, Factory, Metrics, SimServer, free_port, metric

BLOCK = 128
# tiny-nemotronh under --dtype float32: 1 attention layer x K,V x 1 head x 64 x 4 B = 512 B/token;
# Mamba2 state: conv 288 x 3 x 4 B + SSM 8 x 32 x 16 x 4 B (float32) = 19,840 B per request.
ATTN_BLOCK_BYTES = BLOCK * 512
STATE_BYTES = 288 * 3 * 4 + 8 * 32 * 16 * 4


def test_mamba_state_size_of_the_tiny_hybrid() -> None:
    e = Engine(parse_serve_args(["pdserve-sim/tiny-nemotronh", "--dtype", "float32"]), SimEnv(), "CPU_ATTN")
    assert e.mamba_state_bytes == STATE_BYTES
    assert e.bytes_per_token == 512


def test_align_mode_hits_only_where_a_mamba_state_was_saved() -> None:
    """A pure attention model hits any cached full block; a hybrid one only at a saved Mamba state (the last
    full block of an earlier request), as vLLM's mamba_cache_mode 'align' does."""

    def hits(model: str) -> list[int]:
        e = Engine(parse_serve_args([model, "--block-size", str(BLOCK)]), SimEnv(), "CPU_ATTN")
        app = build_app(AppState(engine=e))
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s")
        counter = e.metrics.prefix_cache_hits.labels(**e.metrics.labels)
        out = []

        async def run() -> None:
            for prompt in ([5] * 300, [5] * 300, [5] * 200 + [6] * 100):
                before = counter._value.get()
                r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
                assert r.status_code == 200, r.text
                out.append(int(counter._value.get() - before))

        asyncio.run(run())
        return out

    assert hits("pdserve-sim/tiny-llama") == [0, 256, 128]
    assert hits("pdserve-sim/tiny-nemotronh") == [0, 256, 0]  # no Mamba state at token 128


def test_pd_moves_mamba_state_and_backs_off_one_token(sim_factory: Factory) -> None:
    start = sim_factory
    common = ("--block-size", str(BLOCK), "--dtype", "float32", "--kv-transfer-config", NIXL_KVC)

    def side() -> dict[str, str]:
        # A simulated GPU: on the CPU platform vLLM's Mamba kernel kills the engine on this 300-token prefill
        # (rules/mamba.py; test_cpu_platform_engine_dies_on_a_prefill_of_more_than_one_block).
        # VLLM_SSM_CONV_STATE_LAYOUT=DS: NixlConnector refuses a hybrid model without it (test_sim_kvcontent.py).
        return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                "PDSERVE_SIM_PLATFORM": "cuda",
                "VLLM_SSM_CONV_STATE_LAYOUT": "DS"}  # fmt: skip

    p: SimServer = start(*common, env=side(), model="pdserve-sim/tiny-nemotronh")
    d: SimServer = start(*common, env=side(), model="pdserve-sim/tiny-nemotronh")
    p.wait_ready()
    d.wait_ready()
    prompt = [7] * 300
    p0, d0 = p.metrics(), d.metrics()
    first = p.complete(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}).json()
    params = first["kv_transfer_params"]
    assert params["remote_num_tokens"] == 299  # the prefiller stops one token short
    assert first["usage"]["prompt_tokens"] == 300
    out = d.complete(prompt, max_tokens=4, kv_transfer_params=params).json()
    assert out["usage"]["prompt_tokens"] == 300
    p1, d1 = p.metrics(), d.metrics()

    def delta(a: Metrics, b: Metrics, name: str, **labels: str) -> float:
        return metric(b, name, **labels) - metric(a, name, **labels)

    assert delta(p0, p1, "vllm:prompt_tokens_by_source_total", source="local_compute") == 299
    assert delta(d0, d1, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 299
    assert delta(d0, d1, "vllm:prompt_tokens_by_source_total", source="local_compute") == 1
    # 3 attention blocks (299 tokens) plus the request's Mamba state.
    assert delta(d0, d1, "vllm:nixl_bytes_transferred_sum") == 3 * ATTN_BLOCK_BYTES + STATE_BYTES


def test_cpu_platform_engine_dies_on_a_prefill_of_more_than_one_block(sim_factory: Factory) -> None:
    """vLLM for CPU's Mamba kernel drops the per-chunk states an align-mode checkpoint needs, so a hybrid prefill of
    more than one block kills its engine (IndexError, HTTP 500, then exit: rules/mamba.py); one block or less runs.
    The simulator on its CPU platform dies the same way; on a GPU platform it does not (test above)."""
    server: SimServer = sim_factory("--block-size", str(BLOCK), model="pdserve-sim/tiny-nemotronh",
                                    env={"PDSERVE_SIM_PLATFORM": "cpu"})  # fmt: skip
    server.wait_ready()
    assert server.complete([9] * BLOCK, max_tokens=1).status_code == 200  # one block: no checkpoint
    assert server.complete([8] * 100 + [9] * BLOCK, max_tokens=1).status_code == 500  # 228 tokens: a checkpoint
    log = server.log()
    assert "IndexError: index 3 is out of bounds for dimension 0 with size 1" in log
    assert server.wait_exit() == 1
