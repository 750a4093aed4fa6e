"""Runtime LoRA routes as vLLM serves them: only with VLLM_ALLOW_RUNTIME_LORA_UPDATING, only useful with --enable-lora.

The answers with ``--enable-lora`` are pinned against real vLLM by tests/reuse/test_reuse.py (``LORA_SCRIPT``, both
engines); these are the cases that need no adapter: the route gate, the env rule, and a server without LoRA.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from pytest_pdserve.sim.app import AppState, build_app
from pytest_pdserve.sim.cli import parse_serve_args
from pytest_pdserve.sim.faults import SimEnv


def _client(*args: str, runtime_lora: bool = True) -> httpx.AsyncClient:
    from pytest_pdserve.sim.engine import Engine

    e = Engine(parse_serve_args(["tiny-sim", *args]), SimEnv(runtime_lora_updating=runtime_lora), "CPU_ATTN")
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(AppState(engine=e))), base_url="http://s")


def test_lora_routes_exist_only_with_runtime_lora_updating(tmp_path: Path) -> None:
    async def run() -> None:
        client = _client("--enable-lora", runtime_lora=False)
        body = {"lora_name": "a", "lora_path": str(tmp_path)}
        assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 404
        assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})).status_code == 404

    asyncio.run(run())


@pytest.mark.parametrize(("value", "on"), [("1", True), ("true", True), ("TRUE", True), ("yes", False), ("0", False)])
def test_runtime_lora_updating_is_parsed_as_vllm_parses_it(value: str, on: bool) -> None:
    # vllm/envs.py: "1" or "true" (any case); "yes" is off there, not an error.
    assert SimEnv.from_environ({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}).runtime_lora_updating is on


def test_without_enable_lora_loading_fails_as_vllms_worker_does(tmp_path: Path) -> None:
    async def run() -> None:
        client = _client()
        r = await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path)})
        # Measured on vLLM for CPU 0.32 (the missing-path case answers the same: add_lora fails first).
        assert r.status_code == 500
        assert r.json()["error"] == {
            "message": "Call to add_lora method failed: Worker failed with error 'LoRA is not enabled. Use "
            "--enable-lora to enable LoRA.', please check the stack trace above for the root cause",
            "type": "InternalServerError", "param": None, "code": 500,
        }  # fmt: skip
        models = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models] == ["tiny-sim"]
        r = await client.post("/v1/completions", json={"model": "a", "prompt": [5], "max_tokens": 1})
        assert r.status_code == 404

    asyncio.run(run())


def test_a_loaded_adapter_is_served_by_name_until_unloaded(tmp_path: Path) -> None:
    async def run() -> None:
        client = _client("--enable-lora")
        assert (
            await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path)})
        ).status_code == 200
        r = await client.post(
            "/v1/chat/completions",
            json={"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        )
        assert r.status_code == 200
        assert r.json()["model"] == "a"
        unload = await client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert (unload.status_code, unload.text) == (200, "Success: LoRA adapter 'a' removed successfully.")
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == ["tiny-sim"]
        r = await client.post("/v1/completions", json={"model": "a", "prompt": [5], "max_tokens": 1})
        assert r.status_code == 404

    asyncio.run(run())


def test_careless_lora_and_model_fields_are_vllms_400s_not_crashes() -> None:
    # Measured on vLLM for CPU 0.32: pydantic refuses a non-string str field before any route logic runs.
    async def run() -> None:
        client = _client("--enable-lora")
        cases = [
            ("/v1/load_lora_adapter", {"lora_name": ["a"], "lora_path": "/x"}, "lora_name", "<list of 1 items>"),
            ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": {"p": 1}}, "lora_path", "<dict of 1 items>"),
            ("/v1/unload_lora_adapter", {"lora_name": 7}, "lora_name", "7"),
            ("/v1/completions", {"model": ["a"], "prompt": [5], "max_tokens": 1}, "model", "<list of 1 items>"),
            ("/v1/chat/completions", {"model": {"m": 1}, "messages": []}, "model", "<dict of 1 items>"),
        ]
        for route, body, key, shown in cases:
            r = await client.post(route, json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"] == {
                "message": f"1 validation error:\n  {{'type': 'string_type', 'loc': 'body.{key}', 'msg': 'Input "
                f"should be a valid string', 'input': '{shown}'}}",
                "type": "Bad Request", "param": f"body.{key}", "code": 400,
            }  # fmt: skip

    asyncio.run(run())
