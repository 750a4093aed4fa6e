"""Sleep mode routes as vLLM serves them: dev mode only; sleep pauses requests and drops the prefix cache."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from pytest_pdserve.sim.app import AppState, build_app
from pytest_pdserve.sim.cli import parse_serve_args
from pytest_pdserve.sim.engine import Engine
from pytest_pdserve.sim.faults import SimEnv


def _client(dev_mode: bool) -> tuple[Engine, httpx.AsyncClient]:
    e = Engine(parse_serve_args(["tiny-sim", "--enable-sleep-mode"]), SimEnv(dev_mode=dev_mode), "CPU_ATTN")
    return e, httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(AppState(engine=e))), base_url="http://s")


async def _warm(e: Engine, client: httpx.AsyncClient) -> tuple[dict[str, Any], Any]:
    """The same 40-token prompt twice: the second hits two 16-token blocks. Returns it and the hits counter."""
    body: dict[str, Any] = {"prompt": [5] * 40, "max_tokens": 2, "temperature": 0}
    for _ in range(2):
        assert (await client.post("/v1/completions", json=body)).status_code == 200
    return body, e.metrics.prefix_cache_hits.labels(**e.metrics.labels)


def test_sleep_routes_exist_only_in_dev_mode() -> None:
    async def run() -> None:
        _, client = _client(dev_mode=False)
        assert (await client.post("/sleep")).status_code == 404
        assert (await client.get("/is_sleeping")).status_code == 404

    asyncio.run(run())


def test_sleep_pauses_requests_until_wake_up_and_drops_the_cache() -> None:
    async def run() -> None:
        e, client = _client(dev_mode=True)
        body, hits = await _warm(e, client)
        assert hits._value.get() == 32  # warm: two 16-token blocks
        bad = await client.post("/sleep", params={"level": "3"})  # vLLM's 400 for a query FastAPI refused
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, "query.level")
        assert (await client.post("/sleep", params={"level": "1"})).json() == {"status": "sleeping", "level": 1}
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
        pending = asyncio.ensure_future(client.post("/v1/completions", json=body))
        await asyncio.sleep(0.2)  # timing: room for a request that is not held to finish; a held one cannot
        assert not pending.done()  # the scheduler is paused
        partial = await client.post("/wake_up", params={"tags": "weights"})
        assert partial.json() == {"status": "sleeping", "tags": ["weights"]}
        assert (await client.post("/wake_up")).json() == {"status": "awake", "tags": None}
        assert (await asyncio.wait_for(pending, 60)).status_code == 200
        assert hits._value.get() == 32  # level 1 discarded the KV cache: no new hit
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}
        text = e.metrics.render().decode()
        assert 'sleep_state="awake"} 1.0' in text

    asyncio.run(run())


def test_pause_queues_requests_until_resume_and_sleep_pauses_too() -> None:
    """vLLM 0.32's scheduler pause (dev mode's /pause, /resume, /is_paused): new requests wait; ``/is_sleeping``
    is true while paused; ``/sleep?level=0`` only pauses, ``/wake_up?tags=scheduling`` resumes (measured)."""

    async def run() -> None:
        e, client = _client(dev_mode=True)
        body, hits = await _warm(e, client)
        assert hits._value.get() == 32
        assert (await client.post("/pause", params={"clear_cache": "false"})).json() == {"status": "paused"}
        assert (await client.get("/is_paused")).json() == {"is_paused": True}
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
        pending = asyncio.ensure_future(client.post("/v1/completions", json=body))
        await asyncio.sleep(0.2)  # timing: room for a request that is not held to finish; a held one cannot
        assert not pending.done()  # queued behind the pause
        assert (await client.post("/resume")).json() == {"status": "resumed"}
        assert (await asyncio.wait_for(pending, 60)).status_code == 200
        assert hits._value.get() == 64  # clear_cache=false kept the prefix cache
        await client.post("/pause")  # clear_cache defaults to true
        await client.post("/resume")
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert hits._value.get() == 64  # the pause reset it: no hit
        assert (await client.post("/sleep", params={"level": "0"})).json() == {"status": "sleeping", "level": 0}
        assert (await client.get("/is_paused")).json() == {"is_paused": True}
        woke = await client.post("/wake_up", params={"tags": "scheduling"})
        assert woke.json() == {"status": "awake", "tags": ["scheduling"]}
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}
        assert (await client.get("/weight_info")).json() == {"weight_version": "default"}
        await client.post("/update_weight_version", json={"new_version": "rl-step-7"})
        assert (await client.get("/weight_info")).json() == {"weight_version": "rl-step-7"}

    asyncio.run(run())
