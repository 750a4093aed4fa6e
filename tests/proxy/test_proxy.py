"""The built-in P/D proxy, run as users run it (``python -m pytest_pdserve.proxy``) in front of
fake prefill/decode servers that record what they receive."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import json
import resource
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio.to_thread
import httpx
import pytest
import uvicorn
from _children import die_with_parent
from _crossing import crossing_server
from _hostile import MODEL, hostile_server
from _ports import free_port
from _trickle import TRICKLE_BYTES, TRICKLE_EVERY_S, trickler
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pytest_pdserve.common.client_options import KEEPALIVE_EXPIRY_S
from pytest_pdserve.common.deadline import MAX_BODY_BYTES
from pytest_pdserve.metrics import parse_metrics
from pytest_pdserve.proxy import PREFILL_KV_TRANSFER_PARAMS, ProxyConfig, create_app
from pytest_pdserve.proxy.__main__ import main as proxy_main

#: A process's start on a loaded machine (seconds), bounded far beyond it.
STARTUP_TIMEOUT = 120.0
#: A wait that ends in milliseconds, bounded for a loaded machine (tests/_timing_scan.py: BOUND_FLOOR_S).
BOUND_S = 30.0


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    raw: bytes


@dataclass
class FakeUpstream:
    """A fake vLLM server. Body fields ``x_fail``/``x_no_kv``/``x_wait_release`` steer it."""

    role: str
    name: str
    received: list[Received] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/completions", self.handle, methods=["POST"]),
                Route("/v1/chat/completions", self.handle, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
            ]
        )

    def kv_params(self) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.name,
            "remote_block_ids": [[1, 2, 3]],
            "remote_host": "localhost",
            "remote_port": 5559,
        }

    async def models(self, _request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "owned_by": self.name}]})

    async def handle(self, request: Request) -> Response:
        raw = await request.body()
        body = json.loads(raw)
        self.received.append(Received(request.url.path, dict(request.headers), body, raw))
        fail = body.get("x_fail", {}).get(self.role)
        if fail:
            return JSONResponse({"error": {"message": f"{self.name} refused", "code": fail}}, fail)
        if self.role == "prefill":
            answer: dict[str, Any] = {"id": "cmpl-p", "choices": [{"index": 0, "text": "X"}]}
            if not body.get("x_no_kv"):
                answer["kv_transfer_params"] = self.kv_params()
            return JSONResponse(answer)
        if body.get("stream"):
            return StreamingResponse(self.sse(body), media_type="text/event-stream")
        return JSONResponse({"id": "cmpl-d", "choices": [{"index": 0, "text": f"from {self.name}"}]})

    async def sse(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        yield b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
        released = None
        if body.get("x_wait_release"):
            # Only a proxy that forwards chunks as they come lets the client see chunk 1 and
            # release us; a buffering proxy makes this time out and report released=false.
            released = await anyio.to_thread.run_sync(self.release.wait, 10.0)
        yield b"data: " + json.dumps({"choices": [{"index": 0, "text": "b"}], "released": released}).encode()
        yield b"\n\ndata: [DONE]\n\n"


class ThreadedServer:
    """uvicorn in a thread, on a socket bound before start (no port race)."""

    def __init__(self, app: Starlette, *, lifespan: Literal["on", "off"] = "off") -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan=lifespan)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not self.server.started:
            assert self.thread.is_alive(), "fake server thread died during startup"
            assert time.monotonic() < deadline, f"fake server {self.url} did not start"
            time.sleep(0.005)
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@dataclass
class ProxyProcess:
    url: str
    log_path: Path
    proc: subprocess.Popen[bytes]

    def log(self) -> str:
        return self.log_path.read_text()


def start_proxy(tmp: Path, prefill: list[str], decode: list[str], *extra: str) -> ProxyProcess:
    port = free_port()
    argv = [sys.executable, "-m", "pytest_pdserve.proxy", "--port", str(port)]
    for url in prefill:
        argv += ["--prefill", url]
    for url in decode:
        argv += ["--decode", url]
    argv += list(extra)
    log_path = tmp / f"proxy-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"proxy exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return ProxyProcess(url, log_path, proc)
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"proxy not healthy after {STARTUP_TIMEOUT} s:\n{log_path.read_text()}")
        time.sleep(0.05)


def stop_proxy(proxy: ProxyProcess) -> None:
    proxy.proc.terminate()
    try:
        proxy.proc.wait(BOUND_S)
    except subprocess.TimeoutExpired:
        proxy.proc.kill()
        proxy.proc.wait(BOUND_S)


@dataclass
class Rig:
    prefill: list[FakeUpstream]
    decode: list[FakeUpstream]
    proxy: ProxyProcess
    client: httpx.Client

    def clear(self) -> None:
        for fake in self.prefill + self.decode:
            fake.received.clear()
            fake.release.clear()

    def got(self, fakes: list[FakeUpstream]) -> list[tuple[str, Received]]:
        return [(f.name, r) for f in fakes for r in f.received]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """Two fake prefill and two fake decode servers behind one proxy process."""
    fakes = [FakeUpstream("prefill", f"prefill-{i}") for i in range(2)]
    fakes += [FakeUpstream("decode", f"decode-{i}") for i in range(2)]
    servers = [ThreadedServer(f.app()) for f in fakes]
    for server in servers:
        server.__enter__()
    proxy = start_proxy(tmp_path_factory.mktemp("proxy"), [s.url for s in servers[:2]], [s.url for s in servers[2:]])
    try:
        with httpx.Client(base_url=proxy.url, timeout=30.0, trust_env=False) as client:
            yield Rig(fakes[:2], fakes[2:], proxy, client)
    finally:
        stop_proxy(proxy)
        for server in servers:
            server.__exit__()


@pytest.fixture
def fresh(rig: Rig) -> Rig:
    rig.clear()
    return rig


def test_prefill_request_is_one_token_with_kv_params_and_decode_gets_p_params(fresh: Rig) -> None:
    body = {
        "model": "m",
        "prompt": "Red Hat is",
        "max_tokens": 20,
        "min_tokens": 3,
        "temperature": 0,
    }
    resp = fresh.client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"].startswith("from decode-")

    [(p_name, p_got)] = fresh.got(fresh.prefill)
    [(d_name, d_got)] = fresh.got(fresh.decode)
    expected_p = {k: v for k, v in body.items() if k != "min_tokens"}
    expected_p.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS))
    assert p_got.body == expected_p
    assert p_got.path == "/v1/completions"
    # D gets the client's body (min_tokens included) plus the params P returned.
    p_fake = next(f for f in fresh.prefill if f.name == p_name)
    assert d_got.body == {**body, "kv_transfer_params": p_fake.kv_params()}

    request_id = p_got.headers["x-request-id"]
    assert d_got.headers["x-request-id"] == request_id
    assert uuid.UUID(request_id).version == 4
    assert resp.headers["x-request-id"] == request_id


def test_chat_route_caps_max_completion_tokens_and_drops_stream_options(fresh: Rig) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 50,
        "min_completion_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with fresh.client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        resp.read()
    [(_, p_got)] = fresh.got(fresh.prefill)
    assert p_got.path == "/v1/chat/completions"
    assert p_got.body["max_completion_tokens"] == 1
    assert p_got.body["max_tokens"] == 1
    assert p_got.body["stream"] is False
    assert "stream_options" not in p_got.body
    assert "min_completion_tokens" not in p_got.body
    [(_, d_got)] = fresh.got(fresh.decode)
    assert d_got.body["stream_options"] == {"include_usage": True}
    assert d_got.body["max_completion_tokens"] == 50


def test_round_robin_over_two_by_two(fresh: Rig) -> None:
    for _ in range(4):
        assert fresh.client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    assert [len(f.received) for f in fresh.prefill] == [2, 2]
    assert [len(f.received) for f in fresh.decode] == [2, 2]
    p_ids = sorted(r.headers["x-request-id"] for f in fresh.prefill for r in f.received)
    d_ids = sorted(r.headers["x-request-id"] for f in fresh.decode for r in f.received)
    assert p_ids == d_ids
    assert len(set(p_ids)) == 4


def test_round_robin_alternates_per_request(fresh: Rig) -> None:
    seen_p: list[str] = []
    seen_d: list[str] = []
    for _ in range(4):
        fresh.clear()
        assert fresh.client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        [(p_name, _)] = fresh.got(fresh.prefill)
        [(d_name, _)] = fresh.got(fresh.decode)
        seen_p.append(p_name)
        seen_d.append(d_name)
    assert seen_p[0] != seen_p[1]
    assert seen_p[0::2] == [seen_p[0]] * 2
    assert seen_p[1::2] == [seen_p[1]] * 2
    assert seen_d[0] != seen_d[1]
    assert seen_d[0::2] == [seen_d[0]] * 2
    assert seen_d[1::2] == [seen_d[1]] * 2


def test_streaming_is_passed_through_chunk_by_chunk(fresh: Rig) -> None:
    body = {"prompt": "x", "stream": True, "x_wait_release": True}
    with fresh.client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = resp.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] == "a"
        for fake in fresh.decode:
            fake.release.set()
        rest = [line for line in lines if line]
    second = json.loads(rest[0].removeprefix("data: "))
    assert second["released"] is True, "the proxy buffered the stream instead of relaying chunk 1"
    assert rest[-1] == "data: [DONE]"
    [(_, p_got)] = fresh.got(fresh.prefill)
    assert p_got.body["stream"] is False


def test_prefill_http_error_is_passed_through(fresh: Rig) -> None:
    resp = fresh.client.post("/v1/completions", json={"prompt": "x", "x_fail": {"prefill": 400}})
    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": resp.json()["error"]["message"], "code": 400}}
    assert resp.json()["error"]["message"].endswith("refused")
    assert fresh.got(fresh.decode) == [], "decode must not be called after a prefill error"


def test_decode_http_error_is_passed_through(fresh: Rig) -> None:
    resp = fresh.client.post("/v1/completions", json={"prompt": "x", "x_fail": {"decode": 422}})
    assert resp.status_code == 422
    assert resp.json()["error"]["message"].startswith("decode-")


def test_without_kv_params_decode_gets_client_bytes_untouched(fresh: Rig) -> None:
    raw = b'{"prompt": "x",   "x_no_kv": true}'
    resp = fresh.client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 200
    [(_, d_got)] = fresh.got(fresh.decode)
    assert d_got.raw == raw


def test_client_authorization_is_forwarded(fresh: Rig) -> None:
    resp = fresh.client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer abc"})
    assert resp.status_code == 200
    for _, got in fresh.got(fresh.prefill) + fresh.got(fresh.decode):
        assert got.headers["authorization"] == "Bearer abc"


def test_bad_json_is_a_400_naming_the_problem(fresh: Rig) -> None:
    resp = fresh.client.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert "not valid JSON" in resp.json()["error"]["message"]
    assert fresh.got(fresh.prefill) == []


def test_health_models_and_healthcheck(rig: Rig) -> None:
    for path in ("/health", "/healthcheck"):
        resp = rig.client.get(path)
        assert resp.json() == {"status": "ok", "prefill_instances": 2, "decode_instances": 2}
    assert rig.client.get("/v1/models").json()["data"][0]["id"] == "fake-model"


def test_metrics_count_requests_and_latency(fresh: Rig) -> None:
    before = parse_metrics(fresh.client.get("/metrics").text)
    fresh.client.post("/v1/completions", json={"prompt": "x"})
    fresh.client.post("/v1/completions", json={"prompt": "x", "x_fail": {"prefill": 400}})
    after = parse_metrics(fresh.client.get("/metrics").text)
    delta = after - before
    route = "/v1/completions"
    assert delta.value("pdserve_proxy_requests_total", route=route, status="200") == 1
    assert delta.value("pdserve_proxy_requests_total", route=route, status="400") == 1
    assert delta.value("pdserve_proxy_request_duration_seconds_count", route=route) == 2
    assert delta.value("pdserve_proxy_upstream_errors_total", role="prefill") == 1
    assert delta.value("pdserve_proxy_upstream_requests_total", role="decode") == 1


def test_one_log_line_per_request(fresh: Rig) -> None:
    resp = fresh.client.post("/v1/completions", json={"prompt": "x"})
    request_id = resp.headers["x-request-id"]
    deadline = time.monotonic() + BOUND_S
    lines: list[str] = []
    while time.monotonic() < deadline:
        # The line is written before the response completes, but the file is read by another process.
        lines = [line for line in fresh.proxy.log().splitlines() if request_id in line]
        if lines:
            break
        time.sleep(0.01)
    assert len(lines) == 1
    assert "status=200" in lines[0]
    assert "prefill=http://127.0.0.1:" in lines[0]
    assert "decode=http://127.0.0.1:" in lines[0]
    assert "total_ms=" in lines[0]


def test_prefill_down_gives_502_naming_prefill(tmp_path: Path) -> None:
    decode = FakeUpstream("decode", "decode-0")
    # A bound but not listening socket: connections are refused, and nobody can take the port.
    with socket.socket() as dead, ThreadedServer(decode.app()) as d_server:
        dead.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
        proxy = start_proxy(tmp_path, [dead_url], [d_server.url])
        try:
            resp = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
            metrics = parse_metrics(httpx.get(proxy.url + "/metrics", timeout=60).text)
        finally:
            stop_proxy(proxy)
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert error["role"] == "prefill"
    assert error["url"] == dead_url
    assert error["message"].startswith(f"prefill server {dead_url} failed: ConnectError")
    assert decode.received == []
    assert metrics.value("pdserve_proxy_upstream_errors_total", role="prefill", kind="connection") == 1


def test_api_key_replaces_client_authorization() -> None:
    fakes = [FakeUpstream("prefill", "p"), FakeUpstream("decode", "d")]
    with ThreadedServer(fakes[0].app()) as p, ThreadedServer(fakes[1].app()) as d:
        config = ProxyConfig((p.url,), (d.url,), api_key="KEY", log=io.StringIO())
        with ThreadedServer(create_app(config), lifespan="on") as proxy:
            resp = httpx.post(
                proxy.url + "/v1/completions",
                json={"prompt": "x"},
                headers={"Authorization": "Bearer other"},
                timeout=60,
            )
    assert resp.status_code == 200
    assert [f.received[0].headers["authorization"] for f in fakes] == ["Bearer KEY", "Bearer KEY"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "1", "--prefill", "localhost:8100", "--decode", "http://h:1"], "'localhost:8100'"),
        (["--port", "1", "--prefill", "http://h:1"], "--decode"),
        (["--port", "70000", "--prefill", "http://h:1", "--decode", "http://h:2"], "--port 70000"),
    ],
)
def test_cli_rejects_bad_arguments(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        proxy_main(argv)
    assert exc_info.value.code == 2
    assert message in capsys.readouterr().err


class _FullDisk(io.StringIO):
    """A log whose writes fail as under ``ulimit -f`` (Python ignores SIGXFSZ, so write raises EFBIG)."""

    def write(self, text: str) -> int:
        raise OSError(errno.EFBIG, "File too large")


def test_a_failing_log_write_never_changes_an_answer() -> None:
    """Issue 25 class 6: a proxy whose own log write failed turned a request that succeeded into a 500."""
    fakes = [FakeUpstream("prefill", "p"), FakeUpstream("decode", "d")]
    with ThreadedServer(fakes[0].app()) as p, ThreadedServer(fakes[1].app()) as d:
        config = ProxyConfig((p.url,), (d.url,), log=_FullDisk())
        with ThreadedServer(create_app(config), lifespan="on") as proxy:
            resp = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, timeout=60)
            metrics = httpx.get(proxy.url + "/metrics", timeout=60).text
    assert resp.status_code == 200, resp.text
    assert len(fakes[1].received) == 1
    assert "pdserve_proxy_log_write_failures_total 1.0" in metrics


def _nofile(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no 'Max open files' in /proc/{pid}/limits")


def _low_soft_limit() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))


@pytest.mark.parametrize("program", ["proxy", "sim"])
def test_proxy_and_simulator_raise_their_soft_open_files_limit(program: str, tmp_path: Path) -> None:
    """vLLM lifts its soft RLIMIT_NOFILE at start; at 1024, 969 of 1000 concurrent requests through the proxy were
    502 ConnectError. Both start here with a soft limit of 256 and must serve with the hard limit."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard limit here is {hard}: nothing to raise")
    port = free_port()
    if program == "proxy":
        argv = [sys.executable, "-m", "pytest_pdserve.proxy", "--port", str(port), "--prefill", "http://127.0.0.1:9",
                "--decode", "http://127.0.0.1:9"]  # fmt: skip
    else:
        argv = [sys.executable, "-m", "pytest_pdserve.sim", "serve", "tiny-sim", "--port", str(port)]
    with (tmp_path / "out.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_low_soft_limit)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            assert proc.poll() is None, (tmp_path / "out.log").read_text()
            with contextlib.suppress(httpx.TransportError):
                path = "/healthcheck" if program == "proxy" else "/health"  # the proxy's own, upstreams down
                if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=1.0).status_code == 200:
                    break
            assert time.monotonic() < deadline, (tmp_path / "out.log").read_text()
            time.sleep(0.05)
        soft, hard_now = _nofile(proc.pid)
        assert soft == hard_now > 256
    finally:
        proc.kill()
        proc.wait(BOUND_S)


