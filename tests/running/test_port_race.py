"""A port pdserve leased, taken by another process before the server bound it (running/port_race.py).

The CI failure this is for: two xdist workers' inner sessions, each with a lease directory of its own, leased the
same port, and the second server to bind died with ``[Errno 98] Address already in use``. Here a squatter that
knows nothing of the leases takes a leased port the moment its lease is made (the inner session's conftest binds
it as the lease call returns), so the race is lost on purpose, whatever the machine's speed (a squatter thread
polling the lease directory had to beat the server's start: a race of its own, which a loaded machine could lose).
A listening squatter (the server then finds it answering, or fails to bind) and a squatter that only binds (the
server fails to bind; nothing answers). Both doors to the bug are the same call in the launcher.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from _hostile import hostile_server
from _pdsession import INNER_CONFTEST, Inner, unheld_locks

from pytest_pdserve.errors import PortInUse, ServerExitedEarly
from pytest_pdserve.machine.port_leases import acquire_ports
from pytest_pdserve.running import port_race

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

BIND_FAILED_TAIL = "OSError: [Errno 98] Address already in use\n"

#: The inner sessions' squatter: binds (and, with SQUAT_LISTEN=1, listens on) the port of each of the first
#: SQUAT_COUNT leases whose purpose ends with SQUAT_PURPOSE, before the server is spawned; SQUAT_OUT lists them.
SQUATTER = r"""
import os, socket
from pathlib import Path
import pytest_pdserve.machine.leases as _leases

_taken = []
_acquire_ports = _leases.acquire_ports

def _squat(*args, **kwargs):
    lease = _acquire_ports(*args, **kwargs)
    purpose = kwargs.get("purpose", "")
    if purpose.endswith(os.environ["SQUAT_PURPOSE"]) and len(_taken) < int(os.environ["SQUAT_COUNT"]):
        sock = socket.socket()  # no SO_REUSEADDR: an exclusive bind, as most programs make
        sock.bind(("127.0.0.1", lease.base))
        if os.environ["SQUAT_LISTEN"] == "1":
            sock.listen()
        _taken.append(sock)
        Path(os.environ["SQUAT_OUT"]).write_text(" ".join(str(s.getsockname()[1]) for s in _taken))
    return lease

_leases.acquire_ports = _squat
"""


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Inner:
    return Inner(pytester, monkeypatch)


def squat(
    inner: Inner, monkeypatch: pytest.MonkeyPatch, *, listen: bool, count: int, purpose: str = "prefill-0 http"
) -> Path:
    """The squatter in the inner session's conftest; the file that lists the ports it took."""
    (inner.pytester.path / "conftest.py").write_text(INNER_CONFTEST + SQUATTER)
    out = inner.pytester.path / "squatted"
    monkeypatch.setenv("SQUAT_PURPOSE", purpose)
    monkeypatch.setenv("SQUAT_COUNT", str(count))
    monkeypatch.setenv("SQUAT_LISTEN", "1" if listen else "0")
    monkeypatch.setenv("SQUAT_OUT", str(out))
    return out


def taken(out: Path) -> list[int]:
    return [int(port) for port in out.read_text().split()] if out.exists() else []


@pytest.mark.parametrize("listen", [True, False], ids=["listening", "bound"])
def test_a_leased_port_taken_before_the_server_binds_it_is_leased_again(
    inner: Inner, monkeypatch: pytest.MonkeyPatch, listen: bool
) -> None:
    inner.pytester.makepyfile(
        """
        def test_up(pd_cluster, pdinfo):
            pdinfo(pd_cluster)
            assert pd_cluster.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        """
    )
    out = squat(inner, monkeypatch, listen=listen, count=1)
    result = inner.run("-s")
    assert taken(out), f"the squatter never took the prefill's port: the test proved nothing\n{result.stdout}"
    [port] = taken(out)
    result.assert_outcomes(passed=1)
    [info] = inner.infos()
    prefill = next(s for s in info["servers"] if s["name"] == "prefill-0")
    assert prefill["port"] != port
    result.stdout.fnmatch_lines([f"*port {port}, leased by pdserve, was taken by another process*(attempt 2 of 3)*"])
    inner.assert_clean([info])


