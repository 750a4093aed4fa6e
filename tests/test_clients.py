"""The plugin's clients: the per-test cache_salt goes where the prefix cache is read, never over a body's own
choice, and a timeout names the server and the request (against a real silent socket)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from _crossing import crossing_server

from pytest_pdserve import clients
from pytest_pdserve.cluster import ServerHandle
from pytest_pdserve.common.client_options import KEEPALIVE_EXPIRY_S
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
    with server._client or httpx.Client(timeout=60):
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


# -------------------------------------------------------------- idle connections: never reused past the keep-alive

#: Longer than the plugin's clients keep an idle connection, shorter than httpx's default (5 s). The idle time is
#: what is tested, so waiting it out is the condition itself.
IDLE_S = KEEPALIVE_EXPIRY_S + 0.5


def test_a_connection_idle_past_the_expiry_is_not_reused() -> None:
    """A CI run failed with 'Server disconnected without sending a response': httpx kept idle connections as long as
    uvicorn (5 s), so a request met the server's keep-alive close. The crossing server makes that moment certain:
    a plain httpx client loses it, the plugin's client (a new connection after KEEPALIVE_EXPIRY_S) does not."""
    body = {"prompt": "x", "max_tokens": 1}
    with crossing_server(close_after=KEEPALIVE_EXPIRY_S + 0.2) as server:
        with httpx.Client(base_url=server.url, trust_env=False, timeout=60) as plain:  # the control: the race is real
            plain.post("/v1/completions", json=body)
            time.sleep(IDLE_S)  # timing: the idle time under test (past it, whatever the load)
            with pytest.raises(httpx.RemoteProtocolError, match="Server disconnected"):
                plain.post("/v1/completions", json=body)
        with clients.make_client("decode-0 (crossing)", server.url, {}) as client:
            assert client.post("/v1/completions", json=body).status_code == 200
            time.sleep(IDLE_S)  # timing: the idle time under test (past it, whatever the load)
            assert client.post("/v1/completions", json=body).status_code == 200
        assert (server.answered, server.crossed) == (3, 1)


def test_an_async_client_does_not_reuse_an_idle_connection_either() -> None:
    body = {"prompt": "x", "max_tokens": 1}

    async def two_requests(url: str) -> list[int]:
        async with clients.make_async_client("decode-0 (crossing)", url, {}) as client:
            first = await client.post("/v1/completions", json=body)
            await asyncio.sleep(IDLE_S)  # timing: the idle time under test
            second = await client.post("/v1/completions", json=body)
        return [first.status_code, second.status_code]

    with crossing_server(close_after=KEEPALIVE_EXPIRY_S + 0.2) as server:
        assert asyncio.run(two_requests(server.url)) == [200, 200]
        assert server.crossed == 0
