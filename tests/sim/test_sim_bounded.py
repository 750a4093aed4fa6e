"""No request makes the simulator loop without bound, and SIGTERM always stops it (issue 16).

The hang: ``top_alternatives`` iterated ``perturb`` on its own output and waited for ``n`` distinct ids; for some
tokens that map cycles in fewer than ``n`` steps, so ``logprobs`` 3 or 5 spun forever at 100 % CPU and the
event loop never ran the SIGTERM shutdown. The sweeps below are bounded and deterministic (hypothesis is not a
test dependency); pytest-timeout turns a regression into a failure instead of a hung run.
"""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from pytest_pdserve.sim import tokenizer
from pytest_pdserve.sim.app import MAX_LOGPROBS, AppState, build_app
from pytest_pdserve.sim.cli import parse_serve_args
from pytest_pdserve.sim.engine import Engine
from pytest_pdserve.sim.faults import SimEnv

from ._simproc import BOUND_S, Factory, SimServer

SEEDS_OF_THE_ISSUE = (9, 15, 36, 42, 63, 69, 501)


@pytest.mark.timeout(120)
def test_top_alternatives_always_returns_n_distinct_ids() -> None:
    span = tokenizer.VOCAB_SIZE - tokenizer.FIRST_REGULAR_ID
    for token_id in range(tokenizer.FIRST_REGULAR_ID, tokenizer.VOCAB_SIZE):
        for position in range(3):
            for n in (1, 2, 3, 5, 21):
                ids = tokenizer.top_alternatives(token_id, position, n)
                assert ids[0] == token_id
                assert len(ids) == len(set(ids)) == n
    assert len(tokenizer.top_alternatives(4, 0, span + 10)) == span  # capped at the vocabulary


def _app(*flags: str) -> httpx.AsyncClient:
    args = parse_serve_args(["pdserve-sim/tiny-nemotronh", *flags])
    engine = Engine(args, SimEnv(), "CPU_ATTN")
    transport = httpx.ASGITransport(app=build_app(AppState(engine=engine)))
    return httpx.AsyncClient(transport=transport, base_url="http://sim")


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(tokenizer.FIRST_REGULAR_ID, tokenizer.VOCAB_SIZE) for _ in range(length)]


#: The tiny models declare 2048 positions; vLLM (and the simulator) refuse 16384 without this.
LONG = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
#: The hybrid case on a simulated GPU: vLLM for CPU's Mamba kernel dies on a prefill of more than one block
#: (rules/mamba.py), which tests/sim/test_sim_hybrid.py covers.
LONG_HYBRID = {**LONG, "PDSERVE_SIM_PLATFORM": "cuda"}


@pytest.mark.timeout(240, method="thread")  # a hang inside the event loop ignores SIGALRM
def test_every_request_of_a_sweep_answers_quickly() -> None:
    """Seeds x lengths x logprobs on both routes, streamed and not: each answers, quickly."""

    async def sweep() -> float:
        worst = 0.0
        async with _app("--max-model-len", "16384") as client:
            cases = [(s, n) for s in SEEDS_OF_THE_ISSUE for n in (600, 9000)]
            cases += [(s, n) for s in range(60) for n in (1, 17, 129, 600)]
            for i, (seed, length) in enumerate(cases):
                logprobs = (0, 1, 2, 3, 4, 5, MAX_LOGPROBS)[i % 7]
                prompt = _prompt(seed, length)
                body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "seed": 42, "logprobs": logprobs}
                started = time.monotonic()
                r = await client.post("/v1/completions", json={**body, "stream": i % 2 == 0})
                assert r.status_code == 200, r.text
                chat = {
                    "messages": [{"role": "user", "content": tokenizer.decode(prompt[:200])}],
                    "max_tokens": 5,
                    "temperature": 0,
                    "logprobs": True,
                    "top_logprobs": logprobs,
                }
                r = await client.post("/v1/chat/completions", json=chat)
                assert r.status_code == 200, r.text
                worst = max(worst, time.monotonic() - started)
        return worst

    # ~0.1 s each measured; a hang never answers (the 240 s timeout ends it); bounded far beyond a loaded machine.
    assert asyncio.run(sweep()) < BOUND_S


