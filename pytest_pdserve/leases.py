"""Machine-wide GPU and port leases that free themselves when their holder dies.

A lease is an exclusive ``flock`` on ``<lease_dir>/gpu-<key>.lock`` or ``<lease_dir>/port-<n>.lock``.
The kernel drops a flock when the last fd of its open file description closes, i.e. when the
holder exits *however* it exits (SIGKILL included), so there is no TTL, no stale-lock cleanup and no
registry to repair. That makes leases safe across xdist workers, concurrent pytest runs and users.

* GPU keys are stable identities (UUIDs, or indices when nothing better exists) of the caller's
  visible GPUs; a lease hands back *positions* in the caller's list.
* Ports come from below the kernel's ephemeral range (``ip_local_port_range``), so the kernel never
  hands one of them to some random ``connect()`` or ``bind(0)`` while we are not listening yet (NIXL
  binds its side channel only after model load). Each port is flock-leased *and* checked free by
  binding it, which skips ports held by services that know nothing about our leases.
* ``lease.fds`` are inherited by the servers that use the lease (``ServerProcess.start(inherit_fds=)``)
  and handed to the watchdog (``Watchdog.hold``), so a lease outlives a SIGKILLed pytest until every
  server that used it is gone.
* The lock files themselves (safe open in a shared dir, holder info, entries that are not ours and
  therefore count as busy) are :mod:`pytest_pdserve.lockfiles`.
* ``<key>.json`` next to each lock records the holder (pid, pgid, start time, purpose) for
  diagnostics only; the lock is the truth. Both files are removed on release (while still locked,
  and a new holder checks it locked the inode that is still linked), so the directory does not fill
  up with one file per port ever used.

Implementation note: this uses ``fcntl.flock`` directly rather than the ``filelock`` package. Same
kernel primitive, but we need the raw fd (to pass to the watchdog), non-blocking multi-lock attempts,
and an open sequence that works in a shared sticky directory (``fs.protected_regular`` refuses
``O_CREAT`` on another user's file there, which ``filelock`` does on every acquire).
"""

from __future__ import annotations

import errno
import logging
import random
import re
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typing.Self is Python 3.11+; annotations are strings here (PEP 563)
    from typing import Self

from pytest_pdserve.errors import ClusterSpecError, LeaseTimeout
from pytest_pdserve.lockfiles import describe_holder, try_lock, unlock, write_holder
from pytest_pdserve.paths import LEASE_DIR_MODE, PathError, ensure_dir

__all__ = [
    "DEFAULT_LEASE_DIR",
    "GpuLease",
    "PortLease",
    "acquire_gpus",
    "acquire_port_span",
    "acquire_ports",
    "ensure_lease_dir",
    "ephemeral_port_range",
    "try_acquire_gpus",
]

log = logging.getLogger(__name__)

DEFAULT_LEASE_DIR = Path("/tmp/pytest-pdserve/leases")
"""Machine-wide so concurrent runs of different users see each other. Keep it on a local file system:
flock on NFS is not reliable."""

_KEY_RE = re.compile(r"[^A-Za-z0-9._-]")
_REPORT_EVERY = 30.0  # seconds between repeated "still waiting" messages


def ensure_lease_dir(lease_dir: Path) -> Path:
    """Create ``lease_dir`` (and missing parents) world-writable and sticky (mode 1777, like /tmp).

    Only directories created here get that mode (:mod:`pytest_pdserve.paths`): an existing directory is
    used as it is, never chmodded.

    :raises PathError: a component is not a directory, or we cannot create files in it.
    """
    try:
        return ensure_dir(Path(lease_dir), LEASE_DIR_MODE)
    except PathError as exc:
        raise PathError(
            f"lease directory: {exc}; ask its owner to `chmod 1777` it, or choose another one with "
            "--pd-lease-dir / $PDSERVE_LEASE_DIR / pdserve_lease_dir"
        ) from None


