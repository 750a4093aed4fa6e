"""Reference P/D proxy for the proxy benchmark: vLLM's toy_proxy_server.py request flow, written here.

vLLM's toy proxy is FastAPI + one shared ``httpx.AsyncClient``. FastAPI is not installed in the dev venv,
so this is plain Starlette (FastAPI's base, one layer less, so if anything a slightly *faster* reference)
served by uvicorn the same way the built-in proxy is. Flow per request, like the toy proxy:

1. POST the body to prefill with ``kv_transfer_params`` {do_remote_decode: True, ...}, ``stream=False``,
   ``max_tokens=1`` (``max_completion_tokens=1`` if present), ``stream_options`` removed; read the JSON;
2. copy its ``kv_transfer_params`` into the original body;
3. stream the decode response back with ``client.stream("POST", ...)`` / ``aiter_bytes`` inside a
   ``StreamingResponse`` (the toy proxy streams for both JSON and SSE answers).

``python benchmarks/reference_proxy.py --port P --prefill URL --decode URL``
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def build(prefill: str, decode: str) -> Starlette:
    """The reference proxy app for one prefill and one decode server."""
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=None, limits=limits, trust_env=False) as client:
            state["client"] = client
            yield

    async def handle(request: Request) -> Response:
        client: httpx.AsyncClient = state["client"]
        route = request.url.path
        body = await request.json()
        headers = {"X-Request-Id": str(uuid.uuid4())}
        p_body = dict(body)
        p_body["kv_transfer_params"] = {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
        }  # fmt: skip
        p_body["stream"] = False
        p_body["max_tokens"] = 1
        if "max_completion_tokens" in p_body:
            p_body["max_completion_tokens"] = 1
        p_body.pop("stream_options", None)
        p_resp = await client.post(prefill + route, json=p_body, headers=headers)
        p_resp.raise_for_status()
        body["kv_transfer_params"] = p_resp.json().get("kv_transfer_params", {})

        async def relay() -> AsyncIterator[bytes]:
            async with client.stream("POST", decode + route, json=body, headers=headers) as d_resp:
                async for chunk in d_resp.aiter_bytes():
                    yield chunk

        return StreamingResponse(relay(), media_type="application/json")

    async def health(_request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    routes = [
        Route("/v1/completions", handle, methods=["POST"]),
        Route("/v1/chat/completions", handle, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    args = parser.parse_args()
    app = build(args.prefill.rstrip("/"), args.decode.rstrip("/"))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
