"""GPU and port leases across real processes: exclusive, freed on holder death, TP-contiguous, waits."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_pdserve.errors import ClusterSpecError, LeaseTimeout
from pytest_pdserve.machine.leases import (
    acquire_gpus,
    acquire_port_span,
    acquire_ports,
    ensure_lease_dir,
    ephemeral_port_range,
    try_acquire_gpus,
)

KEYS = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc", "GPU-dddd"]
#: A wait that ends in milliseconds, bounded for a loaded machine (tests/_timing_scan.py: BOUND_FLOOR_S).
BOUND_S = 30.0

# A separate process that takes a lease, prints what it got, and holds it until killed (or stdin closes).
HOLDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from pytest_pdserve.machine.leases import acquire_gpus, acquire_port_span
    lease_dir, kind, arg = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    if kind == "gpu":
        keys, count = arg.split(":")
        lease = acquire_gpus(lease_dir, keys.split(","), int(count), timeout=0, purpose="holder test")
        print(",".join(map(str, lease.positions)), flush=True)
    else:
        low, width, high = map(int, arg.split(":"))
        lease = acquire_port_span(lease_dir, width, low=low, high=high)
        print(",".join(map(str, lease.ports)), flush=True)
    sys.stdin.read()
    """
)


class Holder:
    def __init__(self, lease_dir: Path, kind: str, arg: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(lease_dir), kind, arg],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line:
            self.kill()
            pytest.fail("holder process failed to take its lease")
        self.got = [int(x) for x in line.split(",")]

    def kill(self) -> None:
        """SIGKILL, reap and close the pipes (an unclosed pipe is a ResourceWarning, and warnings are errors)."""
        self.proc.kill()
        self.proc.wait(BOUND_S)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for h in made:
        h.kill()


def test_another_process_cannot_take_the_same_gpus(tmp_path: Path, holders: list[Holder]) -> None:
    holders.append(Holder(tmp_path, "gpu", f"{','.join(KEYS)}:2"))
    assert holders[0].got == [0, 1]
    lease = try_acquire_gpus(tmp_path, KEYS, 2)
    assert lease is not None
    assert lease.positions == (2, 3)
    assert lease.keys == ("GPU-cccc", "GPU-dddd")
    assert try_acquire_gpus(tmp_path, KEYS, 1) is None, "all four are leased"
    lease.release()
    assert not lease.held


def test_gpu_lease_frees_when_its_holder_is_sigkilled(tmp_path: Path, holders: list[Holder]) -> None:
    holder = Holder(tmp_path, "gpu", f"{','.join(KEYS)}:4")
    holders.append(holder)
    assert try_acquire_gpus(tmp_path, KEYS, 1) is None
    holder.kill()
    lease = try_acquire_gpus(tmp_path, KEYS, 4)
    assert lease is not None
    lease.release()


def test_tp_allocation_is_contiguous(tmp_path: Path) -> None:
    with acquire_gpus(tmp_path, KEYS[1:2], 1, timeout=0) as middle:
        assert middle.keys == ("GPU-bbbb",)
        pair = try_acquire_gpus(tmp_path, KEYS, 2)
        assert pair is not None
        assert pair.positions == (2, 3), "positions 0 and 2 are free but not adjacent"
        pair.release()
        with acquire_gpus(tmp_path, KEYS[2:3], 1, timeout=0):  # now 1 and 2 are held; 0 and 3 free
            assert try_acquire_gpus(tmp_path, KEYS, 2) is None
            scattered = try_acquire_gpus(tmp_path, KEYS, 2, contiguous=False)
            assert scattered is not None
            assert scattered.positions == (0, 3)
            scattered.release()


