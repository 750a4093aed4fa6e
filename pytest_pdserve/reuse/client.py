"""Talking to keepers: list the kept clusters, claim one, ask for its state, stop it. [pytest-free]

Every word said is `protocol.py`'s. A run that wants a spec's cluster lists the kept ones (:func:`list_kept`:
a keeper that is gone has its servers swept by their tokens and its state removed; a file that is no state is
named, and removed only if pdserve wrote it) and *claims* one with the same fingerprint (:func:`find_reusable`):
the open connection is the claim, one run at a time. Nothing here signals a pid a state file names: only server
tokens are ever swept.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_pdserve.common import created
from pytest_pdserve.machine.gpu_probe import wait_for_gate
from pytest_pdserve.reuse import protocol
from pytest_pdserve.reuse.fingerprint import differences
from pytest_pdserve.reuse.state import STATE_SUFFIX, KeptCluster, OtherSchema, read_state
from pytest_pdserve.running.proctree import SERVER_TOKEN_ENV, pid_namespace, terminate
from pytest_pdserve.running.rpc_dirs import remove_rpc_dir

__all__ = ["Claim", "claim", "find_reusable", "keeper_info", "list_kept", "stop_kept"]

Report = Callable[[str], None]

#: State files looked at per listing (a kept cluster writes one; thousands are junk, removed as they are seen).
_MAX_STATE_FILES = 4096
_NAMED_REMOVALS = 3  # removed junk files named one by one; the rest are counted
_CONNECT_TIMEOUT = 2.0
_CLAIM_TIMEOUT = 20.0
_KEEPER_EXIT_TIMEOUT = 10.0  # a keeper with no cluster left exits at once (its guard: up to 5 s on SIGTERM)


def _sweep(gone: Sequence[KeptCluster], grace: float) -> list[tuple[KeptCluster, str]]:
    """Stop what is left of kept clusters whose keeper is gone (processes found by their server tokens only, in
    one pass over ``/proc``), and remove their state where pdserve wrote it (:mod:`pytest_pdserve.common.created`);
    returns those whose state file stays, with why (pdserve cannot prove it wrote it, or it cannot be removed)."""
    tokens = [(SERVER_TOKEN_ENV, s.token) for kept in gone for s in kept.servers]
    terminate([], env=tokens, grace=grace, kill_wait=10.0)
    stays = []
    for kept in gone:
        for server in kept.servers:
            remove_rpc_dir(server.rpc_dir)
        try:
            if not created.remove_file(kept.path) and os.path.lexists(kept.path):
                stays.append((kept, "pdserve did not create the file"))
        except OSError as exc:
            stays.append((kept, f"it cannot be removed: {exc.strerror or exc}"))
    return stays


def list_kept(reuse_dir: Path, *, report: Report | None = None, grace: float = 3.0) -> list[KeptCluster]:
    """The kept clusters in ``reuse_dir`` whose keeper runs; a keeper that is gone has its leftovers stopped and
    its state removed. A file that is not a kept-cluster state is removed only when pdserve wrote it (its
    manifest, :mod:`pytest_pdserve.common.created`), else left alone; both are reported. A state kept by a keeper in
    another PID namespace (another container sharing the directory) is neither listed nor swept: its pid means
    nothing here.

    Bounded, and junk does not hide a kept cluster: every ``*.json`` (up to :data:`_MAX_STATE_FILES`) is looked
    at, one that is too large is refused by its size without reading it, the leftovers of every gone keeper are
    swept in one pass over ``/proc``, and only the first few files are named (then a count).
    """
    say = report or (lambda msg: None)
    found, gone, removed = [], [], []
    try:
        entries = sorted(reuse_dir.glob(f"*{STATE_SUFFIX}"))
    except OSError:
        return []
    here = pid_namespace()
    for path in entries[:_MAX_STATE_FILES]:
        try:
            kept = read_state(path)
        except FileNotFoundError:
            continue  # its keeper stopped it meanwhile
        except OtherSchema as exc:  # another pdserve version's: its own to judge
            removed.append(f"left {path} alone: {exc}")
            continue
        except (OSError, ValueError) as exc:
            try:
                gone_now = created.remove_file(path)
            except OSError as why:
                removed.append(f"ignored {path}: {exc} (cannot remove it: {why.strerror or why})")
                continue
            if gone_now:
                removed.append(f"removed {path}: {exc}")
            else:
                removed.append(f"left {path} alone: {exc}; pdserve did not create it")
            continue
        if kept.keeper.pidns is not None and here is not None and kept.keeper.pidns != here:
            continue  # kept in another PID namespace: its keeper's pid is not ours to look up
        if kept.keeper_alive():
            found.append(kept)
        else:
            gone.append(kept)
    if gone:
        stays = _sweep(gone, grace)
        for kept in gone:
            say(f"pdserve: reuse: kept cluster {kept.id}'s keeper (pid {kept.keeper_pid}) is gone; stopped its servers")
        for kept, reason in stays:
            removed.append(f"left {kept.path} alone: its keeper is gone, but {reason}")
    for line in removed[:_NAMED_REMOVALS]:
        say(f"pdserve: reuse: {line}")
    if len(removed) > _NAMED_REMOVALS:
        say(f"pdserve: reuse: ... and {len(removed) - _NAMED_REMOVALS} more files in {reuse_dir} that were no state")
    return found


class Claim:
    """A kept cluster claimed by this run: the open connection *is* the claim (the kernel ends it if we die)."""

    def __init__(self, kept: KeptCluster, sock: socket.socket) -> None:
        self.kept = kept
        self._sock = sock

    def release(self) -> None:
        """Hand it back to its keeper (idle from now on)."""
        with contextlib.suppress(OSError):
            self._sock.close()

    def stop(self) -> None:
        """Ask its keeper to stop it now (a server died under this run)."""
        with contextlib.suppress(OSError):
            _request(self.kept, f"{protocol.STOP} {self.kept.id}")
        self.release()


def _connect(kept: KeptCluster) -> socket.socket:
    """Connect to the keeper, checking the other end is that keeper (its pid and our uid)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(_CONNECT_TIMEOUT)
    try:
        sock.connect("\0" + kept.keeper.socket)
        uid, pid = protocol.peer_uid_pid(sock)
        if uid != os.geteuid() or pid != kept.keeper_pid:
            raise OSError(f"socket {kept.keeper.socket} is served by pid {pid} uid {uid}, not by the keeper")
    except OSError:
        sock.close()
        raise
    return sock


