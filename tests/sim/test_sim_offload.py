"""OffloadingConnector's CPU tier, alone or inside a MultiConnector, and refusal of unsimulated connectors."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from pytest_pdserve.sim.app import AppState, build_app
from pytest_pdserve.sim.cli import parse_serve_args
from pytest_pdserve.sim.engine import Engine
from pytest_pdserve.sim.faults import SimEnv

from ._simproc import Factory, SimServer

OFFLOAD = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30}}
MULTI = {
    "kv_connector": "MultiConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"connectors": [{"kv_connector": "NixlConnector", "kv_role": "kv_both"}, OFFLOAD]},
}
LMCACHE = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
BLOCK_BYTES = 128 * 114_688  # Qwen/Qwen3-0.6B, bfloat16


def _samples(e: Engine) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in e.metrics.registry.collect():
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in {"model_name", "engine"}))
            out[(s.name, labels)] = s.value
    return out


@pytest.mark.parametrize("config", [OFFLOAD, MULTI], ids=["alone", "in-multiconnector"])
def test_cpu_tier_restores_blocks_evicted_from_the_gpu(config: dict[str, Any]) -> None:
    args = parse_serve_args(
        [
            "Qwen/Qwen3-0.6B",
            "--block-size",
            "128",
            "--kv-cache-memory-bytes",
            "268435456",
            "--kv-transfer-config",
            json.dumps(config),
        ]  # fmt: skip
    )
    e = Engine(args, SimEnv(), "CPU_ATTN")
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(AppState(engine=e))), base_url="http://s")

    async def complete(prompt: list[int]) -> str:
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])

    async def scenario() -> None:
        prompt = [9] * 300  # two full blocks
        first = await complete(prompt)
        m = _samples(e)
        assert m[("vllm:kv_offload_total_bytes_total", (("transfer_type", "GPU_to_CPU"),))] == 2 * BLOCK_BYTES
        assert m[("vllm:kv_offload_store_bytes_total", ())] == 2 * BLOCK_BYTES
        for i in range(10):  # 10 x 3 blocks through an 18-block GPU cache: the prompt's blocks are evicted
            await complete([200 + i] * 300)
        before = _samples(e)
        assert await complete(prompt) == first
        after = _samples(e)

        def delta(name: str, **labels: str) -> float:
            key = (name, tuple(sorted(labels.items())))
            return after.get(key, 0.0) - before.get(key, 0.0)

        assert delta("vllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU") == 2 * BLOCK_BYTES
        assert delta("vllm:kv_offload_load_bytes_total") == 2 * BLOCK_BYTES
        assert delta("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 256
        assert delta("vllm:prompt_tokens_by_source_total", source="local_compute") == 300 - 256
        assert delta("vllm:prompt_tokens_cached_by_source_total", source="host") == 256
        assert delta("vllm:prompt_tokens_cached_by_source_total", source="p2p") == 0
        assert delta("vllm:external_prefix_cache_hits_total") == 256

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"kv_connector": "ExampleConnector"}, "pdserve-sim does not simulate ExampleConnector"),
        (
            {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [LMCACHE]}},
            "pdserve-sim does not simulate LMCacheConnectorV1",
        ),
        ({"kv_connector": "OffloadingConnector"}, "cpu_bytes_to_use must be specified in kv_connector_extra_config"),
    ],
)  # fmt: skip
def test_unsimulated_connectors_are_refused(sim_factory: Factory, config: dict[str, Any], needle: str) -> None:
    server: SimServer = sim_factory("--kv-transfer-config", json.dumps(config))
    assert server.wait_exit() == 1
    assert needle in server.log()
