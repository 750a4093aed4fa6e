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
from pytest_pdserve.errors import RequestFailed


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


# --------------------------------------------------------------------------- one failure rule for every complete()


def _both_completes(status: int, body: str) -> list[tuple[str, Exception | None]]:
    """Send one completion through ``ServerHandle.complete`` and ``assertions.complete`` against a server that
    answers ``status`` with ``body``: (which, the exception or None) for each."""
    from pytest_pdserve import assertions

    def answer(request: httpx.Request) -> httpx.Response:
        if status == 200:
            return httpx.Response(200, json={"choices": [{"text": "ok"}]})
        return httpx.Response(status, text=body, headers={"location": "http://127.0.0.1:9/elsewhere"})

    results: list[tuple[str, Exception | None]] = []
    inner = httpx.MockTransport(answer)
    server = ServerHandle(
        "decode",
        0,
        "http://127.0.0.1:9",
        _client=clients.make_client("decode-0", "http://127.0.0.1:9", {}, inner=inner),
    )
    with server._client or httpx.Client():
        for which, call in (
            ("ServerHandle.complete", lambda: server.complete("x", max_tokens=1)),
            ("assertions.complete", lambda: assertions.complete(server, {"prompt": "x", "max_tokens": 1})),
            ("assertions.complete stream", lambda: assertions.complete(server, {"prompt": "x", "stream": True})),
        ):
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - the test compares what each raised
                results.append((which, exc))
            else:
                results.append((which, None))
    return results


@pytest.mark.parametrize("status", [201, 204, 302, 400, 503])
def test_every_complete_fails_on_any_status_but_200(status: int) -> None:
    """One rule (``clients.request_failed``): vLLM answers 200 on success, so a 201, an empty 204 or a redirect is a
    failure too; ``assertions.complete`` used to take anything under 400 as an answer."""
    for which, exc in _both_completes(status, "engine said no"):
        assert isinstance(exc, RequestFailed), f"{which}: {exc!r}"
        assert isinstance(exc, AssertionError), which  # pytest reports a failed test
        assert exc.status == status, which
        assert "engine said no" in str(exc) or status == 204, which


def test_every_complete_quotes_the_same_length_of_body() -> None:
    body = "x" * (clients.BODY_EXCERPT_CHARS * 3)
    quoted = {which: str(exc).count("x" * 10) * 10 for which, exc in _both_completes(500, body)}
    assert quoted == dict.fromkeys(quoted, clients.BODY_EXCERPT_CHARS), quoted


def test_200_is_an_answer_for_every_complete() -> None:
    assert [exc for _, exc in _both_completes(200, "")] == [None, None, None]
