"""Requests and responses: POSTing a completion/chat request and normalising its first choice.

:func:`complete` sends a request (JSON or SSE streaming) and returns a :class:`Completion` with text,
token ids, tokens and logprobs in one shape for both endpoints and both response formats. The
assertions fill in deterministic defaults (:func:`with_defaults`) and ask for token ids and top
logprobs (:func:`complete_with_extras`) so a divergence can name the token. Pytest-free; the
public names are re-exported by :mod:`pytest_pdserve.assertions`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from pytest_pdserve.assertions._measure import ServerLike as ServerHandle
from pytest_pdserve.clients import body_excerpt, request_failed
from pytest_pdserve.errors import RequestFailed

REQUEST_FAILED_MESSAGE = "request to {target} ({path}) failed with HTTP {status}: {body}"

DEFAULT_TOP_LOGPROBS = 5
DEFAULT_MAX_TOKENS = 16
DEFAULT_SEED = 0


@dataclass(frozen=True)
class Completion:
    """The first choice of a completion/chat response, normalised.

    ``token_ids``/``top_logprobs`` are ``None`` when the server did not return them.
    """

    text: str
    token_ids: tuple[int, ...] | None = None
    tokens: tuple[str, ...] | None = None
    top_logprobs: tuple[Mapping[str, float], ...] | None = None
    token_logprobs: tuple[float | None, ...] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    source: str = ""
    raw: Any = field(default=None, repr=False, compare=False)

    def top1_logprob(self, index: int) -> float | None:
        """The best logprob at *index* (top_logprobs, else the chosen token's logprob)."""
        if self.top_logprobs is not None and index < len(self.top_logprobs) and self.top_logprobs[index]:
            return max(self.top_logprobs[index].values())
        if self.token_logprobs is not None and index < len(self.token_logprobs):
            return self.token_logprobs[index]
        return None


def _endpoint(request: Mapping[str, Any], endpoint: str | None) -> str:
    if endpoint is not None:
        return endpoint
    return "/v1/chat/completions" if "messages" in request else "/v1/completions"


def with_defaults(request: Mapping[str, Any], model: str | None, *, determinism: bool) -> dict[str, Any]:
    if not isinstance(request, Mapping):
        raise TypeError(f"request must be a JSON object (dict), got {type(request).__name__}: {request!r}")
    out = dict(request)
    if model is not None:
        out.setdefault("model", model)
    out.setdefault("temperature", 0)
    if "max_tokens" not in out and "max_completion_tokens" not in out:
        out["max_tokens"] = DEFAULT_MAX_TOKENS
    if determinism:
        out.setdefault("seed", DEFAULT_SEED)
    return out


def _determinism_extras(request: Mapping[str, Any]) -> dict[str, Any]:
    """Fields asking for token ids and top logprobs (vLLM 0.32+ knows ``return_token_ids``)."""
    extras: dict[str, Any] = {}
    if "return_token_ids" not in request:
        extras["return_token_ids"] = True
    if "messages" in request:
        if "logprobs" not in request and "top_logprobs" not in request:
            extras.update(logprobs=True, top_logprobs=DEFAULT_TOP_LOGPROBS)
    elif "logprobs" not in request:
        extras["logprobs"] = DEFAULT_TOP_LOGPROBS
    return extras


def _client_of(target: ServerHandle | httpx.Client) -> tuple[httpx.Client, str]:
    if isinstance(target, httpx.Client):
        return target, str(target.base_url)
    return target.client, f"{target.name} ({target.url})"


def complete(
    target: ServerHandle | httpx.Client,
    request: Mapping[str, Any],
    *,
    endpoint: str | None = None,
) -> Completion:
    """POST *request* to *target* (``/v1/completions``, or chat when it has ``messages``).

    Streaming requests (``"stream": true``) are collected from their SSE events.

    :raises RequestFailed: (an ``AssertionError``) on any answer but HTTP 200 (``clients.request_failed``, the rule
        ``ServerHandle.complete`` follows too), naming the target and status.
    :raises AssertionError: on an error event mid-stream, or an answer without choices.
    """
    __tracebackhide__ = True
    client, label = _client_of(target)
    path = _endpoint(request, endpoint)
    if request.get("stream"):
        with client.stream("POST", path, json=dict(request)) as resp:
            if request_failed(resp):
                resp.read()
                _request_failed(label, path, resp)
            return _from_sse(resp.iter_lines(), label)
    resp = client.post(path, json=dict(request))
    if request_failed(resp):
        _request_failed(label, path, resp)
    return from_json(resp.json(), label)


def _request_failed(label: str, path: str, resp: httpx.Response) -> None:
    __tracebackhide__ = True
    raise RequestFailed(
        REQUEST_FAILED_MESSAGE.format(target=label, path=path, status=resp.status_code, body=body_excerpt(resp.text)),
        resp.status_code,
    )


def _logprob_fields(
    logprobs: Any,
) -> tuple[tuple[str, ...] | None, tuple[float | None, ...] | None, tuple[Mapping[str, float], ...] | None]:
    if not isinstance(logprobs, Mapping):
        return None, None, None
    tokens: tuple[str, ...] | None
    chosen: tuple[float | None, ...] | None
    top: tuple[Mapping[str, float], ...] | None
    if "content" in logprobs:  # chat format
        content = logprobs.get("content") or []
        tokens = tuple(str(c.get("token", "")) for c in content)
        chosen = tuple(c.get("logprob") for c in content)
        top = tuple(
            {str(t.get("token", "")): float(t.get("logprob")) for t in (c.get("top_logprobs") or [])} for c in content
        )
        return tokens, chosen, (top if any(top) else None)
    tokens_raw = logprobs.get("tokens")
    tokens = tuple(tokens_raw) if tokens_raw is not None else None
    chosen_raw = logprobs.get("token_logprobs")
    chosen = tuple(chosen_raw) if chosen_raw is not None else None
    top_raw = logprobs.get("top_logprobs")
    top = tuple(dict(t or {}) for t in top_raw) if top_raw is not None else None
    return tokens, chosen, top


def from_json(data: Any, label: str) -> Completion:
    """The first choice of a completion/chat response's JSON as a :class:`Completion` (*label* names its source)."""
    __tracebackhide__ = True
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError) as exc:
        raise AssertionError(f"{label} returned no choices: {body_excerpt(json.dumps(data))}") from exc
    message = choice.get("message")
    text = message.get("content") if isinstance(message, Mapping) else choice.get("text")
    tokens, chosen, top = _logprob_fields(choice.get("logprobs"))
    token_ids = choice.get("token_ids")
    usage = data.get("usage") or {}
    return Completion(
        text=text or "",
        token_ids=tuple(token_ids) if token_ids is not None else None,
        tokens=tokens,
        top_logprobs=top,
        token_logprobs=chosen,
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        finish_reason=choice.get("finish_reason"),
        source=label,
        raw=data,
    )


