"""The checks a cluster start makes once its servers answer HTTP (verify.py) run at the same time, not one after
the other: the read-back of each server, and the read-back beside the P/D-ready round trip. Each test makes one
side wait (boundedly) for the other to have begun, so a serial implementation fails instead of passing slowly.
The checks themselves, against real simulator clusters, are tests/assertions/test_measurements.py's."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from pytest_pdserve.errors import EffectiveConfigError, NotPDReady
from pytest_pdserve.metrics import NIXL_BYTES_SUM, PROMPT_TOKENS_BY_SOURCE, REQUEST_SUCCESS, MetricsSnapshot
from pytest_pdserve.running import readiness, verify
from pytest_pdserve.running.verify import Mismatch, ObservedConfig

WAIT_S = 30.0  # only a serial implementation waits this long (and then fails)
#: Stands in for a PDCluster: the checks are faked, so nothing reads it.
CLUSTER: Any = SimpleNamespace()


def test_verification_and_the_round_trip_run_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    verifying, tripping = threading.Event(), threading.Event()

    def fake_verify(cluster: Any, *, max_model_len: int | None, at_start: bool = False) -> dict[str, ObservedConfig]:
        verifying.set()
        assert tripping.wait(WAIT_S), "the round trip had not begun while the configuration was read back"
        return {}

    def fake_trip(
        cluster: Any, *, timeout: float = 30.0, cancel: threading.Event | None = None, fresh: bool = False
    ) -> float:
        tripping.set()
        assert verifying.wait(WAIT_S), "the read-back had not begun while the round trip ran"
        return 0.25

    monkeypatch.setattr(verify, "verify_cluster", fake_verify)
    monkeypatch.setattr(verify, "pd_round_trip", fake_trip)
    assert verify.check_started(CLUSTER, max_model_len=None, pd_ready=True) == 0.25


def test_a_mismatch_is_raised_and_stops_the_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    cancelled = threading.Event()
    mismatch = Mismatch("decode-0", "block size", 16, 32, "vllm:cache_config_info")

    def fake_verify(cluster: Any, *, max_model_len: int | None, at_start: bool = False) -> dict[str, ObservedConfig]:
        raise EffectiveConfigError([mismatch])

    def fake_trip(
        cluster: Any, *, timeout: float = 30.0, cancel: threading.Event | None = None, fresh: bool = False
    ) -> float:
        assert cancel is not None
        if cancel.wait(WAIT_S):
            cancelled.set()
        raise NotPDReady("proxy", "moved no KV")

    monkeypatch.setattr(verify, "verify_cluster", fake_verify)
    monkeypatch.setattr(verify, "pd_round_trip", fake_trip)
    with pytest.raises(EffectiveConfigError, match="block size"):
        verify.check_started(CLUSTER, max_model_len=None, pd_ready=True)
    assert cancelled.wait(WAIT_S)


def test_without_the_ready_check_only_the_read_back_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def fake_verify(cluster: Any, *, max_model_len: int | None, at_start: bool = False) -> dict[str, ObservedConfig]:
        calls.append("verify")
        return {}

    def fake_trip(*args: Any, **kwargs: Any) -> float:
        calls.append("trip")
        return 0.0

    monkeypatch.setattr(verify, "verify_cluster", fake_verify)
    monkeypatch.setattr(verify, "pd_round_trip", fake_trip)
    assert verify.check_started(CLUSTER, max_model_len=None, pd_ready=False) is None
    assert calls == ["verify"]


def test_every_server_is_read_back_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    started = {"prefill-0": threading.Event(), "decode-0": threading.Event()}

    def fake_read(server: Any, *, at_start: bool = False) -> ObservedConfig:
        started[server.name].set()
        other = next(e for name, e in started.items() if name != server.name)
        assert other.wait(WAIT_S), f"{server.name}: the other server's read-back had not begun"
        return ObservedConfig(server=server.name)

    monkeypatch.setattr(verify, "read_observed", fake_read)
    monkeypatch.setattr(verify, "_mismatches", lambda *a: [])
    cluster: Any = SimpleNamespace(
        prefill=(SimpleNamespace(name="prefill-0"),), decode=(SimpleNamespace(name="decode-0"),),
        attention_backend="CPU_ATTN", effective={},
    )  # fmt: skip
    effective = verify.verify_cluster(cluster)
    assert set(effective) == {"prefill-0", "decode-0"}


def test_the_probe_prompt_costs_one_tokenize_when_the_guess_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    counted: list[str] = []

    def fake_count(target: Any, prompt: str, *, model: str | None = None) -> tuple[int, int | None]:
        counted.append(prompt)
        return len(prompt.split()) + 1, 4096

    def no_search(*a: Any, **k: Any) -> str:
        raise AssertionError("searched although the first guess fit")

    monkeypatch.setattr(verify, "count_tokens", fake_count)
    monkeypatch.setattr(verify, "prompt_with_tokens", no_search)
    prompt = verify._ready_prompt(CLUSTER, 1000)
    assert counted == [prompt]


def test_a_guess_outside_the_range_falls_back_to_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify, "count_tokens", lambda target, prompt, *, model=None: (200, 4096))
    monkeypatch.setattr(verify, "prompt_with_tokens", lambda target, n, *, seed=0: f"searched {n}")
    assert verify._ready_prompt(CLUSTER, 1000) == f"searched {verify.READY_PROMPT_TOKENS}"


def test_a_fresh_start_scrapes_decode_only_after_the_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """At a start the servers have served nothing (counters 0): the round trip proves KV moved from one scrape after
    its request, and still fails a decode server that shows none (tests/assertions/test_measurements.py, sim's no-pull
    switch)."""
    events: list[str] = []
    moved = MetricsSnapshot(
        {
            (NIXL_BYTES_SUM, frozenset()): 1024.0,
            (PROMPT_TOKENS_BY_SOURCE, frozenset({("source", "external_kv_transfer")})): 32.0,
        }
    )

    class Decode:
        name, url = "decode-0", "http://127.0.0.1:9"

        def metrics(self) -> MetricsSnapshot:
            events.append("scrape")
            return moved

    class Proxy:
        def complete_within(self, total: float, prompt: str, **body: Any) -> dict[str, Any]:
            events.append("request")
            return {}

    cluster: Any = SimpleNamespace(decode=(Decode(),), proxy=Proxy(), model="m", prefill=())
    monkeypatch.setattr(verify, "_ready_prompt", lambda cluster, seed: "a prompt")
    verify.pd_round_trip(cluster, fresh=True)
    assert events == ["request", "scrape"]
    events.clear()
    with pytest.raises(NotPDReady, match="moved no KV"):  # counters read first: unchanged, so no KV moved
        verify.pd_round_trip(cluster, timeout=0.0)
    assert events[:2] == ["scrape", "request"]


def _decode_counters(success: float, external: float, nixl: float | None) -> MetricsSnapshot:
    counters = {
        (REQUEST_SUCCESS, frozenset({("finished_reason", "length")})): success,
        (PROMPT_TOKENS_BY_SOURCE, frozenset({("source", "external_kv_transfer")})): external,
    }
    if nixl is not None:
        counters[(NIXL_BYTES_SUM, frozenset())] = nixl
    return MetricsSnapshot(counters)


@pytest.mark.parametrize(
    ("scrapes", "verdict"),
    [
        # The decode finished the request with no KV (a failed pull, recomputed): the verdict at the first scrape.
        ([_decode_counters(1, 0, 0)], "decode-0 finished it with no external_kv_transfer tokens"),
        # Not finished yet in the metrics (the answer comes before the record): wait, then the finish decides.
        ([_decode_counters(0, 0, None), _decode_counters(1, 0, 0)], "finished it with no external_kv_transfer"),
        # Tokens moved, NIXL bytes not reported yet: wait for them (ready at the second scrape).
        ([_decode_counters(1, 25, None), _decode_counters(1, 25, 1024)], None),
    ],
)  # fmt: skip
def test_the_round_trip_fails_as_soon_as_a_decode_finished_without_kv(
    monkeypatch: pytest.MonkeyPatch, scrapes: list[MetricsSnapshot], verdict: str | None
) -> None:
    """Not after its 30 s timeout (test_measurements' no-pull cluster waited them out): vLLM records a request's
    prompt tokens by source no later than its request_success, so once that went up the counters are final."""
    seen: list[MetricsSnapshot] = []

    class Decode:
        name, url = "decode-0", "http://127.0.0.1:9"

        def metrics(self) -> MetricsSnapshot:
            seen.append(scrapes[min(len(seen), len(scrapes) - 1)])
            return seen[-1]

    class Proxy:
        def complete_within(self, total: float, prompt: str, **body: Any) -> dict[str, Any]:
            return {}

    cluster: Any = SimpleNamespace(decode=(Decode(),), proxy=Proxy(), model="m", prefill=())
    monkeypatch.setattr(verify, "_ready_prompt", lambda cluster, seed: "a prompt")
    t0 = time.monotonic()
    if verdict is None:
        verify.pd_round_trip(cluster, fresh=True, timeout=240)
    else:
        with pytest.raises(NotPDReady, match=verdict):
            verify.pd_round_trip(cluster, fresh=True, timeout=240)
    assert time.monotonic() - t0 < 60, "it waited for the timeout"
    assert len(seen) == len(scrapes)


def _read_back_server(asked: list[str]) -> Any:
    """A server whose every GET is recorded in ``asked``; its process's readiness check saw ``ready-model``."""

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "served-now", "max_model_len": 64}]})
        return httpx.Response(404)

    client = httpx.Client(base_url="http://127.0.0.1:9", transport=httpx.MockTransport(answer))

    def no_metrics() -> MetricsSnapshot:
        raise httpx.ConnectError("no metrics here")

    process = SimpleNamespace(models_answer={"data": [{"id": "ready-model", "max_model_len": 32}]})
    return SimpleNamespace(name="decode-0", client=client, process=process, metrics=no_metrics, read_log=lambda _: "")