def test_wait_then_timeout_names_the_holder(tmp_path: Path, holders: list[Holder]) -> None:
    holder = Holder(tmp_path, "gpu", f"{','.join(KEYS)}:4")
    holders.append(holder)
    messages: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(LeaseTimeout) as exc_info:
        # timing: the timeout under test; the holder keeps every GPU
        acquire_gpus(tmp_path, KEYS, 2, timeout=0.5, poll=0.05, on_wait=messages.append)
    took = time.monotonic() - t0
    print(f"gave up after {took:.2f}s for a 0.5 s timeout")
    assert 0.5 <= took < BOUND_S  # never before the timeout; after it, one more poll (bounded for a loaded machine)
    assert len(messages) == 1, "one message while nothing changes"
    assert messages[0].startswith("pdserve: waiting for 2 free adjacent GPU(s) (all 4 leased: GPU-aaaa by pid ")
    assert f"pid {holder.proc.pid} (holder test)" in messages[0]
    assert f"pid {holder.proc.pid}" in str(exc_info.value)
    assert "--pd-gpu-wait-timeout" in str(exc_info.value)


def test_wait_succeeds_when_gpus_are_released(tmp_path: Path) -> None:
    first = try_acquire_gpus(tmp_path, KEYS, 4)
    assert first is not None
    timer = threading.Timer(0.3, first.release)
    timer.start()
    try:
        lease = acquire_gpus(tmp_path, KEYS, 2, timeout=2 * BOUND_S, poll=0.02)
    finally:
        timer.join()
    assert lease.positions == (0, 1)
    print(f"got the GPUs after {lease.waited:.2f}s, released after 0.3 s")
    assert 0.3 <= lease.waited < BOUND_S  # the release came after 0.3 s; noticed a poll later, or a loaded one
    lease.release()


def test_release_gate_waits_then_releases(tmp_path: Path) -> None:
    lease = try_acquire_gpus(tmp_path, KEYS, 1)
    assert lease is not None
    calls: list[float] = []

    def gpu_idle() -> bool:
        calls.append(time.monotonic())
        return len(calls) >= 3

    assert lease.release(wait_until=gpu_idle, timeout=2 * BOUND_S) >= 0.3  # two 0.2 s polls before True
    assert len(calls) == 3
    assert not lease.held


def test_release_gate_is_bounded(tmp_path: Path) -> None:
    lease = try_acquire_gpus(tmp_path, KEYS, 1)
    assert lease is not None
    took = lease.release(wait_until=lambda: False, timeout=0.3)  # timing: the bound under test; never idle
    print(f"gate gave up after {took:.2f}s for a 0.3 s timeout")
    assert 0.3 <= took < BOUND_S  # the 0.3 s timeout, then a release (bounded for a loaded machine)
    again = try_acquire_gpus(tmp_path, KEYS[:1], 1)
    assert again is not None, "the lease must be released even when the gate times out"
    again.release()


def test_bad_gpu_requests_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ClusterSpecError, match=r"need 5 GPU\(s\) but only 4 are visible"):
        acquire_gpus(tmp_path, KEYS, 5, timeout=0)
    with pytest.raises(ClusterSpecError, match="must be unique"):
        acquire_gpus(tmp_path, ["0", "0"], 1, timeout=0)
    with pytest.raises(ClusterSpecError, match="positive integer, got 0"):
        try_acquire_gpus(tmp_path, KEYS, 0)


def test_lease_dir_is_shared_mode(tmp_path: Path) -> None:
    lease_dir = ensure_lease_dir(tmp_path / "pytest-pdserve" / "leases")
    assert stat.S_IMODE(lease_dir.stat().st_mode) == 0o1777
    assert stat.S_IMODE(lease_dir.parent.stat().st_mode) == 0o1777
    lease = try_acquire_gpus(lease_dir, KEYS, 1)
    assert lease is not None
    assert stat.S_IMODE((lease_dir / "gpu-GPU-aaaa.lock").stat().st_mode) == 0o666
    assert f'"pid": {os.getpid()}' in (lease_dir / "gpu-GPU-aaaa.json").read_text()
    lease.release()
    assert list(lease_dir.iterdir()) == [], "released leases leave no files behind"


def test_existing_lease_dir_and_parents_keep_their_mode(tmp_path: Path) -> None:
    """Only directories the plugin creates become 1777; an existing one (or its parent) is never chmodded."""
    mine = tmp_path / "mine"
    mine.mkdir()
    mine.chmod(0o755)
    ensure_lease_dir(mine / "leases")
    assert stat.S_IMODE(mine.stat().st_mode) == 0o755
    assert stat.S_IMODE((mine / "leases").stat().st_mode) == 0o1777
    ensure_lease_dir(mine)
    assert stat.S_IMODE(mine.stat().st_mode) == 0o755


