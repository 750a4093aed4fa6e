"""Time is bounded, and so is size (issue 43, class 4): no answer the plugin or its proxy reads from a server is
read past ``MAX_BODY_BYTES`` (common/deadline.py), and an answer over it is a clear error that nothing retries.

The attacker is a hostile HTTP server (tests/_hostile.py): an endless body, a content-length of 10 GiB, a gzip
bomb, a 1 MiB header line. It counts what it managed to send, so "bounded" is measured where the bytes come from.
The doors: every reader of the plugin (a check's GET, a client's stream, a request helper, the readiness poll,
the attach check from argv, env and ini) and the built-in proxy's buffers against a hostile prefill or decode.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from _hostile import Hostile, hostile_server

from pytest_pdserve import metrics
from pytest_pdserve.clients import make_client
from pytest_pdserve.cluster import ServerHandle
from pytest_pdserve.common.deadline import MAX_BODY_BYTES, get_within
from pytest_pdserve.errors import ResponseTooLarge
from pytest_pdserve.running import attach, readiness
from pytest_pdserve.running.readiness import ReadinessCheck, readiness_client

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

#: What a client that stops at the bound can have made the server send: the bound plus socket buffers.
SLACK = 32 << 20
LIMIT_TEXT = f"sent more than {MAX_BODY_BYTES} bytes (64 MiB)"


def _bounded(hostile: Hostile, path: str) -> None:
    assert hostile.requests[path] == 1, f"{path} was asked {hostile.requests[path]} times: read again"
    assert hostile.sent[path] <= MAX_BODY_BYTES + SLACK, f"{hostile.sent[path]} bytes of {path} were sent"


@pytest.fixture
def endless_metrics() -> Iterator[Hostile]:
    with hostile_server({"/metrics": "endless"}) as hostile:
        yield hostile


# --------------------------------------------------------------------------------------- every reader, unit by unit


def test_a_check_reading_an_endless_body_stops_at_the_bound(endless_metrics: Hostile) -> None:
    with pytest.raises(ResponseTooLarge) as info:
        get_within(None, f"{endless_metrics.url}/metrics", 120.0)
    assert str(info.value).startswith(f"{endless_metrics.url}/metrics {LIMIT_TEXT}")
    _bounded(endless_metrics, "/metrics")


def test_a_scrape_of_an_endless_metrics_is_no_scrape_error_to_swallow(endless_metrics: Hostile) -> None:
    """ResponseTooLarge is neither a MetricsScrapeError nor an httpx.HTTPError: no best-effort handler of those
    takes it for a missing metric and reads again."""
    with pytest.raises(ResponseTooLarge):
        metrics.scrape(endless_metrics.url, timeout=120.0)
    assert not issubclass(ResponseTooLarge, (httpx.HTTPError, metrics.MetricsScrapeError))
    _bounded(endless_metrics, "/metrics")


def test_a_stream_through_a_plugin_client_is_bounded(endless_metrics: Hostile) -> None:
    """A test's own ``client.stream`` through a handed-out client (no deadline: httpx's own timeouts)."""
    with make_client("prefill-0", endless_metrics.url, {}) as client, client.stream("GET", "/metrics") as response:
        assert response.status_code == 200
        with pytest.raises(ResponseTooLarge, match="sent more than"):
            for _ in response.iter_bytes():
                pass
    _bounded(endless_metrics, "/metrics")


def test_an_async_client_handed_out_is_bounded(endless_metrics: Hostile) -> None:
    """``ServerHandle.async_client()``: the same bound as the sync clients."""
    server = ServerHandle("decode", 0, endless_metrics.url, None)

    async def read() -> None:
        async with server.async_client() as client:
            response = await client.get("/metrics")
            raise AssertionError(f"read {len(response.content)} bytes whole")

    with pytest.raises(ResponseTooLarge, match="sent more than"):
        asyncio.run(read())
    _bounded(endless_metrics, "/metrics")


def test_a_request_helper_is_bounded() -> None:
    """``ServerHandle.complete`` (what the P/D-ready round trip and tests call) against an endless completion."""
    with hostile_server({"/v1/completions": "endless"}) as hostile:
        server = ServerHandle("decode", 0, hostile.url, None)
        try:
            with pytest.raises(ResponseTooLarge):
                server.complete("hi", max_tokens=1)
        finally:
            server.close()
    _bounded(hostile, "/v1/completions")


def test_the_readiness_poll_fails_instead_of_polling_an_endless_health_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The readiness poll retries every httpx error; an answer over the bound is not one, so it is asked once."""
    # A poll's own 0.5 s ends a request that a loaded machine has not yet streamed 64 MiB into: that is a timeout
    # (retried), not the bound under test. The bound must be reached whatever the machine's speed.
    monkeypatch.setattr(readiness, "REQUEST_TIMEOUT", 120.0)
    with hostile_server({"/health": "endless"}) as hostile, readiness_client() as client:
        check = ReadinessCheck(f"{hostile.url}/health", None, None, None)
        with pytest.raises(ResponseTooLarge):
            check.check(client)
    _bounded(hostile, "/health")


