"""Prompts sized in tokens of the model actually served, not in words.

Block arithmetic (how many 128-token blocks a prompt spans, whether a decode-side hit is full or partial) depends
on the token count, and tokenizers differ wildly: the same English text is ~1 token per word for the simulator,
~1.3 for production models and ~5 for the tiny test Llama. `prompt_with_tokens` asks the server's own
``POST /tokenize`` (vLLM's route; it runs no engine step, so no cache or metric changes) and returns the shortest
prompt of a deterministic word sequence with at least ``n_tokens`` tokens.
"""

from __future__ import annotations

from typing import Any, Protocol

import httpx

from pytest_pdserve import clients

__all__ = ["count_tokens", "prompt_with_tokens", "words"]

#: A fixed vocabulary; `seed` rotates through it so different seeds give prompts with no common prefix.
VOCABULARY = [
    "red",
    "hat",
    "open",
    "source",
    "community",
    "cluster",
    "prefill",
    "decode",
    "cache",
    "block",
    "token",
    "transfer",
    "engine",
    "server",
    "request",
    "stream",
    "model",
    "kernel",
    "memory",
    "layer",
    "attention",
    "value",
    "key",
    "state",
    "scheduler",
    "worker",
    "proxy",
]
#: Bound on /tokenize calls per prompt (binary search over the word count).
MAX_PROBES = 24


class _Server(Protocol):
    @property
    def url(self) -> str: ...
    @property
    def client(self) -> httpx.Client: ...


def words(n_words: int, seed: int = 0) -> str:
    """``n_words`` words of the fixed vocabulary; equal seeds give prompts where one is a prefix of the other."""
    v = VOCABULARY
    return " ".join(v[(i * 7 + seed * 13 + i // len(v)) % len(v)] for i in range(n_words))


def _server_of(target: Any) -> _Server:
    prefill = getattr(target, "prefill", None)
    server: _Server = prefill[0] if prefill else target
    return server


def _model_of(target: Any, server: _Server) -> str:
    model = getattr(target, "model", None)
    if isinstance(model, str):
        return model
    ids = server.client.get("/v1/models").json()["data"]
    return str(ids[0]["id"])


def count_tokens(target: Any, prompt: str, *, model: str | None = None) -> tuple[int, int | None]:
    """``(tokens, max_model_len)`` of ``prompt`` on a cluster's first prefill server, or on a server."""
    server = _server_of(target)
    response = server.client.post("/tokenize", json={"model": model or _model_of(target, server), "prompt": prompt})
    if clients.request_failed(response):
        raise RuntimeError(
            f"POST {server.url}/tokenize -> {response.status_code}: {clients.body_excerpt(response.text)}"
        )
    data = response.json()
    return int(data["count"]), data.get("max_model_len")


def prompt_with_tokens(target: Any, n_tokens: int, *, seed: int = 0, prefix: str = "") -> str:
    """The shortest ``prefix + words(k, seed)`` whose token count on ``target`` is at least ``n_tokens``.

    :param target: a `PDCluster` (its first prefill server tokenizes) or one server handle.
    :param prefix: text the prompt must start with (a partial prefix-cache hit extends an earlier prompt).
    :raises ValueError: ``n_tokens`` does not fit the server's ``max_model_len``.
    """
    server = _server_of(target)
    model = _model_of(target, server)

    def count(k: int) -> int:
        text = (prefix + " " + words(k, seed)).strip() if k else prefix
        return count_tokens(server, text, model=model)[0]

    base, max_len = count_tokens(server, prefix or words(1, seed), model=model)
    if max_len is not None and n_tokens > int(max_len):
        raise ValueError(f"{n_tokens} tokens do not fit {server.url}: its max_model_len is {max_len}")
    lo, hi = 0, 8
    probes = 0
    while count(hi) < n_tokens:  # grow until long enough
        lo, hi = hi, hi * 2
        probes += 1
        if probes > MAX_PROBES:
            raise ValueError(f"could not reach {n_tokens} tokens on {server.url} within {MAX_PROBES} probes")
    while hi - lo > 1 and probes <= MAX_PROBES:  # smallest word count that reaches n_tokens
        mid = (lo + hi) // 2
        if count(mid) >= n_tokens:
            hi = mid
        else:
            lo = mid
        probes += 1
    return (prefix + " " + words(hi, seed)).strip()
