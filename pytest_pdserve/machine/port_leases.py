"""Port leases: free ports below the kernel's ephemeral range, flock-leased and checked free by binding them.

Ports come from below ``ip_local_port_range``, so the kernel never hands one of them to some random
``connect()`` or ``bind(0)`` while we are not listening yet (NIXL binds its side channel only after model load).
Each port is flock-leased *and* checked free by binding it, which skips ports held by services that know
nothing about our leases. How leases work in general: :mod:`pytest_pdserve.machine.leases`. [pytest-free]
"""

from __future__ import annotations

import errno
import random
import socket
from collections.abc import Sequence
from pathlib import Path

from pytest_pdserve.common.digits import parse_int
from pytest_pdserve.errors import ClusterSpecError, LeaseTimeout
from pytest_pdserve.machine.lockfiles import (
    KEPT_RELEASE_WAIT,
    Lease,
    describe_holder,
    ensure_lease_dir,
    lock_from_keeper,
    try_lock,
    unlock,
    write_holder,
)

__all__ = [
    "DEFAULT_PORT_RANGE", "PortLease", "acquire_fixed_port", "acquire_port_span", "acquire_ports",
    "ephemeral_port_range", "parse_port_range",
]  # fmt: skip

#: Where ports come from when ``--pd-port-range`` is not given: 20000 up to just below the ephemeral range.
DEFAULT_PORT_RANGE: tuple[int, int | None] = (20000, None)


def parse_port_range(text: str) -> tuple[int, int]:
    """``LOW-HIGH`` as ``(low, high)`` (the ``--pd-port-range`` setting).

    :raises ValueError: the text is not ``LOW-HIGH`` with ``1 <= LOW <= HIGH <= 65535``.
    """
    low, sep, high = text.strip().partition("-")
    try:
        lo, hi = parse_int(low), parse_int(high)
    except ValueError:
        lo = hi = 0
    if not sep or not 1 <= lo <= hi <= 65535:
        raise ValueError("expected LOW-HIGH with 1 <= LOW <= HIGH <= 65535 in digits 0-9, e.g. 20000-20999")
    return lo, hi


class PortLease(Lease):
    """Ports held by this process.

    :ivar ports: the ports, ascending (a span is ``base .. base+width-1``).
    """

    def __init__(self, ports: tuple[int, ...], paths: list[Path], fds: list[int]) -> None:
        super().__init__(paths, fds)
        self.ports = ports

    @property
    def base(self) -> int:
        """The first (lowest) port; for spans, what ``VLLM_PORT`` / the side-channel base is set to."""
        return self.ports[0]

    def __repr__(self) -> str:
        return f"<PortLease ports={self.ports} held={self.held}>"


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's ``ip_local_port_range`` (where ``bind(0)``/``connect`` take ports from)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux default


def _bind_free(port: int) -> bool:
    """Whether nobody (leased or not) is bound to the port, on loopback and on all interfaces."""
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # No SO_REUSEADDR: a port in TIME_WAIT counts as busy, which is the conservative answer.
            try:
                s.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return False
                if host == "127.0.0.1":
                    return False  # e.g. EACCES; "0.0.0.0" failures other than EADDRINUSE are ignored
    return True


def _port_range(low: int, high: int | None) -> tuple[int, int]:
    if high is None:
        high = ephemeral_port_range()[0] - 1
    if not (1 <= low <= high <= 65535):
        raise ClusterSpecError(
            f"port range low={low} high={high} is invalid; need 1 <= low <= high <= 65535, and the default "
            f"high is just below the ephemeral range {ephemeral_port_range()}"
        )
    return low, high


def _port_path(lease_dir: Path, port: int) -> Path:
    return lease_dir / f"port-{port}.lock"


def _unlock_ports(lease_dir: Path, ports: Sequence[int], fds: Sequence[int]) -> None:
    """Unlock ``fds`` (the first ``len(fds)`` of ``ports``)."""
    for port, fd in zip(ports, fds, strict=False):
        unlock(fd, _port_path(lease_dir, port))


def _lock_port(lease_dir: Path, port: int, purpose: str) -> int | None:
    path = _port_path(lease_dir, port)
    fd = try_lock(path)
    if fd is None:
        return None
    if not _bind_free(port):
        unlock(fd, path)
        return None
    write_holder(path, purpose)
    return fd