@pytest.mark.parametrize(
    ("behaviour", "why"),
    [("declared", "its content-length says 10737418240"), ("gzip", "an answer encoded 'gzip', which pdserve did not")],
)
def test_a_body_that_cannot_be_bounded_is_refused_before_it_is_read(behaviour: str, why: str) -> None:
    with hostile_server({"/metrics": behaviour}) as hostile:
        with pytest.raises(ResponseTooLarge, match=why):
            get_within(None, f"{hostile.url}/metrics", 60.0)
        with make_client("decode-0", hostile.url, {}) as client, pytest.raises(ResponseTooLarge, match=why):
            client.get("/metrics")
    assert hostile.requests["/metrics"] == 2


def test_the_plugin_asks_for_no_encoding() -> None:
    with hostile_server({}) as hostile, make_client("decode-0", hostile.url, {}) as client:
        assert client.get("/health").request.headers["accept-encoding"] == "identity"


def test_a_giant_header_line_is_refused_by_the_http_parser() -> None:
    """Headers are bounded below the plugin: httpcore's h11 refuses an incomplete event over 100 KB."""
    with hostile_server({"/health": "giant-header"}) as hostile, pytest.raises(httpx.RemoteProtocolError):
        get_within(None, f"{hostile.url}/health", 60.0)
    assert hostile.requests["/health"] == 1


def test_the_attach_check_never_swallows_a_memory_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The held-out worst case: a MemoryError from the block-size scrape was suppressed and the next server's (the
    same stream's) /metrics read again."""
    calls: list[object] = []

    def scrape(*args: object, **kwargs: object) -> None:
        calls.append(args)
        raise MemoryError

    monkeypatch.setattr(attach, "scrape", scrape)
    handles = [ServerHandle(role, 0, "http://127.0.0.1:1", None) for role in ("prefill", "decode")]
    with pytest.raises(MemoryError):
        attach._attached_block_size(handles, 1.0)
    assert len(calls) == 1


# ------------------------------------------------------------------------------------- attach mode, through each door

INNER = "def test_a(pd_cluster):\n    pass\n"


@pytest.mark.parametrize(
    ("via", "route", "behaviour", "expected"),
    [
        ("argv", "/metrics", "endless", LIMIT_TEXT),
        ("env", "/v1/models", "declared", "its content-length says 10737418240"),
        ("ini", "/health", "gzip", "an answer encoded 'gzip'"),
    ],
)
def test_an_attached_hostile_server_fails_the_attach_naming_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, via: str, route: str, behaviour: str, expected: str
) -> None:
    with hostile_server({route: behaviour}) as hostile:
        args: list[str] = []
        if via == "argv":
            args = [f"--pd-prefill-url={hostile.url}", f"--pd-decode-url={hostile.url}"]
        elif via == "env":
            monkeypatch.setenv("PDSERVE_PREFILL_URLS", hostile.url)
            monkeypatch.setenv("PDSERVE_DECODE_URLS", hostile.url)
        else:
            pytester.makeini(f"[pytest]\npdserve_prefill_urls = {hostile.url}\npdserve_decode_urls = {hostile.url}\n")
        pytester.makepyfile(INNER)
        result = pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", f"--pd-lease-dir={pytester.path / 'leases'}", *args, timeout=180
        )
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    assert "MemoryError" not in out
    result.stdout.fnmatch_lines([f"*{hostile.url}{route} *{expected}*"])
    if behaviour == "endless":
        _bounded(hostile, route)
