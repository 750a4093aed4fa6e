"""A port pdserve leased, taken by another process before the server bound it (running/port_race.py).

The CI failure this is for: two xdist workers' inner sessions, each with a lease directory of its own, leased the
same port, and the second server to bind died with ``[Errno 98] Address already in use``. Here a squatter that
knows nothing of the leases takes a leased port the moment its lease file appears, so the race is certain
instead of rare: a listening squatter (the server then finds it answering, or fails to bind) and a squatter that
only binds (the server fails to bind; nothing answers). Both doors to the bug are the same call in the launcher.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _hostile import hostile_server
from _pdsession import Inner, unheld_locks

from pytest_pdserve.errors import PortInUse, ServerExitedEarly
from pytest_pdserve.machine.port_leases import acquire_ports
from pytest_pdserve.running import port_race

pytestmark = pytest.mark.usefixtures("clean_pdserve_env")

BIND_FAILED_TAIL = "OSError: [Errno 98] Address already in use\n"


class Squatter:
    """Takes each port whose lease holder's purpose ends with ``purpose`` as soon as its lease appears, ``count``
    ports at most (a start that leases again leases other ports: the squatter can take those too)."""

    def __init__(self, lease_dir: Path, purpose: str, *, listen: bool, count: int = 1) -> None:
        self.lease_dir, self.purpose, self.listen, self.count = lease_dir, purpose, listen, count
        self.ports: list[int] = []
        self._socks: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + 120
        while len(self.ports) < self.count and not self._stop.is_set() and time.monotonic() < deadline:
            for holder in self.lease_dir.glob("port-*.json") if self.lease_dir.is_dir() else ():
                port = int(holder.stem.removeprefix("port-"))
                try:
                    purpose = json.loads(holder.read_text())["purpose"]
                except (OSError, ValueError, KeyError):
                    continue  # being written
                if port in self.ports or not purpose.endswith(self.purpose):
                    continue
                sock = socket.socket()  # no SO_REUSEADDR: an exclusive bind, as most programs make
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    sock.close()  # the server was first this time
                    continue
                if self.listen:
                    sock.listen()
                self._socks.append(sock)
                self.ports.append(port)
            time.sleep(0.001)

    def __enter__(self) -> Squatter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for sock in self._socks:
            sock.close()


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Inner:
    return Inner(pytester, monkeypatch)


@pytest.mark.parametrize("listen", [True, False], ids=["listening", "bound"])
def test_a_leased_port_taken_before_the_server_binds_it_is_leased_again(inner: Inner, listen: bool) -> None:
    inner.pytester.makepyfile(
        """
        def test_up(pd_cluster, pdinfo):
            pdinfo(pd_cluster)
            assert pd_cluster.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        """
    )
    with Squatter(inner.lease_dir, "prefill-0 http", listen=listen) as squatter:
        result = inner.run("-s")
    assert squatter.ports, f"the squatter never took the prefill's port: the test proved nothing\n{result.stdout}"
    [taken] = squatter.ports
    result.assert_outcomes(passed=1)
    [info] = inner.infos()
    prefill = next(s for s in info["servers"] if s["name"] == "prefill-0")
    assert prefill["port"] != taken
    result.stdout.fnmatch_lines([f"*port {taken}, leased by pdserve, was taken by another process*(attempt 2 of 3)*"])
    inner.assert_clean([info])


def test_a_squatter_on_every_attempt_fails_after_the_last(inner: Inner) -> None:
    """Bounded: lost races on every attempt fail the start with the server's own error, not a fourth start."""
    inner.pytester.makepyfile("def test_up(pd_cluster):\n    pass\n")
    with Squatter(inner.lease_dir, "prefill-0 http", listen=False, count=port_race.ATTEMPTS + 2) as squatter:
        result = inner.run("-s")
    assert len(squatter.ports) == port_race.ATTEMPTS, (squatter.ports, result.stdout.str()[-3000:])
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*(attempt 3 of 3)*", "*Address already in use*"])
    assert "attempt 4" not in result.stdout.str()
    inner.assert_nothing_left()


@pytest.mark.parametrize("listen", [True, False], ids=["listening", "bound"])
def test_attach_modes_proxy_is_leased_again_as_the_servers_are(inner: Inner, listen: bool) -> None:
    """Issue 43, class 6: the retry wrapped a cluster's servers but not attach mode's built-in proxy (PortInUse on
    a single squat). One rule for every listener pdserve starts on a leased port."""
    inner.pytester.makepyfile(
        """
        def test_up(pd_cluster):
            print("PROXY", pd_cluster.proxy.port)
            assert pd_cluster.client.get("/health").status_code == 200
        """
    )
    with hostile_server({}) as deployment, Squatter(inner.lease_dir, "attached proxy", listen=listen) as squatter:
        result = inner.run("-s", f"--pd-prefill-url={deployment.url}", f"--pd-decode-url={deployment.url}")
    assert squatter.ports, f"the squatter never took the proxy's port: the test proved nothing\n{result.stdout}"
    [taken] = squatter.ports
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*attached: proxy: port {taken}, leased by pdserve, was taken*(attempt 2 of 3)*"])
    assert f"PROXY {taken}" not in result.stdout.str()
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
