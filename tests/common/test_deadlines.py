"""Issue 25, class 4: every network call of the plugin has a total deadline, and a lease path that is no lock
of pdserve's is refused at once.

httpx's timeouts are per read: a server that sends its headers and then one byte of body every 0.5 s meets a 2 s read
timeout forever. The trickling servers here are 127.0.0.1 threads; each call must fail within its own deadline
(bounded generously: the trickle itself would last far longer).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
import warnings

import httpx
import pytest
from _trickle import TRICKLE_BYTES, TRICKLE_EVERY_S, trickler

from pytest_pdserve import metrics
from pytest_pdserve.clients import make_client
from pytest_pdserve.common.deadline import get_within, within

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")


@pytest.mark.parametrize("headers_too", [False, True], ids=["body", "headers"])
def test_a_trickled_answer_fails_within_the_total_deadline(headers_too: bool) -> None:
    with trickler(headers_too=headers_too) as url:
        started = time.monotonic()
        with pytest.raises(httpx.ReadTimeout, match="no complete answer within 1s"):
            get_within(None, f"{url}/health", 1.0)
        elapsed = time.monotonic() - started
        client = make_client("decode-0", url, {})  # each server's client: the same deadline when asked for
        with client, pytest.raises(metrics.MetricsScrapeError, match="no complete answer within 1s"):
            metrics.scrape(client, timeout=1.0)  # timing: the deadline under test; the trickle outlasts any
    assert elapsed < TRICKLE_BYTES * TRICKLE_EVERY_S / 10, elapsed  # 60 s; the trickle itself would take 600 s


def test_a_request_without_a_deadline_is_passed_through_as_it_is() -> None:
    # A test's own request (a long stream) keeps httpx's per-read timeouts: only the plugin's checks ask for one.
    with trickler() as url, make_client("decode-0", url, {}) as client, client.stream("GET", "/x") as response:
        assert response.status_code == 200
        assert next(response.iter_bytes()) == b"z"  # read as it comes, not cut at some total


def test_an_answer_within_the_deadline_is_whole(tmp_path: object) -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def one() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello")

    thread = threading.Thread(target=one, daemon=True)
    thread.start()
    response = get_within(None, f"http://127.0.0.1:{listener.getsockname()[1]}/health", 30.0)
    thread.join(5)
    listener.close()
    assert (response.status_code, response.text) == (200, "hello")


# ------------------------------------------------------------------------------------- attach mode

INNER_ATTACHED = "def test_a(pd_cluster):\n    pass\n"


@pytest.mark.parametrize("via", ["argv", "PYTEST_ADDOPTS", "ini", "env"])
def test_attach_to_a_server_that_trickles_its_answer_fails_within_the_deadline(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, via: str
) -> None:
    with trickler() as url:
        urls = {"prefill": url, "decode": url}
        args: list[str] = []
        if via == "argv":
            args = [f"--pd-prefill-url={urls['prefill']}", f"--pd-decode-url={urls['decode']}"]
        elif via == "PYTEST_ADDOPTS":
            monkeypatch.setenv("PYTEST_ADDOPTS", f"--pd-prefill-url={urls['prefill']} --pd-decode-url={urls['decode']}")
        elif via == "ini":
            pytester.makeini(
                f"[pytest]\npdserve_prefill_urls = {urls['prefill']}\npdserve_decode_urls = {urls['decode']}\n"
            )
        else:
            monkeypatch.setenv("PDSERVE_PREFILL_URLS", urls["prefill"])
            monkeypatch.setenv("PDSERVE_DECODE_URLS", urls["decode"])
        pytester.makepyfile(INNER_ATTACHED)
        # Without a total deadline the attach check reads the trickle for 600 s: past this run's own timeout.
        result = pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", f"--pd-lease-dir={pytester.path / 'leases'}", *args, timeout=240
        )
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*attach mode: * did not answer:*", "*no complete answer within 10s*"])


# ----------------------------------------------------------------------------- a lease path that is no lock

SIM_GPU_LOCK = "gpu-GPU-sim-0000-0000-0000-{:012d}.lock"


@pytest.mark.parametrize("via", ["argv", "PYTEST_ADDOPTS", "ini", "env"])
def test_a_directory_planted_as_a_gpu_lock_fails_at_once_naming_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, via: str
) -> None:
    # Two simulated GPUs, a 1P x 1D cluster needs both, and one lock path is a directory: nothing will ever free
    # it, so the default --pd-gpu-wait-timeout (1800 s) was spent waiting for it.
    leases = pytester.path / "leases"
    leases.mkdir()
    (leases / SIM_GPU_LOCK.format(0)).mkdir()
    args: list[str] = []
    if via == "argv":
        args = [f"--pd-lease-dir={leases}"]
    elif via == "PYTEST_ADDOPTS":
        monkeypatch.setenv("PYTEST_ADDOPTS", f"--pd-lease-dir={leases}")
    elif via == "ini":
        pytester.makeini(f"[pytest]\npdserve_lease_dir = {leases}\n")
    else:
        monkeypatch.setenv("PDSERVE_LEASE_DIR", str(leases))
    pytester.makepyfile("def test_a(pd_cluster):\n    pass\n")
    result = pytester.runpytest_subprocess(
        "--pd-engine=sim", "--pd-simulate-gpus=2", "-p", "no:cacheprovider", *args, timeout=120
    )
    result.assert_outcomes(errors=1)
    out = result.stdout.str()
    assert f"{leases / SIM_GPU_LOCK.format(0)} is a directory, no pdserve lock file" in out, out[-3000:]
    assert "gave up waiting for" in out
    assert "giving up in" not in out  # it never waited


def test_a_planted_entry_that_leaves_enough_gpus_is_only_skipped(pytester: pytest.Pytester) -> None:
    leases = pytester.path / "leases"
    leases.mkdir()
    (leases / SIM_GPU_LOCK.format(0)).mkdir()
    pytester.makepyfile("def test_a(pd_cluster):\n    pass\n")
    result = pytester.runpytest_subprocess(
        "--pd-engine=sim", "--pd-simulate-gpus=3", f"--pd-lease-dir={leases}", "-p", "no:cacheprovider", timeout=120
    )
    result.assert_outcomes(passed=1)


def test_deadlines_hold_in_a_forked_child_and_side_by_side() -> None:
    """One alarm thread serves every request of a process (deadline.py's ``_Alarms``): a forked child starts without
    the parent's thread and must still cut a trickle, and two requests waiting at once are each cut at their own
    deadline, the later one not held up by the earlier. (Trickled headers: only the alarm's cut ends such a read.)"""
    with trickler(headers_too=True) as url:
        with contextlib.suppress(httpx.ReadTimeout):
            get_within(None, f"{url}/health", 0.2)  # the parent's alarm thread now runs
        with warnings.catch_warnings():  # 3.12+ warns of fork() in a threaded process; the child only makes a request
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: exit 0 only when its own deadline cut the trickle in time
            code = 1
            signal.alarm(240)  # a child whose cut never comes dies of SIGALRM instead of waiting out the trickle
            try:
                t0 = time.monotonic()
                try:  # 2 s: past the trickle's 0.5 s gaps, so httpx's own read timeout cannot end it first
                    get_within(None, f"{url}/health", 2.0)
                except httpx.ReadTimeout:
                    code = 0 if time.monotonic() - t0 < 60 else 2  # cut, not read out (600 s)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "a forked child's request was not cut at its deadline"
        # Two requests at once, the later one with the earlier deadline: it is cut at its own deadline, not held up
        # to the other's (120 s: far past the bound below), and the other is not cut with it.
        took: dict[float, float] = {}

        def one(total: float) -> None:
            t0 = time.monotonic()
            with contextlib.suppress(httpx.HTTPError):
                get_within(None, f"{url}/health", total)
            took[total] = time.monotonic() - t0

        long, short = (threading.Thread(target=one, args=(total,), daemon=True) for total in (120.0, 0.3))
        long.start()
        short.start()
        short.join(timeout=90)
        assert long.is_alive(), "the longer request was cut with the shorter one"
    long.join(timeout=90)  # the trickler is gone: the longer request ends with its connection
    assert took[0.3] < 60, took  # cut at its own 0.3 s, not at the other's 120 s


def test_answered_requests_do_not_pile_up_on_the_alarm_heap() -> None:
    from pytest_pdserve.common import deadline

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/health"
        for _ in range(600):  # each waits on the heap for its 300 s deadline once answered
            assert get_within(None, url, 300.0).status_code == 200
    finally:
        stop.set()
        thread.join(timeout=10)
        listener.close()
    assert len(deadline._ALARMS._heap) <= 2 * deadline._COMPACT_AT  # noqa: SLF001 (the thing under test)


def test_a_dead_alarm_thread_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one alarm thread serves every later deadline: if it is ever gone, the next request starts another."""
    from pytest_pdserve.common import deadline

    alarms = deadline._Alarms()  # noqa: SLF001 (the thing under test)
    ended = threading.Thread(target=lambda: None)  # stands for an alarm thread that died
    ended.start()
    ended.join()
    alarms._thread = ended  # noqa: SLF001
    monkeypatch.setattr(deadline, "_ALARMS", alarms)
    with trickler(headers_too=True) as url:
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout, match="no complete answer within 2s"):
            get_within(None, f"{url}/health", 2.0)  # only a live alarm cuts trickled headers
        assert time.monotonic() - t0 < 30
    assert alarms._thread is not ended  # noqa: SLF001


def test_a_pooled_connection_that_never_answers_again_fails_at_the_deadline() -> None:
    """The second request reuses the first one's kept-alive connection (no connect event, so no socket for the
    cutter until headers come) and the server never answers it, as a paused (SIGSTOPped) server does not."""
    listener = socket.create_server(("127.0.0.1", 0))
    hold = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            conn.recv(65536)  # the second request on the same connection: never answered
            hold.wait(600)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with make_client("prefill-0", url, {}) as client:
            assert get_within(client, f"{url}/health", 60.0).status_code == 200
            with pytest.raises(httpx.ReadTimeout, match="no complete answer within 1s"):
                # the extension alone, as assert_fails_fast sends it (get_within also sets httpx's timeout)
                client.get(f"{url}/health", extensions=within(1.0))  # unfixed: blocks until the server closes
    finally:
        hold.set()
        listener.close()
        thread.join(10)