def test_a_squatter_on_every_attempt_fails_after_the_last(inner: Inner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded: lost races on every attempt fail the start with the server's own error, not a fourth start."""
    inner.pytester.makepyfile("def test_up(pd_cluster):\n    pass\n")
    out = squat(inner, monkeypatch, listen=False, count=port_race.ATTEMPTS + 2)
    result = inner.run("-s")
    assert len(taken(out)) == port_race.ATTEMPTS, (taken(out), result.stdout.str()[-3000:])
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*(attempt 3 of 3)*", "*Address already in use*"])
    assert "attempt 4" not in result.stdout.str()
    inner.assert_nothing_left()


@pytest.mark.parametrize("listen", [True, False], ids=["listening", "bound"])
def test_attach_modes_proxy_is_leased_again_as_the_servers_are(
    inner: Inner, monkeypatch: pytest.MonkeyPatch, listen: bool
) -> None:
    """Issue 43, class 6: the retry wrapped a cluster's servers but not attach mode's built-in proxy (PortInUse on
    a single squat). One rule for every listener pdserve starts on a leased port."""
    inner.pytester.makepyfile(
        """
        def test_up(pd_cluster):
            print("PROXY", pd_cluster.proxy.port)
            assert pd_cluster.client.get("/health").status_code == 200
        """
    )
    out = squat(inner, monkeypatch, listen=listen, count=1, purpose="attached proxy")
    with hostile_server({}) as deployment:
        result = inner.run("-s", f"--pd-prefill-url={deployment.url}", f"--pd-decode-url={deployment.url}")
    assert taken(out), f"the squatter never took the proxy's port: the test proved nothing\n{result.stdout}"
    [port] = taken(out)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*attached: proxy: port {port}, leased by pdserve, was taken*(attempt 2 of 3)*"])
    assert f"PROXY {port}" not in result.stdout.str()
    inner.assert_nothing_left()
    unheld_locks(inner.lease_dir)


# ------------------------------------------------------------------------------------ the rule, unit by unit


@pytest.fixture
def leased(tmp_path: Path) -> Iterator[list[object]]:
    lease = acquire_ports(tmp_path / "leases", 2, low=15000, high=19999, purpose="test")
    yield [lease]
    lease.release()


def test_a_bind_failure_with_every_leased_port_free_is_no_lost_race(leased: list[object]) -> None:
    """A port the user pinned in the server's own flags was busy: retrying on other leased ports cannot help."""
    exc = ServerExitedEarly("prefill-0", 1, BIND_FAILED_TAIL)
    assert port_race.taken_port(exc, leased) is None  # type: ignore[arg-type]


def test_a_bind_failure_with_a_leased_port_held_is_a_lost_race(leased: list[object]) -> None:
    port = leased[0].ports[1]  # type: ignore[attr-defined]
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        exc = ServerExitedEarly("decode-0", 1, BIND_FAILED_TAIL)
        assert port_race.taken_port(exc, leased) == port  # type: ignore[arg-type]
        # Another cause of death, with the same port held, is not retried.
        other = ServerExitedEarly("decode-0", 1, "RuntimeError: CUDA out of memory\n")
        assert port_race.taken_port(other, leased) is None  # type: ignore[arg-type]


def test_a_pinned_proxy_port_answering_is_no_lost_race(leased: list[object]) -> None:
    port = leased[0].ports[0]  # type: ignore[attr-defined]
    assert port_race.taken_port(PortInUse(port, "proxy"), leased) == port  # type: ignore[arg-type]
    assert port_race.taken_port(PortInUse(port, "proxy"), leased, fixed_port=port) is None  # type: ignore[arg-type]
    assert port_race.taken_port(PortInUse(1, "proxy"), leased) is None  # type: ignore[arg-type]