def _from_sse(lines: Iterable[str], label: str) -> Completion:
    __tracebackhide__ = True
    text: list[str] = []
    ids: list[int] = []
    saw_ids = False
    tokens: list[str] = []
    chosen: list[float | None] = []
    top: list[Mapping[str, float]] = []
    usage: Mapping[str, Any] = {}
    finish: str | None = None
    events: list[Any] = []
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        event = json.loads(payload)
        events.append(event)
        if "error" in event:
            raise AssertionError(f"{label} sent an error event mid-stream: {body_excerpt(payload)}")
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, Mapping) else choice.get("text")
            text.append(piece or "")
            if choice.get("token_ids") is not None:
                saw_ids = True
                ids.extend(choice["token_ids"])
            t, c, tp = _logprob_fields(choice.get("logprobs"))
            tokens.extend(t or ())
            chosen.extend(c or ())
            top.extend(tp or ())
            finish = choice.get("finish_reason") or finish
    return Completion(
        text="".join(text),
        token_ids=tuple(ids) if saw_ids else None,
        tokens=tuple(tokens) if tokens else None,
        top_logprobs=tuple(top) if top else None,
        token_logprobs=tuple(chosen) if chosen else None,
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        finish_reason=finish,
        source=label,
        raw=events,
    )


def complete_with_extras(
    target: ServerHandle | httpx.Client, request: Mapping[str, Any], endpoint: str | None
) -> Completion:
    """Ask for token ids and logprobs; a server that rejects those fields gets the plain request."""
    __tracebackhide__ = True
    extras = _determinism_extras(request)
    if not extras:
        return complete(target, request, endpoint=endpoint)
    try:
        return complete(target, {**request, **extras}, endpoint=endpoint)
    except RequestFailed as exc:
        if exc.status not in (400, 422):
            raise
    return complete(target, request, endpoint=endpoint)
