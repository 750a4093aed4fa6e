"""Metrics snapshots and deltas, parsed from saved vLLM-format exposition text."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from pytest_pdserve.metrics import (
    NIXL_MISSING_HINT,
    MetricNotFoundError,
    MetricsScrapeError,
    MetricsSettleTimeout,
    MetricsSnapshot,
    parse_metrics,
    scrape,
    wait_settled,
)

DATA = Path(__file__).parent / "data"
METRICS = DATA / "metrics"


def load(name: str, *, strict: bool = True) -> MetricsSnapshot:
    path = METRICS / name
    return parse_metrics(path.read_text(), source=str(path), strict=strict)


def test_exact_sample_names_never_match_created() -> None:
    snap = load("decode_after_repeat.txt")
    assert snap.prefix_cache_hits() == 256
    # The _created sample is a timestamp around 1.8e9; a startswith match would add it.
    assert snap.has("vllm:prefix_cache_hits_created")
    assert snap.value("vllm:prefix_cache_hits_total") == 256


def test_named_accessors_read_the_documented_samples() -> None:
    snap = load("decode_after_transfer.txt")
    assert snap.prefix_cache_queries() == 404
    assert snap.external_prefix_cache_queries() == 404
    assert snap.external_prefix_cache_hits() == 404
    assert snap.prompt_tokens_by_source("external_kv_transfer") == 404
    assert snap.prompt_tokens_by_source("local_compute") == 0
    assert snap.prompt_tokens_cached_by_source("p2p") == 404
    assert snap.nixl_bytes_transferred() == 131072 + 393216
    assert snap.nixl_transfers() == 2
    assert snap.nixl_failed_transfers() == 0
    assert snap.nixl_num_descriptors() == 32 + 96
    assert snap.generation_tokens() == 32
    assert snap.prompt_tokens() == 404
    assert snap.request_success() == 2  # summed over finished_reason
    assert snap.request_success(finished_reason="length") == 2


def test_labels_filter_by_inclusion() -> None:
    snap = load("single_no_nixl.txt")
    assert snap.value("vllm:request_success_total") == 3
    assert snap.value("vllm:request_success_total", finished_reason="stop") == 1
    assert snap.value("vllm:prefix_cache_hits_total", model_name="tiny-llama", engine="0") == 256


def test_delta_between_snapshots() -> None:
    before, after = load("decode_after_transfer.txt"), load("decode_after_repeat.txt")
    delta = after - before
    assert delta.prefix_cache_queries() == 361
    assert delta.prefix_cache_hits() == 256
    assert delta.prompt_tokens_by_source("local_cache_hit") == 256
    assert delta.prompt_tokens_by_source("external_kv_transfer") == 105
    assert delta.prompt_tokens_cached_by_source("device") == 256
    assert delta.nixl_bytes_transferred() == 131072
    assert delta.nixl_transfers() == 1
    assert delta.request_success() == 1
    text = str(delta)
    assert "vllm:prefix_cache_hits_total" in text
    assert "0 -> 256 (delta 256)" in text
    assert "_created" not in text


def test_missing_family_is_not_zero_and_names_metric_and_source() -> None:
    snap = load("single_no_nixl.txt")
    assert snap.get("vllm:nixl_bytes_transferred_sum") is None
    with pytest.raises(MetricNotFoundError) as exc_info:
        snap.nixl_bytes_transferred()
    message = str(exc_info.value)
    assert "vllm:nixl_bytes_transferred_sum" in message
    assert "single_no_nixl.txt" in message
    assert NIXL_MISSING_HINT in message


def test_missing_label_set_lists_the_existing_ones() -> None:
    snap = load("single_no_nixl.txt")
    with pytest.raises(MetricNotFoundError, match=r'only the series .*finished_reason="stop"'):
        snap.value("vllm:request_success_total", finished_reason="bogus")


def test_typo_suggests_close_name() -> None:
    with pytest.raises(MetricNotFoundError, match="did you mean vllm:prefix_cache_hits_total"):
        load("single_no_nixl.txt").value("vllm:prefix_cache_hit_total")


def test_non_strict_reads_missing_as_zero_but_get_still_says_none() -> None:
    snap = load("single_no_nixl.txt", strict=False)
    assert snap.nixl_bytes_transferred() == 0.0
    assert snap.get("vllm:nixl_bytes_transferred_sum") is None


def test_delta_treats_series_new_in_after_as_zero_before() -> None:
    before = parse_metrics('# TYPE x_total counter\nx_total{a="1"} 2\n')
    after = parse_metrics('# TYPE x_total counter\nx_total{a="1"} 3\nx_total{a="2"} 5\n')
    assert (after - before).value("x_total") == 6
    assert (after - before).value("x_total", a="2") == 5
    with pytest.raises(MetricNotFoundError):
        (after - before).value("y_total")


def test_invalid_source_names_accepted_values() -> None:
    with pytest.raises(ValueError, match="'remote'.*local_compute, local_cache_hit, external_kv_transfer"):
        load("single_no_nixl.txt").prompt_tokens_by_source("remote")


def test_snapshot_is_immutable() -> None:
    snap = load("single_no_nixl.txt")
    with pytest.raises(TypeError):
        snap.samples[("x", frozenset())] = 1.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        snap.strict = False  # type: ignore[misc]


def test_garbage_is_a_scrape_error_naming_the_source() -> None:
    with pytest.raises(MetricsScrapeError, match="server-x.*Prometheus text"):
        parse_metrics("<html>oops</html>\n{{{", source="server-x")


# --- scraping a live endpoint and waiting ---


class CounterServer:
    """Serves /metrics from a counter the test changes."""

    def __init__(self) -> None:
        self.value = 0.0
        self.lock = threading.Lock()

    async def metrics(self, _request: Request) -> PlainTextResponse:
        with self.lock:
            v = self.value
        return PlainTextResponse(f"# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total {v}\n")

    def transport(self) -> httpx.MockTransport:
        def handler(request: httpx.Request) -> httpx.Response:
            if request.url.path != "/metrics":
                return httpx.Response(404, text="not found")
            with self.lock:
                v = self.value
            text = f"# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total {v}\n"
            return httpx.Response(200, text=text)

        return httpx.MockTransport(handler)


@pytest.fixture
def counter() -> Iterator[tuple[CounterServer, httpx.Client]]:
    server = CounterServer()
    with httpx.Client(base_url="http://127.0.0.1:9", transport=server.transport()) as client:
        yield server, client


def test_scrape_from_client_records_url(counter: tuple[CounterServer, httpx.Client]) -> None:
    server, client = counter
    server.value = 7
    snap = scrape(client)
    assert snap.generation_tokens() == 7
    assert snap.source == "http://127.0.0.1:9/metrics"


def test_scrape_real_http_server(tmp_path: Path) -> None:
    import socket

    import uvicorn

    app = Starlette(routes=[Route("/metrics", CounterServer().metrics)])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)  # connections queue until uvicorn serves: a scrape before it started is no refusal
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        snap = wait_settled(lambda: scrape(f"http://127.0.0.1:{port}"), timeout=60, interval=0.02)
        assert snap.generation_tokens() == 0
        assert snap.source == f"http://127.0.0.1:{port}/metrics"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_scrape_error_names_url_and_status() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(503, text="engine dead"))
    with (
        httpx.Client(base_url="http://127.0.0.1:9", transport=transport) as client,
        pytest.raises(MetricsScrapeError, match=r"http://127.0.0.1:9/metrics returned HTTP 503: 'engine dead'"),
    ):
        scrape(client)


def test_scrape_rejects_non_http_url() -> None:
    with pytest.raises(ValueError, match="'127.0.0.1:8000' must start with http"):
        scrape("127.0.0.1:8000")


def test_wait_settled_waits_for_until_condition(counter: tuple[CounterServer, httpx.Client]) -> None:
    server, client = counter
    calls = 0

    def scrape_and_advance() -> MetricsSnapshot:
        # The counter lands a few polls late, as vLLM's asynchronous stats do.
        nonlocal calls
        calls += 1
        if calls == 4:
            server.value = 16
        return scrape(client)

    snap = wait_settled(scrape_and_advance, until=lambda s: s.generation_tokens() >= 16, interval=0.001)
    assert snap.generation_tokens() == 16
    assert calls >= 6  # 4 to see the change, then 2 stable polls


def test_wait_settled_times_out_when_counters_keep_moving(counter: tuple[CounterServer, httpx.Client]) -> None:
    server, client = counter

    def busy() -> MetricsSnapshot:
        server.value += 1
        return scrape(client)

    with pytest.raises(MetricsSettleTimeout, match=r"kept changing .*vllm:generation_tokens_total"):
        wait_settled(busy, timeout=0.2, interval=0.01)  # timing: the timeout under test; the counter never settles


def test_wait_settled_on_a_scrape_slower_than_the_timeout_takes_its_confirming_polls(
    counter: tuple[CounterServer, httpx.Client],
) -> None:
    # A loaded CI machine (2026-12-03): each scrape of real vLLM took seconds, so only two polls fit in
    # the 5 s timeout and unchanged counters were reported as "kept changing ... (no net change)".
    # The sleep stands for the slow server; it is what is under test, not a wait for a condition.
    server, client = counter
    server.value = 7
    calls = 0

    def slow() -> MetricsSnapshot:
        nonlocal calls
        calls += 1
        time.sleep(0.04)  # timing: the slow server under test
        return scrape(client)

    snap = wait_settled(slow, timeout=0.05, interval=0.001)  # timing: the same count of polls however slow
    assert snap.generation_tokens() == 7
    assert calls == 3  # the first poll, then two unchanged ones, two of them past the deadline


def test_wait_settled_on_a_slow_scrape_still_fails_a_counter_that_moves_past_the_deadline(
    counter: tuple[CounterServer, httpx.Client],
) -> None:
    server, client = counter

    def slow_and_moving() -> MetricsSnapshot:
        time.sleep(0.04)  # timing: the slow server under test
        snapshot = scrape(client)
        server.value += 1  # moves between every pair of polls
        return snapshot

    with pytest.raises(MetricsSettleTimeout, match=r"kept changing .*vllm:generation_tokens_total"):
        wait_settled(slow_and_moving, timeout=0.05, interval=0.001)  # timing: the counter never settles


def test_wait_settled_times_out_on_unmet_condition(counter: tuple[CounterServer, httpx.Client]) -> None:
    _, client = counter
    with pytest.raises(MetricsSettleTimeout, match="did not reach the awaited condition"):
        # timing: the condition is never met
        wait_settled(lambda: scrape(client), until=lambda s: s.generation_tokens() > 0, timeout=0.1, interval=0.01)


def test_wait_settled_validates_arguments(counter: tuple[CounterServer, httpx.Client]) -> None:
    _, client = counter
    with pytest.raises(ValueError, match="stable_for=0"):
        wait_settled(lambda: scrape(client), stable_for=0)


# Real vLLM CPU captures, when a teammate has saved them (tests/data/vllm-cpu/*metrics*.txt).
REAL = sorted((DATA / "vllm-cpu").glob("*metrics*.txt")) if (DATA / "vllm-cpu").is_dir() else []


@pytest.mark.skipif(not REAL, reason="no real vLLM /metrics capture in tests/data/vllm-cpu yet")
@pytest.mark.parametrize("path", REAL, ids=[p.name for p in REAL])
def test_real_vllm_capture_parses(path: Path) -> None:
    snap = parse_metrics(path.read_text(), source=str(path))
    assert snap.prefix_cache_queries() >= snap.prefix_cache_hits() >= 0
    assert snap.get("vllm:prefix_cache_hits_created") != snap.get("vllm:prefix_cache_hits_total")
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        assert snap.prompt_tokens_by_source(source) >= 0