# Many processes hammer one key; whoever holds the lease creates a marker with O_EXCL. If two ever
# held it at once, the O_EXCL create fails. This exercises the unlink-on-release / inode re-check.
HAMMER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from pytest_pdserve.machine.leases import try_acquire_gpus
    lease_dir, marker, go = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    print("waiting", flush=True)
    # Start together, so that they really contend: a bound in seconds, not in checks (100,000 checks ran out while a
    # loaded machine still started the other hammers, and a hammer that ran alone met no contention).
    deadline = time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.001)
    got = 0
    for _ in range(1500):
        lease = try_acquire_gpus(lease_dir, ["only"], 1)
        if lease is None:
            continue
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # raises if someone else holds it
        os.close(fd)
        os.unlink(marker)
        lease.release()
        got += 1
    print(got)
    """
)


def test_mutual_exclusion_under_contention(tmp_path: Path) -> None:
    go = tmp_path / "go"
    argv = [sys.executable, "-c", HAMMER, str(tmp_path / "leases"), str(tmp_path / "marker"), str(go)]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    for p in procs:
        assert p.stdout is not None
        assert p.stdout.readline() == "waiting\n"
    go.touch()
    results = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err
    got = sum(int(out) for out, _ in results)
    assert 0 < got < 4 * 1500, f"{got} acquisitions: no contention happened, the test proves nothing"


# ---------------------------------------------------------------------------------------------- ports


def _low() -> int:
    # A per-test random window in the default band keeps parallel runs (xdist) from colliding.
    return 20000 + (os.getpid() % 500) * 20


#: How wide a window a test's span is looked for in. Ports here are bound by whatever else runs (the real-vLLM
#: tier's ZeroMQ and NIXL sockets, other sessions' servers): a test that demands one exact span fails when any of
#: its ports is taken (a red CI run: "no 4 adjacent free ports in 26240-26243"), so each span is looked for in a
#: window and every later check is made relative to where it landed.
SPAN_WINDOW = 200


def test_ports_are_distinct_and_below_the_ephemeral_range(tmp_path: Path) -> None:
    a = acquire_ports(tmp_path, 3)
    b = acquire_ports(tmp_path, 3)
    assert len(set(a.ports) | set(b.ports)) == 6
    assert all(20000 <= p < ephemeral_port_range()[0] for p in a.ports + b.ports)
    a.release()
    b.release()


def test_port_span_is_adjacent_and_exclusive_across_processes(tmp_path: Path, holders: list[Holder]) -> None:
    low = _low()
    holders.append(Holder(tmp_path, "ports", f"{low}:4:{low + SPAN_WINDOW - 1}"))
    theirs = holders[0].got
    assert theirs == list(range(theirs[0], theirs[0] + 4)), "not adjacent"
    assert low <= theirs[0] <= low + SPAN_WINDOW - 4
    # From the other process's first port on: its span is skipped, as a whole.
    span = acquire_port_span(tmp_path, 4, low=theirs[0], high=theirs[0] + SPAN_WINDOW - 1)
    assert span.ports == tuple(range(span.base, span.base + 4))
    assert span.base >= theirs[0] + 4, "overlaps the other process's span"
    span.release()
    with pytest.raises(LeaseTimeout, match="no 2 adjacent free ports"):
        acquire_port_span(tmp_path, 2, low=theirs[0], high=theirs[0] + 3)


def test_port_held_by_a_foreign_listener_is_skipped(tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(LeaseTimeout, match="only 0 of 1 ports free"):
            acquire_ports(tmp_path, 1, low=port, high=port)
        with pytest.raises(LeaseTimeout):
            acquire_port_span(tmp_path, 2, low=port, high=port + 1)


def test_port_range_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ClusterSpecError, match="low=30000 high=20000 is invalid"):
        acquire_ports(tmp_path, 1, low=30000, high=20000)
    with pytest.raises(ClusterSpecError, match="width must be a positive integer, got 0"):
        acquire_port_span(tmp_path, 0)