class _Lease:
    def __init__(self, paths: list[Path], fds: list[int]) -> None:
        self._paths = paths
        self._fds = fds

    @property
    def fds(self) -> tuple[int, ...]:
        """The lock fds (hand them to ``Watchdog.hold`` so the lease outlives a killed pytest)."""
        return tuple(self._fds)

    @property
    def held(self) -> bool:
        """Whether the lease is still held."""
        return bool(self._fds)

    def _release_now(self) -> None:
        for path, fd in zip(self._paths, self._fds, strict=True):
            unlock(fd, path)
        self._fds = []

    def release(self) -> float:
        """Hand the lease back (idempotent); returns seconds spent in a release gate (none here: 0.0)."""
        self._release_now()
        return 0.0

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class GpuLease(_Lease):
    """GPUs held by this process.

    :ivar positions: positions in the caller's ``keys`` list (what ``inventory.child_env`` takes).
    :ivar keys: the leased keys, in position order.
    :ivar waited: seconds spent waiting for them.
    """

    def __init__(
        self,
        positions: tuple[int, ...],
        keys: tuple[str, ...],
        paths: list[Path],
        fds: list[int],
        waited: float,
    ) -> None:
        super().__init__(paths, fds)
        self.positions = positions
        self.keys = keys
        self.waited = waited

    def release(self, wait_until: Callable[[], bool] | None = None, timeout: float = 0.0) -> float:
        """Hand the GPUs back; returns seconds spent in the release gate.

        :param wait_until: gate, e.g. "nvidia-smi shows none of our pids on these GPUs"; polled every
            0.2 s until it returns True or ``timeout`` passes. The lease is released either way (a
            warning is logged on timeout): holding it forever would be worse.
        :param timeout: bound for the gate in seconds.
        """
        t0 = time.monotonic()
        if not self._fds:
            return 0.0
        if wait_until is not None:
            deadline = t0 + timeout
            while True:
                try:
                    if wait_until():
                        break
                except Exception:
                    log.exception("GPU release gate failed; releasing anyway")
                    break
                if time.monotonic() >= deadline:
                    log.warning("GPU release gate not satisfied after %.1fs; releasing %s anyway", timeout, self.keys)
                    break
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        self._release_now()
        return time.monotonic() - t0

    def __repr__(self) -> str:
        return f"<GpuLease positions={self.positions} keys={self.keys} held={self.held}>"


class PortLease(_Lease):
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


# ----------------------------------------------------------------------------------------------- GPUs


def _gpu_path(lease_dir: Path, key: str) -> Path:
    return lease_dir / f"gpu-{_KEY_RE.sub('_', key)}.lock"


def _windows(n: int, count: int) -> Iterator[tuple[int, ...]]:
    """Adjacent position windows, lowest first."""
    for start in range(n - count + 1):
        yield tuple(range(start, start + count))


def _try_gpus(
    lease_dir: Path, keys: Sequence[str], count: int, contiguous: bool, purpose: str
) -> tuple[GpuLease | None, list[int]]:
    """One pass; returns (lease, []) on success, else (None, busy positions).

    Locks are taken lazily, window by window, so a pass holds as few GPUs it will not keep as
    possible (a concurrent ``try_acquire_gpus`` would see those as busy for that instant).
    """
    paths = [_gpu_path(lease_dir, k) for k in keys]
    held: dict[int, int] = {}
    busy: set[int] = set()

    def lock(pos: int) -> bool:
        if pos in held:
            return True
        if pos in busy:
            return False
        fd = try_lock(paths[pos])
        if fd is None:
            busy.add(pos)
            return False
        held[pos] = fd
        return True

    chosen: tuple[int, ...] | None = None
    try:
        for window in _windows(len(keys), count):
            if all(lock(p) for p in window):
                chosen = window
                break
        if chosen is None and not contiguous:
            free = [p for p in range(len(keys)) if lock(p)]
            if len(free) >= count:
                chosen = tuple(free[:count])
        if chosen is None:
            for p in range(len(keys)):  # complete the picture for the waiting message
                lock(p)
            return None, sorted(busy)
        for pos in chosen:
            write_holder(paths[pos], purpose)
        lease = GpuLease(
            chosen, tuple(keys[p] for p in chosen), [paths[p] for p in chosen], [held[p] for p in chosen], 0.0
        )
        return lease, []
    finally:
        for pos, fd in held.items():
            if chosen is None or pos not in chosen:
                unlock(fd, paths[pos])


def _validate_gpu_request(keys: Sequence[str], count: int) -> None:
    if isinstance(keys, str):
        raise ClusterSpecError(f"GPU keys must be a sequence of strings, not the string {keys!r}")
    if len(set(keys)) != len(keys):
        raise ClusterSpecError(f"GPU keys must be unique, got {list(keys)}")
    if not isinstance(count, int) or count < 1:
        raise ClusterSpecError(f"GPU count must be a positive integer, got {count!r}")
    if count > len(keys):
        raise ClusterSpecError(
            f"need {count} GPU(s) but only {len(keys)} are visible ({list(keys)}); check "
            "CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES or the tensor-parallel sizes"
        )