@pytest.mark.parametrize("stalled", ["prefill", "decode"])
def test_an_upstream_that_trickles_its_answer_gets_a_502_within_the_upstream_timeout(
    tmp_path: Path, stalled: str
) -> None:
    # httpx's timeouts are per read (and the proxy had none): a trickled answer held the client forever.
    other = FakeUpstream("decode" if stalled == "prefill" else "prefill", "other-0")
    with trickler() as slow, ThreadedServer(other.app()) as fine:
        prefill, decode = ([slow], [fine.url]) if stalled == "prefill" else ([fine.url], [slow])
        proxy = start_proxy(tmp_path, prefill, decode, "--upstream-timeout", "1")
        try:
            started = time.monotonic()
            resp = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, timeout=240)
            elapsed = time.monotonic() - started
        finally:
            stop_proxy(proxy)
    assert resp.status_code == 502, resp.text
    assert resp.json()["error"]["role"] == stalled
    assert "no complete answer within 1s" in resp.json()["error"]["message"]
    assert elapsed < TRICKLE_BYTES * TRICKLE_EVERY_S / 10, elapsed  # 60 s; the trickle itself would take 600 s


def test_the_proxy_does_not_reuse_an_upstream_connection_idle_past_the_expiry() -> None:
    """The proxy's upstream pool drops idle connections as the plugin's clients do (config/bounds.py): a
    connection idle past KEEPALIVE_EXPIRY_S may be one the server is closing at that moment."""
    with crossing_server(close_after=KEEPALIVE_EXPIRY_S + 0.2) as p, crossing_server(KEEPALIVE_EXPIRY_S + 0.2) as d:
        config = ProxyConfig((p.url,), (d.url,), log=io.StringIO())
        with ThreadedServer(create_app(config), lifespan="on") as proxy:
            body = {"prompt": "x", "max_tokens": 1}
            codes = [httpx.post(proxy.url + "/v1/completions", json=body, timeout=60).status_code]
            time.sleep(KEEPALIVE_EXPIRY_S + 0.5)  # timing: the idle time is the condition tested
            codes.append(httpx.post(proxy.url + "/v1/completions", json=body, timeout=60).status_code)
    assert codes == [200, 200]
    assert (p.crossed, d.crossed) == (0, 0)
    assert (p.answered, d.answered) == (2, 2)


