"""The kept-cluster state: one schema, one reader (``<reuse dir>/<id>.json``). [stdlib-only: the keeper imports it]

A reuse run describes each cluster it keeps as a `KeptState` (`handover.cluster_state`) and sends it to the keeper,
which adds its own `KeeperInfo` and writes the file (mode 0600, never through a link); the next run and
``pdserve ls`` read it back with :func:`read_state`. Every field is here, once, with its type: nobody else reads or
writes the JSON by key. The file carries :data:`SCHEMA_VERSION` (a file without one is version 1, as written before
the field existed); a file that does not parse, has another version, or names a non-finite time is refused (the
caller removes it and says so), never trusted.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pytest_pdserve.errors import OtherSchema
from pytest_pdserve.running.proctree import alive_as, listens_on, read_stat

__all__ = [
    "SCHEMA_VERSION",
    "OtherSchema",
    "STATE_SUFFIX",
    "KeeperInfo",
    "KeptCluster",
    "KeptServer",
    "KeptState",
    "parse_state",
    "read_state",
]

SCHEMA_VERSION = 1
STATE_SUFFIX = ".json"
_MAX_STATE = 1 << 20


def _finite(value: Any) -> float:
    """A time or a TTL from a state file: Python's json reads ``NaN`` and ``Infinity``, which no clock shows."""
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number")
    return number


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class KeptServer:
    """One kept process (a server or the proxy): what proves it is the one kept, and what rebuilds its handle."""

    name: str
    pid: int
    pgid: int
    starttime: int
    #: Its ``PDSERVE_SERVER_TOKEN``: the only thing a sweep ever signals by.
    token: str
    url: str
    role: str = ""
    index: int = 0
    log_path: str | None = None
    gpus: tuple[str, ...] = ()
    rpc_dir: str | None = None
    ports: tuple[int, int, int] | None = None
    #: Redacted (an --hf-token's value is a secret); the API key and other secrets stay out of ``env``.
    argv: tuple[str, ...] | None = None
    env: dict[str, str | None] | None = None
    ready_seconds: float | None = None
    #: What ``/v1/models`` listed at the start: an attach that finds more or less refuses the cluster.
    served_models: tuple[str, ...] | None = None
    #: ``/weight_info`` at the start: a test that set another weight version changed the weights.
    weight_version: str | None = None

    @classmethod
    def parse(cls, s: Mapping[str, Any]) -> KeptServer:
        ports = s.get("ports")
        argv, env, models = s.get("argv"), s.get("env"), s.get("served_models")
        return cls(
            name=str(s["name"]), pid=int(s["pid"]), pgid=int(s["pgid"]), starttime=int(s["starttime"]),
            token=str(s["token"]), url=str(s["url"]), role=str(s.get("role", "")), index=int(s.get("index", 0)),
            log_path=None if s.get("log_path") is None else str(s["log_path"]),
            gpus=tuple(str(g) for g in s.get("gpus") or ()),
            rpc_dir=None if s.get("rpc_dir") is None else str(s["rpc_dir"]),
            ports=(int(ports[0]), int(ports[1]), int(ports[2])) if ports else None,
            argv=tuple(str(a) for a in argv) if argv is not None else None,
            env={str(k): None if v is None else str(v) for k, v in dict(env).items()} if env is not None else None,
            ready_seconds=_opt_float(s.get("ready_seconds")),
            served_models=tuple(str(m) for m in models) if models is not None else None,
            weight_version=None if s.get("weight_version") is None else str(s["weight_version"]),
        )  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "role": self.role, "index": self.index, "url": self.url, "pid": self.pid,
            "pgid": self.pgid, "starttime": self.starttime, "token": self.token, "log_path": self.log_path,
            "gpus": list(self.gpus), "rpc_dir": self.rpc_dir, "ports": list(self.ports) if self.ports else None,
            "argv": list(self.argv) if self.argv is not None else None, "env": self.env,
            "ready_seconds": self.ready_seconds,
            "served_models": list(self.served_models) if self.served_models is not None else None,
            "weight_version": self.weight_version,
        }  # fmt: skip

    def gone(self) -> str | None:
        """Why this is not the kept process any more (gone, or its pid names another process now), or None."""
        return None if alive_as(self.pid, self.starttime) else f"{self.name} (pid {self.pid}) is gone"