def _request(kept: KeptCluster, line: str, timeout: float = 60.0) -> str:
    with contextlib.closing(_connect(kept)) as sock:
        sock.settimeout(timeout)
        sock.sendall(line.encode() + b"\n")
        return protocol.recv_line(sock)


def claim(kept: KeptCluster, ttl: float | None = None) -> Claim | None:
    """Claim ``kept`` for this run; None when another run holds it, or its keeper no longer has it.

    ``ttl``: this run's ``--pd-reuse-ttl``, the idle time after which the keeper stops it once we let go.
    """
    return _claim(kept, ttl)[0]


def _claim(kept: KeptCluster, ttl: float | None = None) -> tuple[Claim | None, str]:
    """``(claim, "")``, or ``(None, why not)``: ``""`` when another run holds it, else what is wrong with it."""
    stopped = kept.keeper_stopped()
    if stopped is not None:
        return None, stopped  # it would accept the connection and never answer
    try:
        sock = _connect(kept)
    except OSError as exc:
        return None, f"its keeper (pid {kept.keeper_pid}) could not be reached ({exc})"
    try:
        sock.settimeout(_CLAIM_TIMEOUT)  # the keeper may be busy stopping another cluster (a few seconds)
        sock.sendall(f"{protocol.claim_line(kept.id, ttl)}\n".encode())
        reply = protocol.recv_line(sock)
    except OSError as exc:
        sock.close()
        late = f"did not answer in {_CLAIM_TIMEOUT:g}s" if isinstance(exc, TimeoutError) else f"failed ({exc})"
        return None, kept.keeper_stopped() or f"its keeper (pid {kept.keeper_pid}) {late}"
    if reply != protocol.OK:
        sock.close()
        return None, {protocol.BUSY: "", protocol.UNKNOWN: "its keeper no longer keeps it"}.get(
            reply, f"its keeper (pid {kept.keeper_pid}) answered {reply!r}"
        )
    sock.settimeout(None)
    return Claim(kept, sock), ""