def try_acquire_gpus(
    lease_dir: Path, keys: Sequence[str], count: int, *, contiguous: bool = True, purpose: str = ""
) -> GpuLease | None:
    """Lease ``count`` GPUs now or return None. See :func:`acquire_gpus`."""
    _validate_gpu_request(keys, count)
    lease, _ = _try_gpus(ensure_lease_dir(lease_dir), keys, count, contiguous, purpose)
    return lease


def acquire_gpus(
    lease_dir: Path,
    keys: Sequence[str],
    count: int,
    *,
    contiguous: bool = True,
    timeout: float,
    on_wait: Callable[[str], None] | None = None,
    poll: float = 1.0,
    purpose: str = "",
) -> GpuLease:
    """Lease ``count`` of the caller's visible GPUs, waiting up to ``timeout`` seconds for them.

    :param lease_dir: shared lease directory (created 1777 if missing).
    :param keys: stable ids of the caller's visible GPUs, in visible order (UUIDs preferred: indices
        differ between callers with different ``CUDA_VISIBLE_DEVICES``).
    :param count: GPUs needed (the tensor-parallel size, or the sum for a whole cluster).
    :param contiguous: True: only adjacent positions (a TP group stays together, lowest window
        first). False: adjacent positions preferred, any free ones accepted.
    :param timeout: seconds to wait; 0 tries once.
    :param on_wait: called with a human message when we start waiting, when the holders change and
        every 30 s; e.g. ``"pdserve: waiting for 2 free GPUs (all 4 leased: pos 0 by pid 123 ...)"``.
    :param poll: seconds between attempts.
    :param purpose: recorded in the holder info (``"prefill-0 of tests/test_x.py"``).
    :raises ClusterSpecError: ``count`` can never be satisfied by ``keys``.
    :raises LeaseTimeout: not enough GPUs became free in time; the message names the holders.
    """
    _validate_gpu_request(keys, count)
    lease_dir = ensure_lease_dir(lease_dir)
    t0 = time.monotonic()
    deadline = t0 + timeout
    last_msg, last_report = "", 0.0
    while True:
        lease, busy = _try_gpus(lease_dir, keys, count, contiguous, purpose)
        if lease is not None:
            lease.waited = time.monotonic() - t0
            if lease.waited > 0.5:
                log.info("leased GPUs %s after waiting %.1fs", lease.keys, lease.waited)
            return lease
        msg = _gpu_wait_message(lease_dir, keys, count, busy, contiguous)
        now = time.monotonic()
        if now >= deadline:
            raise LeaseTimeout(
                f"{msg.replace('waiting for', 'gave up waiting for', 1)} after {timeout:.0f}s. Wait longer "
                "with --pd-gpu-wait-timeout, skip instead with --pd-gpu-wait=skip, or free the GPUs"
            )
        if on_wait is not None and (msg != last_msg or now - last_report >= _REPORT_EVERY):
            on_wait(f"{msg}; giving up in {deadline - now:.0f}s")
            last_msg, last_report = msg, now
        time.sleep(max(0.0, min(poll, deadline - now)))


def _gpu_wait_message(lease_dir: Path, keys: Sequence[str], count: int, busy: list[int], contiguous: bool) -> str:
    holders = ", ".join(f"{keys[p]} by {describe_holder(_gpu_path(lease_dir, keys[p]))}" for p in busy)
    what = f"{count} free{' adjacent' if contiguous and count > 1 else ''} GPU(s)"
    if len(busy) == len(keys):
        return f"pdserve: waiting for {what} (all {len(keys)} leased: {holders})"
    free = [p for p in range(len(keys)) if p not in busy]
    return f"pdserve: waiting for {what} (free positions {free}; leased: {holders})"


# ---------------------------------------------------------------------------------------------- ports


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
        fd = _lock_port(lease_dir, port, purpose)
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
        for port in span:
            fd = _lock_port(lease_dir, port, purpose)
            if fd is None:
                break
            fds.append(fd)
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
    if fd is None:
        raise LeaseTimeout(f"port {port} is taken: leased by {describe_holder(path)} (another pdserve session)")
    if not _bind_free(port):
        unlock(fd, path)
        raise LeaseTimeout(f"port {port} is taken: another process (not pdserve) is bound to it")
    write_holder(path, purpose)
    return PortLease((port,), [path], [fd])
