"""What a run prints into a log (CI): start-up progress only when it says something new, log sections only from
the servers that wrote during the failing test, and a start error as its message, without the plugin's source.

The inner sessions run as ``pytester.runpytest_subprocess``: their output is a pipe, as in CI.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from _pdsession import Inner

from pytest_pdserve.running import progress
from pytest_pdserve.running.progress import StartProgress

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Inner:
    return Inner(pytester, monkeypatch)


def test_a_waiting_start_repeats_no_progress_line_into_a_log(inner: Inner) -> None:
    """Both servers "load weights" for 12 s, their logs unchanged: on a terminal that was a line per server every
    5 s (at 1, 6 and 11 s); into a log it is one each, 5 s in, and one more only per 30 s without news."""
    inner.pytester.makepyfile(
        """
        from pytest_pdserve.spec import ClusterSpec

        def test_up(pd_cluster_factory, pdinfo):
            pdinfo(pd_cluster_factory(ClusterSpec(env={"PDSERVE_SIM_STARTUP_DELAY": "12"})))
        """
    )
    result = inner.run("-s")
    result.assert_outcomes(passed=1)
    [info] = inner.infos()
    for server in info["servers"]:
        if server["name"] == "proxy":
            continue
        lines = [line for line in result.stdout.lines if line.startswith(f"pdserve: starting {server['name']} (")]
        assert lines, result.stdout.str()
        assert "Loading model weights" in lines[0]
        # The 12 s without news give one line (and one more per 30 s); a line after them reports the log's next
        # line (the simulator's backend line as it becomes ready), which is news.
        waiting = [line for line in lines if "Loading model weights" in line]
        assert len(waiting) <= 1 + int(server["ready_seconds"] // StartProgress.QUIET_EVERY), lines
        news = [line.split(") ", 1)[1] for line in lines]
        assert len(news) == len(set(news)), lines  # no line repeats what the last one said


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _feed(progress: StartProgress, clock: _Clock, lines: dict[int, str]) -> list[float]:
    """Call ``progress`` once per second of a start (as wait_all_ready does); the elapsed times it reported at."""
    shown: list[float] = []
    progress.report = lambda message: shown.append(float(re.search(r"\((\d+)s\)", message)[1]))  # type: ignore[index]
    start = clock.now
    line = ""
    for second in range(1, 71):
        clock.now = start + second
        line = lines.get(second, line)
        progress("decode-0", float(second), line)
    return shown


def test_progress_into_a_log_is_each_change_or_a_line_per_30_s(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(progress, "time", SimpleNamespace(monotonic=clock))
    lines = {1: "loading", 20: "compiling", 21: "compiling step 2", 22: "compiling step 3"}
    to_log = _feed(StartProgress(print, terminal=False), clock, lines)
    # 5 s in; the change at 20 s; the next change at most 5 s later; then 30 s of the same line.
    assert to_log == [5, 20, 25, 55]
    to_terminal = _feed(StartProgress(print, terminal=True), clock, lines)
    assert to_terminal == [1, 6, 11, 16, 21, 26, 31, 36, 41, 46, 51, 56, 61, 66]


def test_a_failure_carries_sections_only_from_servers_that_wrote_during_it(inner: Inner) -> None:
    inner.pytester.makepyfile(
        """
        def test_starts_the_cluster(pd_cluster):
            pass

        def test_fails(pd_cluster):
            response = pd_cluster.prefill[0].client.post(
                "/v1/completions", json={"model": pd_cluster.model, "prompt": "hello " * 5, "max_tokens": 1}
            )
            assert response.status_code == 200
            assert False, "deliberate"
        """
    )
    result = inner.run()
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert out.count("pdserve prefill-0 log (") == 1
    assert '"POST /v1/completions HTTP/1.1" 200' in out.split("pdserve prefill-0 log (", 1)[1]
    # decode-0 and the proxy saw nothing of this test: no "(no output during this test)" section for them.
    assert "pdserve decode-0 log (" not in out
    assert "pdserve proxy log (" not in out
    assert "(no output during this test)" not in out


def test_a_start_error_is_its_message_without_plugin_source(inner: Inner) -> None:
    inner.pytester.makepyfile(
        """
        import pytest
        from pytest_pdserve.errors import ServerExitedEarly
        from pytest_pdserve.spec import ClusterSpec

        CRASH = ClusterSpec(decode_env={"PDSERVE_SIM_CRASH_AT_STARTUP": "boom"})

        def test_start_fails(pd_cluster_factory):
            pd_cluster_factory(CRASH)

        def test_the_error_is_still_caught_by_its_type(pd_cluster_factory):
            with pytest.raises(ServerExitedEarly, match="exit code 1"):
                pd_cluster_factory(CRASH)
        """
    )
    result = inner.run()
    result.assert_outcomes(failed=1, passed=1)
    out = result.stdout.str()
    failure = out.split("_ test_start_fails _", 1)[1].split("short test summary info", 1)[0]
    assert "ServerExitedEarly: decode-0: server process exited with exit code 1 before it became ready" in failure
    assert "boom" in failure  # the log's last lines are part of the message
    assert re.search(r"the cluster was asked for at \S*test_a_start_error\S*\.py:\d+, in test_start_fails", failure)
    # None of the plugin's own source: pytest's traceback went through fixtures, manager, launch and process.
    assert "pytest_pdserve/" not in failure, failure
    assert "def poll_ready" not in failure
    assert len(failure.splitlines()) < 20, failure
    inner.assert_nothing_left()
