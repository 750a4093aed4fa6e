"""The plugin's clients: the per-test cache_salt goes where the prefix cache is read, never over a body's own
choice, and a timeout names the server and the request (against a real silent socket)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from pytest_pdserve import clients
from pytest_pdserve.cluster import ServerHandle


@pytest.fixture
def sent() -> Iterator[tuple[httpx.Client, list[httpx.Request]]]:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"ok": True})

    client = clients.make_client("decode-0 (test)", "http://127.0.0.1:9", {}, inner=httpx.MockTransport(answer))
    yield client, seen
    client.close()


def _body(request: httpx.Request) -> dict[str, object]:
    body: dict[str, object] = json.loads(request.content)
    return body


def test_generation_requests_carry_the_current_salt(sent: tuple[httpx.Client, list[httpx.Request]]) -> None:
    client, seen = sent
    with clients.salted("pdserve-abc"):
        client.post("/v1/completions", json={"prompt": "x"})
        client.post("/v1/chat/completions", json={"messages": []})
        client.post("/tokenize", json={"prompt": "x"})  # reads no cache: untouched
        client.post("/v1/completions", json={"prompt": "x", "cache_salt": "team"})  # the body's own choice wins
        client.post("/v1/completions", json={"prompt": "x", "cache_salt": None})  # None: the unsalted cache
    with clients.salted(None):  # outside a test (or --pd-cache-salt=off): no salt
        client.post("/v1/completions", json={"prompt": "x"})
    salts = [_body(r).get("cache_salt", "-") for r in seen]
    assert salts == ["pdserve-abc", "pdserve-abc", "-", "team", None, "-"]
    assert seen[0].headers["content-length"] == str(len(seen[0].content))


def test_salt_for_is_per_test_and_valid_for_vllm() -> None:
    a, b = clients.salt_for("t.py::a", "s1"), clients.salt_for("t.py::b", "s1")
    assert a != b
    assert a == clients.salt_for("t.py::a", "s1")
    assert a != clients.salt_for("t.py::a", "s2")
    assert len(a) <= 128
    assert not set(a) & set("@/\\\x00")


def test_summarize_shortens_the_body() -> None:
    request = httpx.Request("POST", "http://h/v1/completions", json={"prompt": "w " * 100, "max_tokens": 4})
    text = clients.summarize(request)
    assert text.startswith('POST /v1/completions {"prompt": "w w w')
    assert '(202 chars), "max_tokens": 4}' in text


def test_a_timeout_names_the_server_and_the_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(clients.OPTIONS, "request_timeout", 0.3)
    monkeypatch.setattr(clients.OPTIONS, "timeout_remedy", "; raise it with --pd-request-timeout")
    with socket.socket() as silent:  # listens, never answers: the kernel completes the connect
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        server = ServerHandle("decode", 0, f"http://127.0.0.1:{silent.getsockname()[1]}")
        with pytest.raises(httpx.ReadTimeout) as exc_info:
            server.complete("hello there", max_tokens=2)
        server.close()
    message = str(exc_info.value)
    assert message.startswith(f"decode-0 ({server.url}) did not answer POST /v1/completions {{")
    assert '"prompt": "hello there"' in message
    assert "within 0.3 s (ReadTimeout); raise it with --pd-request-timeout" in message