@dataclass(frozen=True)
class KeeperInfo:
    """The keeper that owns a kept cluster, as it wrote itself into the state file."""

    pid: int
    starttime: int
    #: Its abstract Unix socket's name (`protocol.py`).
    socket: str
    #: Idle seconds before it stops the cluster (the keeping run's --pd-reuse-ttl).
    ttl: float
    since: float
    #: Its PID namespace (`proctree.pid_namespace`): its pid means nothing in another (a container sharing the dir).
    pidns: str | None = None

    @classmethod
    def parse(cls, k: Mapping[str, Any]) -> KeeperInfo:
        pidns = k.get("pidns")
        return cls(
            int(k["pid"]), int(k["starttime"]), str(k["socket"]), _finite(k["ttl"]), _finite(k["since"]),
            None if pidns is None else str(pidns),
        )  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "starttime": self.starttime, "socket": self.socket, "ttl": self.ttl,
                "since": self.since, "pidns": self.pidns}  # fmt: skip


@dataclass(frozen=True)
class KeptState:
    """One kept cluster (no secret: digests, URLs, pids, tokens, logs). ``keeper`` is None until a keeper owns it."""

    id: str
    fingerprint: dict[str, str]
    created: float
    servers: tuple[KeptServer, ...]
    proxy: KeptServer
    spec_name: str = "?"
    label: str = ""
    run_token: str = ""
    engine: str = "?"
    model: str = "?"
    vllm_version: str | None = None
    block_size: int = 0
    attention_backend: str | None = None
    platform: str = "cpu"
    started_seconds: float = 0.0
    pd_ready_seconds: float | None = None
    #: The GPU UUIDs whose leases the keeper hands back only once nvidia-smi lists none of the servers on them.
    release_gate: tuple[str, ...] | None = None
    keeper: KeeperInfo | None = None
    schema: int = SCHEMA_VERSION

    @property
    def processes(self) -> tuple[KeptServer, ...]:
        """The servers, then the proxy: every process the keeper owns."""
        return (*self.servers, self.proxy)

    @property
    def topology(self) -> tuple[int, int]:
        return sum(s.role == "prefill" for s in self.servers), sum(s.role == "decode" for s in self.servers)

    def dead_server(self) -> str | None:
        """The first kept process that is not the one kept, in words; None if all run. The one liveness rule of
        kept servers: the keeper applies it every tick, a run before it attaches."""
        return next((why for s in self.processes if (why := s.gone()) is not None), None)

    def as_dict(self) -> dict[str, Any]:
        p, d = self.topology
        return {
            "schema": self.schema, "id": self.id, "spec_name": self.spec_name, "label": self.label,
            "created": self.created, "fingerprint": dict(self.fingerprint), "run_token": self.run_token,
            "engine": self.engine, "model": self.model, "vllm_version": self.vllm_version,
            "block_size": self.block_size, "attention_backend": self.attention_backend, "platform": self.platform,
            "started_seconds": self.started_seconds, "pd_ready_seconds": self.pd_ready_seconds, "topology": [p, d],
            "servers": [s.as_dict() for s in self.servers], "proxy": self.proxy.as_dict(),
            "release_gate": list(self.release_gate) if self.release_gate else None,
            **({"keeper": self.keeper.as_dict()} if self.keeper is not None else {}),
        }  # fmt: skip


def parse_state(data: Any) -> KeptState:
    """The one reader of the schema (a file's JSON, or a keeper's order); :raises ValueError: what is wrong
    (:class:`OtherSchema`: it is another version's)."""
    try:
        schema = int(data.get("schema", 1))  # files written before the field are version 1
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a kept-cluster state ({type(exc).__name__}: {exc})") from None
    if schema != SCHEMA_VERSION:
        raise OtherSchema(f"a kept-cluster state of schema version {schema}, not {SCHEMA_VERSION} (another pdserve)")
    try:
        gate = data.get("release_gate")
        keeper = data.get("keeper")
        return KeptState(
            id=str(data["id"]), fingerprint={str(k): str(v) for k, v in dict(data["fingerprint"]).items()},
            created=_finite(data["created"]), servers=tuple(KeptServer.parse(s) for s in data["servers"]),
            proxy=KeptServer.parse(data["proxy"]), spec_name=str(data.get("spec_name", "?")),
            label=str(data.get("label", "")), run_token=str(data.get("run_token", "")),
            engine=str(data.get("engine", "?")), model=str(data.get("model", "?")),
            vllm_version=None if data.get("vllm_version") is None else str(data["vllm_version"]),
            block_size=int(data.get("block_size") or 0),
            attention_backend=None if data.get("attention_backend") is None else str(data["attention_backend"]),
            platform=str(data.get("platform", "cpu")), started_seconds=float(data.get("started_seconds") or 0.0),
            pd_ready_seconds=_opt_float(data.get("pd_ready_seconds")),
            release_gate=tuple(str(g) for g in gate) if gate else None,
            keeper=KeeperInfo.parse(keeper) if keeper is not None else None,
        )  # fmt: skip
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise ValueError(f"not a kept-cluster state ({type(exc).__name__}: {exc})") from None