@pytest.mark.parametrize("fault", ["no-listener", "no-answer"])
def test_a_failed_warm_up_never_stops_the_proxy(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """The proxy sends one request over a throwaway loopback server before it serves (app.py: the first proxied
    request paid ~15 ms of first-use costs inside the cluster's start). Whatever goes wrong there, it serves; and
    the warm-up did run before the first request (``tried``), so this fails if it is removed too."""
    import pytest_pdserve.proxy.app as proxy_app

    tried: list[str] = []
    if fault == "no-listener":

        async def refuse(*_a: object, **_k: object) -> None:
            tried.append("listen")
            raise OSError(98, "Address already in use")

        monkeypatch.setattr(asyncio, "start_server", refuse)
    else:  # a listener that never answers: the warm-up's own bound ends it
        monkeypatch.setattr(proxy_app, "WARM_UP_TIMEOUT_S", 0.2)
        real_start = asyncio.start_server

        async def silent(_cb: object, *args: Any, **kwargs: Any) -> asyncio.Server:
            async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                tried.append("request")
                await reader.read()  # until the warm-up client gives up and closes
                writer.close()

            return await real_start(hold, *args, **kwargs)

        monkeypatch.setattr(asyncio, "start_server", silent)
    fakes = [FakeUpstream("prefill", "p"), FakeUpstream("decode", "d")]
    with ThreadedServer(fakes[0].app()) as p, ThreadedServer(fakes[1].app()) as d:
        config = ProxyConfig((p.url,), (d.url,), log=io.StringIO())
        with ThreadedServer(create_app(config), lifespan="on") as proxy:
            warmed = list(tried)  # before any request reached the proxy
            resp = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, timeout=60)
    assert warmed == ["listen" if fault == "no-listener" else "request"]
    assert resp.status_code == 200
    assert [len(f.received) for f in fakes] == [1, 1]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_proxy_bounds_what_it_buffers_from_a_hostile_upstream(tmp_path: Path, role: str) -> None:
    """Issue 43, class 4: the prefill answer and a JSON decode answer are buffered, so bounded (a 502 naming the
    server); the model list through the proxy still works when only completions are hostile."""
    fine = FakeUpstream("decode" if role == "prefill" else "prefill", "fine-0")
    with hostile_server({"/v1/completions": "endless"}) as hostile, ThreadedServer(fine.app()) as other:
        prefill, decode = ([hostile.url], [other.url]) if role == "prefill" else ([other.url], [hostile.url])
        proxy = start_proxy(tmp_path, prefill, decode)
        try:
            resp = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, timeout=120)
            models = httpx.get(proxy.url + "/v1/models", timeout=120) if role == "decode" else None
        finally:
            stop_proxy(proxy)
    assert resp.status_code == 502, resp.text
    error = resp.json()["error"]
    assert (error["role"], error["type"]) == (role, "upstream_too_large")
    assert f"{hostile.url}/v1/completions sent more than {MAX_BODY_BYTES} bytes" in error["message"]
    assert hostile.requests["/v1/completions"] == 1
    assert hostile.sent["/v1/completions"] <= MAX_BODY_BYTES + (32 << 20)
    if models is not None:
        assert models.status_code == 200
        assert models.json()["data"][0]["id"] == MODEL


def test_the_proxy_passes_a_stream_longer_than_the_bound_through(tmp_path: Path) -> None:
    """Bound what is buffered, not what is passed through: an SSE answer of MAX + 16 MiB reaches the client whole."""
    chunk = b"data: " + json.dumps({"choices": [{"index": 0, "text": "x" * 65000}]}).encode() + b"\n\n"
    count = (MAX_BODY_BYTES + (16 << 20)) // len(chunk) + 1

    async def sse(_request: Request) -> Response:
        async def body() -> AsyncIterator[bytes]:
            for _ in range(count):
                yield chunk

        return StreamingResponse(body(), media_type="text/event-stream")

    prefill = FakeUpstream("prefill", "prefill-0")
    decode = Starlette(routes=[Route("/v1/completions", sse, methods=["POST"])])
    with ThreadedServer(prefill.app()) as p, ThreadedServer(decode) as d:
        proxy = start_proxy(tmp_path, [p.url], [d.url])
        try:
            received = 0
            body = {"prompt": "x", "stream": True}
            with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=120) as resp:
                assert resp.status_code == 200
                for piece in resp.iter_raw():
                    received += len(piece)
        finally:
            stop_proxy(proxy)
    assert received == count * len(chunk) > MAX_BODY_BYTES
