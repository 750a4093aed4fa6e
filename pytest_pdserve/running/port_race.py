"""A port pdserve leased, taken by another process before the server bound it: the start is tried again.

Leases keep pdserve sessions that share a lease directory apart, and each port is checked free when it is leased
(port_leases.py). A process that knows nothing of those leases can still bind the port in the moments before the
server does: another user's service, a pdserve session with another ``--pd-lease-dir`` (every inner session of
this project's own suite has one, and two xdist workers beside each other are two such sessions), anything that
binds fixed ports. vLLM binds its HTTP socket after its imports and the NIXL side channel only once the model has
loaded, so that window is seconds on a loaded machine. The server then dies with ``Address already in use``, or
pdserve finds the port answering before it starts the server (``PortInUse``); nothing is wrong with the cluster.

So the launcher starts such a cluster again on newly leased ports, :data:`ATTEMPTS` times in all. A failure is a
lost race only when it says a port was in use *and*, with this cluster's own processes stopped, a port pdserve
leased for it is held by someone: a port the user pinned (``--pd-proxy-port``, a port in a server's own flags)
that is busy leaves the leased ports free, and fails at once with its own message as before.

The rule covers every listener pdserve starts on a port it leased: a cluster's servers and its proxy
(``ClusterLauncher.launch``) and attach mode's built-in proxy (``ClusterLauncher.start_proxy``), each through
:func:`start_retrying`. The other processes pdserve starts listen on no port (the keeper on an abstract Unix socket,
the watchdog on a socket pair, the guard on a pipe; the proxy's warm-up server binds port 0). [pytest-free]
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable, Sequence
from typing import TypeVar

from pytest_pdserve.errors import PortInUse, ServerExitedEarly
from pytest_pdserve.machine.port_leases import PortLease
from pytest_pdserve.running.hints import HINTS

__all__ = ["ATTEMPTS", "start_retrying", "taken_port"]

#: Starts in all for one cluster that keeps losing leased ports (each retry leases other ports; a port someone
#: holds is skipped by the lease's own bind check).
ATTEMPTS = 3

_PORT_IN_USE = next(h.pattern for h in HINTS if h.key == "port-in-use")

T = TypeVar("T")


def _held_by_someone(port: int) -> bool:
    """Whether a socket listens on ``port`` (or is bound to it exclusively), on loopback or all interfaces.

    SO_REUSEADDR, unlike the lease's own check: a connection of the stopped server lingering in TIME_WAIT is
    not someone holding the port."""
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


def taken_port(exc: BaseException, leased: Sequence[PortLease], fixed_port: int | None = None) -> int | None:
    """The port of ``leased`` that another process took, when ``exc`` is a start failure caused by that; else None.

    Call it once the cluster's own processes are stopped (the launcher's cleanup has run).

    :param fixed_port: a port the user pinned (``--pd-proxy-port``): never a lost race, it was not pdserve's pick.
    """
    ours = [p for lease in leased for p in lease.ports if p != fixed_port]
    if isinstance(exc, PortInUse):
        return exc.port if exc.port in ours else None
    if not isinstance(exc, ServerExitedEarly) or not _PORT_IN_USE.search(exc.log_tail):
        return None
    return next((p for p in ours if _held_by_someone(p)), None)


def start_retrying(
    start: Callable[[list[PortLease]], T], *, label: str, fixed_port: int | None, report: Callable[[str], None]
) -> T:
    """``start(leased)``, again (at most :data:`ATTEMPTS` in all) while it fails on a lost leased port.

    ``start`` appends every port lease it takes to ``leased`` and undoes everything before it raises."""
    for attempt in range(1, ATTEMPTS + 1):
        leased: list[PortLease] = []
        try:
            return start(leased)
        except (PortInUse, ServerExitedEarly) as exc:
            port = taken_port(exc, leased, fixed_port)
            if port is None or attempt == ATTEMPTS:
                raise
            report(
                f"pdserve: {label}: {exc.name}: port {port}, leased by pdserve, was taken by another process before "
                f"the server bound it; starting the cluster again on other ports (attempt {attempt + 1} of {ATTEMPTS})"
            )
    raise AssertionError("unreachable")  # the last attempt returns or raises