def acquire_ports(
    lease_dir: Path, count: int, *, low: int = 20000, high: int | None = None, purpose: str = ""
) -> PortLease:
    """Lease ``count`` (not necessarily adjacent) free ports in ``[low, high]``.

    :param high: defaults to just below the kernel's ephemeral range.
    :raises LeaseTimeout: the range has fewer than ``count`` free ports.
    """
    if not isinstance(count, int) or count < 1:
        raise ClusterSpecError(f"port count must be a positive integer, got {count!r}")
    low, high = _port_range(low, high)
    lease_dir = ensure_lease_dir(lease_dir)
    size = high - low + 1
    offset = random.randrange(size)  # spread concurrent runs over the range: fewer collisions
    ports: list[int] = []
    fds: list[int] = []
    for i in range(size):
        port = low + (offset + i) % size
        try:
            fd = _lock_port(lease_dir, port, purpose)
        except BaseException:  # e.g. the lease dir's file system is full: what this call holds goes back first
            _unlock_ports(lease_dir, ports, fds)
            raise
        if fd is not None:
            ports.append(port)
            fds.append(fd)
            if len(ports) == count:
                held = sorted(zip(ports, fds, strict=True))  # ascending ports, each with its fd
                in_order = tuple(p for p, _ in held)
                return PortLease(in_order, [_port_path(lease_dir, p) for p in in_order], [fd for _, fd in held])
    _unlock_ports(lease_dir, ports, fds)
    raise LeaseTimeout(f"only {len(ports)} of {count} ports free in {low}-{high} (leased or bound by others)")


def acquire_port_span(
    lease_dir: Path, width: int, *, low: int = 20000, high: int | None = None, purpose: str = ""
) -> PortLease:
    """Lease ``width`` adjacent free ports ``base .. base+width-1`` in ``[low, high]``.

    For vLLM's ``VLLM_PORT`` window (it takes ``VLLM_PORT``, ``+1``, ... for internal sockets) and the
    NIXL side-channel span (base + DP rank).

    :raises LeaseTimeout: no such span is free.
    """
    if not isinstance(width, int) or width < 1:
        raise ClusterSpecError(f"port span width must be a positive integer, got {width!r}")
    low, high = _port_range(low, high)
    if width > high - low + 1:
        raise ClusterSpecError(f"port span width {width} does not fit in {low}-{high}")
    lease_dir = ensure_lease_dir(lease_dir)
    n_bases = high - low + 2 - width
    offset = random.randrange(n_bases)
    i = 0
    while i < n_bases:
        base = low + (offset + i) % n_bases
        span = range(base, base + width)
        fds: list[int] = []
        try:
            for port in span:
                fd = _lock_port(lease_dir, port, purpose)
                if fd is None:
                    break
                fds.append(fd)
        except BaseException:  # e.g. the lease dir's file system is full: what this call holds goes back first
            _unlock_ports(lease_dir, span, fds)
            raise
        if len(fds) == width:
            return PortLease(tuple(span), [_port_path(lease_dir, p) for p in span], fds)
        _unlock_ports(lease_dir, span, fds)
        # Every base up to the busy port would contain it: skip past it, but not past the wrap-around
        # point (after it, bases restart at ``low`` and do not contain the busy port).
        i += min(len(fds) + 1, n_bases - (offset + i) % n_bases)
    raise LeaseTimeout(f"no {width} adjacent free ports in {low}-{high} (leased or bound by others)")


def acquire_fixed_port(lease_dir: Path, port: int, *, purpose: str = "") -> PortLease:
    """Lease exactly ``port`` (``--pd-proxy-port``: modules that hard-code the proxy at 8192).

    :raises LeaseTimeout: the port is leased by another pdserve run (the message names it) or bound by a
        process outside pdserve.
    """
    _port_range(port, port)
    lease_dir = ensure_lease_dir(lease_dir)
    path = _port_path(lease_dir, port)
    fd = try_lock(path)
    if fd is None:  # a kept cluster's proxy (--pd-reuse) gives it up when asked
        fd = lock_from_keeper(path, KEPT_RELEASE_WAIT)
    if fd is None:
        raise LeaseTimeout(f"port {port} is taken: leased by {describe_holder(path)} (another pdserve session)")
    if not _bind_free(port):
        unlock(fd, path)
        raise LeaseTimeout(f"port {port} is taken: another process (not pdserve) is bound to it")
    write_holder(path, purpose)
    return PortLease((port,), [path], [fd])
