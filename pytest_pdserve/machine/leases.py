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
  therefore count as busy) are :mod:`pytest_pdserve.machine.lockfiles`.
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

import contextlib
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from pytest_pdserve.errors import ClusterSpecError, LeaseTimeout
from pytest_pdserve.machine.gpu_probe import wait_for_gate
from pytest_pdserve.machine.lockfiles import (
    KEPT_FOR_REUSE,
    KEPT_RELEASE_WAIT,
    Lease,
    describe_holder,
    ensure_lease_dir,
    foreign,
    try_lock,
    unlock,
    want,
    want_file,
    write_holder,
)
from pytest_pdserve.machine.paths import DEFAULT_LEASE_DIR

# Port leases and the lease primitives are re-exported: callers use ``leases.acquire_ports`` and friends (and
# tests patch them here), so this module stays the one place to lease anything.
from pytest_pdserve.machine.port_leases import (
    PortLease,
    acquire_fixed_port,
    acquire_port_span,
    acquire_ports,
    ephemeral_port_range,
)

__all__ = [
    "DEFAULT_LEASE_DIR",
    "GpuLease",
    "Lease",
    "PortLease",
    "acquire_fixed_port",
    "acquire_gpus",
    "acquire_port_span",
    "acquire_ports",
    "ensure_lease_dir",
    "ephemeral_port_range",
    "try_acquire_gpus",
]

log = logging.getLogger(__name__)


_KEY_RE = re.compile(r"[^A-Za-z0-9._-]")
_REPORT_EVERY = 30.0  # seconds between repeated "still waiting" messages


class GpuLease(Lease):
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
        if not self.owner.here:  # a forked child's copy: no gate, no unlock (lockfiles.Lease)
            self.disown()
            return 0.0
        if wait_until is not None:
            why = wait_for_gate(wait_until, timeout)
            if why is not None:
                log.warning("GPU release gate %s; releasing %s anyway", why, self.keys)
        self._release_now()
        return time.monotonic() - t0

    def __repr__(self) -> str:
        return f"<GpuLease positions={self.positions} keys={self.keys} held={self.held}>"


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
    """Lease ``count`` GPUs now or return None. See :func:`acquire_gpus`.

    GPUs held only by a kept cluster (``--pd-reuse``) are not "busy" for a run that skips: its keeper is told they
    are wanted, and they are waited for up to :data:`KEPT_RELEASE_WAIT` seconds (its servers' shutdown).
    """
    _validate_gpu_request(keys, count)
    lease_dir = ensure_lease_dir(lease_dir)
    lease, busy = _try_gpus(lease_dir, keys, count, contiguous, purpose)
    if lease is None and any(KEPT_FOR_REUSE in describe_holder(_gpu_path(lease_dir, keys[p])) for p in busy):
        with contextlib.suppress(LeaseTimeout):
            return acquire_gpus(
                lease_dir, keys, count, contiguous=contiguous, timeout=KEPT_RELEASE_WAIT, purpose=purpose
            )
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
    wants: dict[str, int] = {}  # want-file fds: a reuse keeper holding one of these GPUs stops its kept cluster
    try:
        while True:
            lease, busy = _try_gpus(lease_dir, keys, count, contiguous, purpose)
            if lease is not None:
                lease.waited = time.monotonic() - t0
                if lease.waited > 0.5:
                    log.info("leased GPUs %s after waiting %.1fs", lease.keys, lease.waited)
                return lease
            for p in busy:
                if keys[p] not in wants and (fd := want(want_file(_gpu_path(lease_dir, keys[p])))) is not None:
                    wants[keys[p]] = fd
            msg = _gpu_wait_message(lease_dir, keys, count, busy, contiguous)
            _refuse_if_never(lease_dir, keys, count, busy, contiguous, msg)
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
    finally:
        for fd in wants.values():
            os.close(fd)


def _refuse_if_never(
    lease_dir: Path, keys: Sequence[str], count: int, busy: list[int], contiguous: bool, msg: str
) -> None:
    """Fail at once when entries that are no pdserve lock files (a directory, a link planted there) leave too few
    GPUs for ``count`` even once every pdserve holder is gone: nothing frees them, so waiting
    (``--pd-gpu-wait-timeout``, 1800 s by default) would only end in the same error.

    :raises LeaseTimeout: naming each such entry.
    """
    planted = {p for p in busy if foreign(_gpu_path(lease_dir, keys[p])) is not None}
    if not planted:
        return
    if contiguous:
        possible = any(not planted.intersection(w) for w in _windows(len(keys), count))
    else:
        possible = len(keys) - len(planted) >= count
    if possible:
        return
    names = "; ".join(
        f"{_gpu_path(lease_dir, keys[p])} is {foreign(_gpu_path(lease_dir, keys[p]))}" for p in sorted(planted)
    )
    raise LeaseTimeout(
        f"{msg.replace('waiting for', 'gave up waiting for', 1)} at once: {names}, no pdserve lock file, which "
        "never frees by itself. Remove it, or choose another lease directory with --pd-lease-dir / "
        "$PDSERVE_LEASE_DIR / pdserve_lease_dir"
    )


def _gpu_wait_message(lease_dir: Path, keys: Sequence[str], count: int, busy: list[int], contiguous: bool) -> str:
    holders = ", ".join(f"{keys[p]} by {describe_holder(_gpu_path(lease_dir, keys[p]))}" for p in busy)
    what = f"{count} free{' adjacent' if contiguous and count > 1 else ''} GPU(s)"
    if len(busy) == len(keys):
        return f"pdserve: waiting for {what} (all {len(keys)} leased: {holders})"
    free = [p for p in range(len(keys)) if p not in busy]
    return f"pdserve: waiting for {what} (free positions {free}; leased: {holders})"