def test_the_start_read_back_takes_the_model_list_from_the_readiness_check() -> None:
    asked: list[str] = []
    observed = verify.read_observed(_read_back_server(asked), at_start=True)
    assert "/v1/models" not in asked, "the read-back asked again for the model list the readiness check had"
    assert observed.served_models == ("ready-model",)
    assert observed.max_model_len == 32


def test_a_later_read_back_asks_the_server_again() -> None:
    # Adopting a kept cluster (reuse/adopt.py) checks the model list a test may have changed since the start.
    asked: list[str] = []
    observed = verify.read_observed(_read_back_server(asked))
    assert "/v1/models" in asked
    assert observed.served_models == ("served-now",)


def test_the_readiness_check_keeps_the_model_list_it_found_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    body = {"data": [{"id": "m", "max_model_len": 32}]}
    lists = iter([{"data": []}, body])  # not ready (the model is not listed yet), then ready

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=next(lists) if request.url.path == "/v1/models" else {})

    monkeypatch.setattr(readiness, "_refused", lambda address: False)
    check = readiness.ReadinessCheck("http://127.0.0.1:9/health", "http://127.0.0.1:9/v1/models", "m", None)
    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        assert not check.check(client)
        assert check.models_answer is None, "kept the list of a check that did not find the server ready"
        assert check.check(client)
    assert check.models_answer == body