def read_state(path: Path) -> KeptCluster:
    """Read one state file (ours, regular, bounded, not through a link); :raises ValueError: what is wrong with
    it (``OSError``: it cannot be read, e.g. its keeper removed it meanwhile)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ValueError("not a regular file of ours")
        if st.st_size > _MAX_STATE:  # not read at all: a directory of huge files must not cost their size
            raise ValueError("larger than 1 MiB")
        raw = os.read(fd, _MAX_STATE + 1)
    finally:
        os.close(fd)
    if len(raw) > _MAX_STATE:
        raise ValueError("larger than 1 MiB")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"not a kept-cluster state ({type(exc).__name__}: {exc})") from None
    state = parse_state(data)
    if state.keeper is None:
        raise ValueError("not a kept-cluster state (KeyError: 'keeper')")
    return KeptCluster(path, state, state.keeper)


@dataclass(frozen=True)
class KeptCluster:
    """One kept cluster, as its state file describes it, and what can be learnt of it without its keeper."""

    path: Path
    state: KeptState
    keeper: KeeperInfo

    @property
    def id(self) -> str:
        return self.state.id

    @property
    def spec_name(self) -> str:
        return self.state.spec_name

    @property
    def fingerprint(self) -> dict[str, str]:
        return self.state.fingerprint

    @property
    def created(self) -> float:
        return self.state.created

    @property
    def servers(self) -> Sequence[KeptServer]:
        return self.state.processes

    @property
    def keeper_pid(self) -> int:
        return self.keeper.pid

    @property
    def ttl(self) -> float:
        return self.keeper.ttl

    @property
    def socket_name(self) -> str:
        """Its keeper's abstract socket (`protocol.py`)."""
        return self.keeper.socket

    def keeper_alive(self) -> bool:
        """Whether the keeper that wrote this state still runs (same pid *and* start time: no pid reuse)."""
        return alive_as(self.keeper.pid, self.keeper.starttime)

    def dead_server(self) -> str | None:
        """The first server that is not the process that was kept, else None (the keeper's own rule)."""
        return self.state.dead_server()

    def foreign_listener(self) -> str | None:
        """The first server whose URL is not served by the kept process itself, in words, else None.

        The state file can be edited (by the user, or whoever can write the reuse dir): a URL pointed at another
        listener would receive this run's API key with the first request. So before any request, each URL must be
        ``http://127.0.0.1:PORT`` and PORT a listening socket of the kept pid (`proctree.listens_on`).
        """
        for server in self.servers:
            url = urlsplit(server.url)
            try:
                port = url.port
            except ValueError:
                port = None
            if url.scheme != "http" or url.hostname != "127.0.0.1" or port is None:
                return f"{server.name}: its URL {server.url!r} is not http://127.0.0.1:PORT"
            if not listens_on(server.pid, port):
                return (
                    f"{server.name}: port {port} is not a listening socket of the kept process "
                    f"(pid {server.pid}): the state file {self.path} was changed or the port was taken over; "
                    "nothing was sent to it"
                )
        return None

    def keeper_stopped(self) -> str | None:
        """Why its keeper cannot answer now, when it is stopped (SIGSTOP, a debugger, a frozen cgroup), else None.

        A stopped keeper accepts connections (the kernel queues them) and never answers: whoever talks to it
        would wait out the timeout and then guess why. Nothing signals it for us: the user decides.
        """
        pid = self.keeper.pid
        info = read_stat(pid)
        if info is None or info.starttime != self.keeper.starttime or info.state not in ("T", "t"):
            return None
        return (
            f"its keeper (pid {pid}) is stopped (SIGSTOP or a debugger): `kill -CONT {pid}` lets it go on, "
            f"`kill -9 {pid}` has its guard stop its servers"
        )
