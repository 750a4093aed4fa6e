"""The keeper: owns clusters kept for the next run (``--pd-reuse``) after the pytest that started them is gone.

At the end of a reuse run, pytest starts one keeper for the clusters it started and hands it everything that
must outlive pytest (:func:`pytest_pdserve.reuse.handover.keep`): the servers' process groups, pids, start times and
server tokens, and duplicates of the clusters' lease fds (``pass_fds``). The keeper then:

* writes one state file per cluster (``<reuse dir>/<id>.json``, mode 0600, `state.py`'s schema) that the next run
  and ``pdserve ls`` read, and removes it when it stops that cluster;
* listens on an abstract Unix socket (no path to plant or to outgrow 108 bytes; only our uid is served, checked
  with ``SO_PEERCRED``) and answers the words of `protocol.py`. A run that attaches *claims* a cluster by keeping
  a connection open: one claim per cluster at a time, and the kernel ends a claim whose run died. ``stop ID`` /
  ``stop *`` stop clusters now;
* stops a cluster when it was idle (unclaimed) for the TTL, when one of its servers died or was replaced
  (pid and start time), or when another run waits for its GPUs (that run holds a shared lock on the GPU's
  ``.want`` file, :func:`pytest_pdserve.machine.lockfiles.want`);
* on real CUDA, hands a stopped cluster's GPU leases back only once nvidia-smi lists none of its servers on them
  (the release gate pytest itself runs, :func:`pytest_pdserve.machine.gpu_probe.pids_off_gpus`);
* exits when no cluster is left. Exiting closes its lease fds; a lease frees once the servers holding it are gone.

Supervision does not stop at the keeper: it starts its own guard (:mod:`pytest_pdserve.running.supervise`) on its own
lifeline, so a SIGKILLed keeper still takes its servers down (the guard sweeps the run token), and the next
run removes the state files of a keeper that is gone. Like the watchdog, this module runs under
``python -I -S`` and imports only the standard library and our stdlib-only modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pytest_pdserve.common import created
from pytest_pdserve.common.logfile import check_writable, write_replace
from pytest_pdserve.machine.gpu_probe import GPU_RELEASE_TIMEOUT, pids_off_gpus, wait_for_gate
from pytest_pdserve.machine.lockfiles import KEPT_FOR_REUSE, unlock, write_holder
from pytest_pdserve.reuse import protocol
from pytest_pdserve.reuse.protocol import KeeperOrder, peer_uid_pid
from pytest_pdserve.reuse.state import STATE_SUFFIX, KeeperInfo, KeptServer, KeptState, parse_state
from pytest_pdserve.running.proctree import RUN_TOKEN_ENV, SERVER_TOKEN_ENV, pid_namespace, read_stat, terminate
from pytest_pdserve.running.rpc_dirs import remove_rpc_dir
from pytest_pdserve.running.supervise import start_guard

__all__ = ["is_wanted", "main"]

_MAX_INPUT = 4 << 20  # what pytest writes on our stdin: a few KB per cluster
_TICK = 0.5  # seconds between checks of TTL, server liveness and wanted GPUs
_GUARD_EXIT = 5.0  # seconds the guard may take to exit on SIGTERM (it only waits on its lifeline)


def _say(msg: str) -> None:
    with contextlib.suppress(OSError):
        sys.stderr.write(f"{time.strftime('%H:%M:%S')} pdserve-keeper[{os.getpid()}] {msg}\n")
        sys.stderr.flush()


def is_wanted(path: str) -> bool:
    """Whether some run is waiting for the GPU whose want file is ``path`` (it holds a shared lock on it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # no want file: nobody ever waited there
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


class _Kept:
    """One cluster this keeper owns."""

    def __init__(
        self,
        state: KeptState,
        locks: Sequence[tuple[int, Path]],
        want: Sequence[str],
        state_path: Path,
        state_ino: int | None = None,
    ) -> None:
        self.state = state
        self.id = state.id
        self.locks = list(locks)
        self.want = list(want)
        self.state_path = state_path
        #: The inode of the state file this keeper wrote: what proves it may remove it.
        self.state_ino = state_ino
        self.idle_since = time.monotonic()
        self.claim: socket.socket | None = None
        #: Idle seconds before it stops: the keeping run's --pd-reuse-ttl, then that of the last run that claimed it.
        self.ttl = state.keeper.ttl if state.keeper is not None else 0.0

    @property
    def servers(self) -> tuple[KeptServer, ...]:
        return self.state.processes

    def dead_server(self) -> str | None:
        return self.state.dead_server()

    def stop(self, why: str, grace: float, *, keep_logs: bool) -> None:
        t0 = time.monotonic()
        groups = [s.pgid for s in self.servers]
        tokens = [(SERVER_TOKEN_ENV, s.token) for s in self.servers]
        res = terminate(groups, env=tokens, grace=grace, kill_wait=10.0)
        for server in self.servers:  # their IPC sockets (rpc_dirs.py): the servers are gone
            remove_rpc_dir(server.rpc_dir)
        gated = self.state.release_gate
        if gated:  # as pytest's own release does (gpu_plan): the next server's memory check must not see these
            pids = {s.pid for s in self.servers}
            not_met = wait_for_gate(lambda: pids_off_gpus(set(gated), pids), GPU_RELEASE_TIMEOUT)
            if not_met is not None:
                _say(f"GPU release gate for {self.id} {not_met}; releasing {gated} anyway")
        for fd, path in self.locks:  # the servers are gone: the leases free now (files removed, as on release)
            with contextlib.suppress(OSError):
                if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                    unlock(fd, path)
                    continue
            with contextlib.suppress(OSError):
                os.close(fd)
        self.locks = []
        # Only what pdserve created (common/created.py): the state file this keeper wrote (its inode), the logs the
        # run recorded creating; a file put in their place since is left alone.
        with contextlib.suppress(OSError):  # a read-only file system: the next listing names the state left
            created.remove_file(self.state_path, expect_ino=self.state_ino)
        if not keep_logs:
            for server in self.servers:
                if server.log_path is not None:
                    with contextlib.suppress(OSError):
                        created.remove_file(Path(server.log_path))
        if self.claim is not None:  # the run holding it learns why (the keeper then drops the connection)
            with contextlib.suppress(OSError):
                self.claim.sendall(f"{protocol.stopped_line(self.id, why)}\n".encode())
        _say(f"stopped {self.id} ({why}) in {time.monotonic() - t0:.2f}s: left={list(res.remaining)}")


class _Keeper:
    def __init__(self, clusters: list[_Kept], listener: socket.socket, grace: float) -> None:
        self.clusters = {k.id: k for k in clusters}
        self.listener = listener
        self.grace = grace
        self.conns: dict[socket.socket, bytes] = {}
        self.stop_all: str | None = None

    def _stop(self, cid: str, why: str, *, keep_logs: bool = False) -> None:
        kept = self.clusters.pop(cid)
        kept.stop(why, self.grace, keep_logs=keep_logs)
        if kept.claim is not None:
            conn, kept.claim = kept.claim, None
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self.conns.pop(conn, None)
        for kept in self.clusters.values():
            if kept.claim is conn:  # the run that claimed it ended (or died): idle from now on
                kept.claim = None
                kept.idle_since = time.monotonic()
                _say(f"{kept.id} released")
        with contextlib.suppress(OSError):
            conn.close()

    def _answer(self, conn: socket.socket, line: str) -> None:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == protocol.CLAIM:  # the claiming run's --pd-reuse-ttl applies once it lets go
            cid, ttl = protocol.parse_claim(arg)
            kept = self.clusters.get(cid)
            if kept is None:
                reply = protocol.UNKNOWN
            elif kept.claim is not None or any(k.claim is conn for k in self.clusters.values()):
                reply = protocol.BUSY
            else:
                kept.claim = conn
                reply = protocol.OK
                if ttl is not None:
                    kept.ttl = ttl
                _say(f"{kept.id} claimed (ttl {kept.ttl:g}s once released)")
            conn.sendall(f"{reply}\n".encode())
        elif cmd == protocol.STOP:
            targets = list(self.clusters) if arg == protocol.STOP_ALL else [arg] if arg in self.clusters else []
            for cid in targets:
                self._stop(cid, "pdserve stop")
            # "left": 0 tells `pdserve stop` this keeper exits now; it waits for that (nothing left once it returns)
            conn.sendall((protocol.stop_reply(targets, len(self.clusters)) + "\n").encode())
        elif cmd == protocol.INFO:
            now = time.monotonic()
            info = {
                cid: {
                    "claimed": k.claim is not None,
                    "idle_seconds": 0.0 if k.claim is not None else round(now - k.idle_since, 1),
                    "ttl": k.ttl,
                }
                for cid, k in self.clusters.items()
            }
            conn.sendall((protocol.info_reply(info) + "\n").encode())
        else:
            conn.sendall(f"{protocol.ERROR_UNKNOWN}\n".encode())

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(protocol.MAX_LINE)
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        buf = self.conns.get(conn, b"") + data
        if len(buf) > protocol.MAX_LINE:
            self._drop(conn)
            return
        while b"\n" in buf:
            line, _, buf = buf.partition(b"\n")
            try:
                self._answer(conn, line.decode(errors="replace"))
            except OSError:
                self._drop(conn)
                return
        self.conns[conn] = buf

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        try:
            uid, _pid = peer_uid_pid(conn)
        except OSError:
            uid = -1
        if uid != os.geteuid():  # abstract sockets have no file mode: the peer's uid is the permission
            _say(f"refused a connection from uid {uid}")
            conn.close()
            return
        conn.settimeout(5.0)  # a client that stops reading must not stall the keeper in sendall
        self.conns[conn] = b""

    def _check(self) -> None:
        now = time.monotonic()
        for cid, kept in list(self.clusters.items()):
            why = kept.dead_server()
            keep_logs = why is not None  # a death's log says why: keep it
            if why is None and kept.claim is None:
                if not kept.state_path.exists():  # e.g. the reuse dir was removed: no run can find it again
                    why = "its state file is gone"
                elif now - kept.idle_since >= kept.ttl:
                    why = f"idle for {kept.ttl:g}s"
                elif any(is_wanted(p) for p in kept.want):
                    why = "another run waits for its leases (GPUs or a fixed port)"
            if why is not None:
                self._stop(cid, why, keep_logs=keep_logs)

    def run(self) -> None:
        last = 0.0
        for _ in range(1 << 40):  # bounded only against a logic error
            if self.stop_all is not None:
                for cid in list(self.clusters):
                    self._stop(cid, self.stop_all)
            if not self.clusters:
                return
            ready, _, _ = select.select([self.listener, *self.conns], [], [], _TICK)
            for sock in ready:
                if sock is self.listener:
                    self._accept()
                else:
                    self._read(sock)
            if time.monotonic() - last >= _TICK:
                last = time.monotonic()
                self._check()


def _write_state(path: Path, state: dict[str, Any]) -> int:
    """Write a new cluster's state file; its inode (what lets this keeper remove it later: common/created.py).

    :raises OSError: something is there already (its id is new: what is there is not ours to replace)."""
    check_writable(path)  # a link, a FIFO...: named as what it is
    if os.path.lexists(path):
        raise OSError(errno.EEXIST, "a file is there already, which pdserve did not write", str(path))
    return write_replace(path, json.dumps(state).encode())  # never through a link planted as the state file


def _listen(uid: int) -> tuple[socket.socket, str]:
    for _ in range(10):
        name = protocol.socket_name(uid, os.urandom(8).hex())
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind("\0" + name)
        except OSError:
            sock.close()
            continue
        sock.listen(16)
        return sock, name
    raise OSError("no free abstract socket name")


def main(argv: Sequence[str] | None = None) -> int:
    """Keeper entry point; reads its clusters as JSON on stdin, prints ``ready <pid>`` when it owns them."""
    del argv
    raw = sys.stdin.buffer.read(_MAX_INPUT)
    try:
        order = KeeperOrder.decode(raw)
        states = [parse_state(item.state) for item in order.clusters]
    except (ValueError, KeyError, TypeError) as exc:
        print(f"error: bad keeper order: {exc}", flush=True)
        return 2
    reuse_dir, ttl, grace, run_token = Path(order.reuse_dir), order.ttl, order.grace, order.run_token
    # Detach from pytest: it waits for this first process, which exits at once; the keeper is the child.
    if os.fork() > 0:
        os._exit(0)
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    listener, name = _listen(os.geteuid())
    me = read_stat(os.getpid())
    started = time.time()
    clusters = []
    info = KeeperInfo(os.getpid(), me.starttime if me else 0, name, ttl, started, pid_namespace())
    for item, parsed in zip(order.clusters, states, strict=True):
        state = dataclasses.replace(parsed, keeper=info)
        path = reuse_dir / f"{state.id}{STATE_SUFFIX}"
        try:
            ino = _write_state(path, state.as_dict())
        except OSError as exc:  # e.g. a link planted where the state file goes: said to the run, which stops them
            print(f"error: cannot write the state file {path}: {exc.strerror or exc}", flush=True)
            return 2
        locks = [(fd, Path(lock)) for fd, lock in item.locks]
        for _, lock in locks:  # a run waiting for these names the keeper, not the pytest that is gone
            write_holder(lock, f"{KEPT_FOR_REUSE}: {state.id} (pdserve ls)")
        clusters.append(_Kept(state, locks, item.want, path, ino))
    keeper = _Keeper(clusters, listener, grace)

    def on_term(signum: int, frame: object) -> None:
        keeper.stop_all = f"signal {signum}"

    signal.signal(signal.SIGTERM, on_term)
    # Our own guard: if this keeper is SIGKILLed, it stops every process of the run token (the kept servers).
    guard = start_guard(run_token, grace, reuse_dir / "guard.log")
    print(protocol.ready_line(os.getpid(), name), flush=True)
    with contextlib.suppress(OSError):  # pytest reads until EOF: we are ready, and pytest may go
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    _say(f"keeping {sorted(keeper.clusters)} (ttl {ttl:g}s, token {RUN_TOKEN_ENV}={run_token})")
    try:
        keeper.run()
    finally:
        _say("no cluster left: exiting")
        guard.terminate()  # nothing left to guard; reaped, so that nothing of ours outlives our exit
        try:
            guard.wait(_GUARD_EXIT)
        except subprocess.TimeoutExpired:
            guard.kill()
            guard.wait(_GUARD_EXIT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