def test_the_hang_of_the_issue_answers_for_every_logprobs_value(sim_factory: Factory) -> None:
    """The reported case on a real process: tiny-nemotronh, 9,000 tokens, max_tokens 10, seed 42, logprobs 0..5.
    Each answers (< 0.15 s measured); a hang is the request's own timeout (SimServer.post, 60 s)."""
    server: SimServer = sim_factory("--max-model-len", "16384", model="pdserve-sim/tiny-nemotronh", env=LONG_HYBRID)
    server.wait_ready()
    prompt = _prompt(0, 9000)
    for logprobs in range(6):
        r = server.complete(prompt, max_tokens=10, seed=42, logprobs=logprobs)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == max(logprobs, 1)


class _Stream(threading.Thread):
    """A long streamed request with logprobs (seconds of per-token work, 14,000 tokens); ``received`` counts the
    bytes that arrived so far."""

    def __init__(self, server: SimServer) -> None:
        super().__init__(daemon=True)
        self.server, self.received = server, 0

    def run(self) -> None:
        body = {"prompt": _prompt(1, 2000), "max_tokens": 14000, "temperature": 0, "logprobs": 20, "stream": True}
        try:
            with httpx.stream("POST", self.server.url + "/v1/completions", json=body, timeout=BOUND_S) as r:
                for chunk in r.iter_bytes():
                    self.received += len(chunk)
        except httpx.HTTPError:
            pass  # the server is stopped under it

    def wait_streaming(self) -> None:
        """Until the first bytes arrived: the request runs (bounded)."""
        deadline = time.monotonic() + BOUND_S
        while not self.received and self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.received, "the stream never started"


@pytest.fixture
def heavy_stream(sim_factory: Factory) -> Iterator[tuple[SimServer, _Stream]]:
    """A server busy with a long streamed request (:class:`_Stream`), already streaming."""
    server: SimServer = sim_factory("--max-model-len", "16384", env=LONG_HYBRID)
    server.wait_ready()
    stream = _Stream(server)
    stream.start()
    stream.wait_streaming()
    yield server, stream
    stream.join(timeout=BOUND_S)


def test_the_event_loop_turns_throughout_a_long_request() -> None:
    """The simulator's long request gives its event loop back between tokens, so /health (any other request)
    answers while it runs. Counted in-process, not over a socket: a server whose loop never yields still answers
    whenever a slow client lets its socket fill (the send then waits), so any count over a real socket depends on
    how fast the client reads, and a loaded machine's client reads slowly. Here nothing waits on a socket: the loop
    turns only where the simulator yields (about one turn per 128 tokens; none without the yields)."""

    async def turns_during_the_request() -> tuple[int, int]:
        turns, done = 0, asyncio.Event()

        async def count_turns() -> None:
            nonlocal turns
            while not done.is_set():
                await asyncio.sleep(0)
                turns += 1

        async with _app("--max-model-len", "16384") as client:
            counter = asyncio.create_task(count_turns())
            await asyncio.sleep(0)
            before = turns
            body = {"prompt": _prompt(1, 2000), "max_tokens": 14000, "temperature": 0, "logprobs": 20, "stream": True}
            r = await client.post("/v1/completions", json=body)
            during = turns - before
            done.set()
            await counter
        assert r.status_code == 200, r.text
        return during, r.text.count("data: ")

    during, chunks = asyncio.run(turns_during_the_request())
    assert chunks > 14000, chunks
    assert during >= 14000 // 128, f"the event loop turned {during} times during a 14,000-token request"


def test_sigterm_stops_a_busy_server(heavy_stream: tuple[SimServer, _Stream]) -> None:
    """SIGTERM stops a server busy streaming: gracefully, or by its own hard exit HARD_EXIT_AFTER_S later. A loop
    that never ends would never exit (the wait's bound); how soon it exits is not this test's verdict."""
    server, stream = heavy_stream
    assert stream.is_alive()
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait_exit(timeout=BOUND_S) != -signal.SIGKILL