def keeper_info(kept: KeptCluster) -> dict[str, Any]:
    """What the keeper says of ``kept`` now (claimed, idle seconds); empty when it does not answer."""
    if kept.keeper_stopped() is not None:
        return {}
    try:
        info = json.loads(_request(kept, protocol.INFO, timeout=_CONNECT_TIMEOUT))
        return dict(info.get(kept.id, {}))
    except (OSError, ValueError, AttributeError):
        return {}


def _nothing_runs(kept: KeptCluster) -> bool:
    """Whether no process of ``kept`` runs any more (each gone, or its pid another process's now)."""
    return all(server.gone() is not None for server in kept.servers)


def stop_kept(kept: KeptCluster, grace: float = 3.0) -> bool:
    """Stop one kept cluster: through its keeper, or (keeper gone) by sweeping its servers. True once it is stopped,
    by this call or by anyone else meanwhile (another ``pdserve stop``, its keeper's TTL): what is asked is that
    nothing of it runs, and a loser of that race has nothing left to do.

    False when its keeper runs but did not stop it (:meth:`KeptCluster.keeper_stopped` says when it cannot), and
    something of it still runs. Only server tokens are ever swept, never the pids a state file names.
    """
    if kept.keeper_stopped() is not None:
        return False
    try:
        reply = json.loads(_request(kept, f"{protocol.STOP} {kept.id}"))
        if reply.get("left") == 0:  # that was its last cluster: it exits now; return once it did (and its guard)
            wait_for_gate(lambda: not kept.keeper_alive(), _KEEPER_EXIT_TIMEOUT, poll=0.02)
        if kept.id in reply.get("stopped", []):
            return True
        # Its keeper no longer keeps it: it was stopped meanwhile (a keeper lets a cluster go only by stopping it).
        return wait_for_gate(lambda: _nothing_runs(kept), _KEEPER_EXIT_TIMEOUT, poll=0.02) is None
    except (OSError, ValueError, AttributeError) as exc:
        # Nobody listens on its socket: that pid is no keeper (a keeper listens before it writes any state, and
        # removes its states before it exits), so the state is stale or planted: swept like a gone keeper's. A
        # keeper that dropped the connection may be exiting: another `pdserve stop` took its last cluster.
        if kept.keeper_alive() and not isinstance(exc, ConnectionRefusedError):
            wait_for_gate(lambda: not kept.keeper_alive(), _KEEPER_EXIT_TIMEOUT, poll=0.02)
            if kept.keeper_alive():
                return _nothing_runs(kept)
        _sweep([kept], grace)
        return True


def find_reusable(
    reuse_dir: Path, wanted: Mapping[str, str], spec_name: str, report: Report, ttl: float | None = None
) -> tuple[Claim | None, str | None]:
    """Claim a kept cluster whose fingerprint is ``wanted``: ``(claim, None)``, or ``(None, why not)`` where
    ``why`` names the nearest kept cluster and the components that differ (None when nothing was kept).
    ``ttl``: this run's ``--pd-reuse-ttl`` (see :func:`claim`)."""
    kept = list_kept(reuse_dir, report=report)
    if not kept:
        return None, None
    exact = [k for k in kept if k.fingerprint == wanted]
    busy, unreachable = [], []
    for k in sorted(exact, key=lambda k: k.created):
        dead = k.dead_server()
        if dead is not None:
            report(f"pdserve: reuse: kept cluster {k.id} not reused: {dead}; stopping it")
            stop_kept(k)
            continue
        got, why = _claim(k, ttl)
        if got is not None:
            return got, None
        if why:
            unreachable.append(f"kept cluster {k.id}: {why}")
        else:
            busy.append(k.id)
    if busy or unreachable:
        in_use = [f"kept cluster {', '.join(busy)} is in use by another run"] if busy else []
        return None, "; ".join([*in_use, *unreachable])
    nearest = min(kept, key=lambda k: (k.spec_name != spec_name, len(differences(k.fingerprint, wanted))))
    diff = differences(nearest.fingerprint, wanted)
    shown = ", ".join(diff[:8]) + (f" and {len(diff) - 8} more" if len(diff) > 8 else "")
    return None, f"kept cluster {nearest.id} differs in {shown}"
