"""The objects tests get: a running (or attached) P/D cluster and its servers.

`PDCluster` is what ``pd_cluster`` gives a test; `ServerHandle` is one of its servers (prefill, decode
or proxy) with URL, httpx clients, log and metrics. Who starts, shares and stops clusters lives in `manager.py`; attach
mode (servers someone else started) in `attach.py`. Both build on this module, which imports neither
(no import cycle).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pytest_pdserve import clients
from pytest_pdserve.common.deadline import within
from pytest_pdserve.common.logfile import log_size, read_since
from pytest_pdserve.config.commands import ServerCommand, ServerPorts
from pytest_pdserve.engines.engine import SIM_DEFAULT_MODELS as SIM_DEFAULT_MODELS  # named here too (older imports)
from pytest_pdserve.engines.engine import SIM_VERSION as SIM_VERSION
from pytest_pdserve.engines.engine import EngineSetup as EngineSetup
from pytest_pdserve.errors import PDServeError, RequestFailed
from pytest_pdserve.metrics import MetricsSnapshot, scrape
from pytest_pdserve.running import proctree
from pytest_pdserve.running.health import AsyncGuardedTransport, ClusterHealth, GuardedTransport
from pytest_pdserve.running.process import ServerProcess
from pytest_pdserve.spec import ClusterSpec

REQUEST_FAILED_MESSAGE = "{name}: {method} {url}{path} -> {status}: {body}\n  request: {request}"

#: Starts a stopped server of a running cluster again and waits until it answers (the launcher's ``respawn``).
Respawner = Callable[[ServerProcess], ServerProcess]


@dataclass(frozen=True)
class Reused:
    """Where a reused cluster came from (``--pd-reuse``, `reuse/adopt.py`)."""

    #: The kept cluster's id (what ``pdserve ls`` lists).
    kept_id: str
    #: Seconds since it was first started.
    age_seconds: float
    #: How long that first start took (what this run did not pay).
    first_start_seconds: float

    def describe(self) -> str:
        """``kept cluster pd_cluster-1-ab12cd, 2m05s old (its start took 71.2s)``."""
        minutes, seconds = divmod(int(self.age_seconds), 60)
        age = f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"
        return f"kept cluster {self.kept_id}, {age} old (its start took {self.first_start_seconds:.1f}s)"


@dataclass
class ServerHandle:
    """One server of a cluster (prefill, decode or proxy), running or attached.

    :ivar url: ``http://127.0.0.1:PORT`` (no trailing slash).
    :ivar gpus: the device tokens this server sees (``CUDA_VISIBLE_DEVICES`` value), empty on CPU.
    """

    role: str
    index: int
    url: str
    api_key: str | None = field(default=None, repr=False)  # a repr lands in assertion messages and -l output
    log_path: Path | None = None
    process: ServerProcess | None = None
    command: ServerCommand | None = None
    ports: ServerPorts | None = None
    gpus: tuple[str, ...] = ()
    ready_seconds: float | None = None
    #: The cluster's liveness verdict, shared by its servers' clients (set by PDCluster).
    health: ClusterHealth | None = field(default=None, repr=False)
    _client: httpx.Client | None = field(default=None, repr=False)
    #: The served model id (set by the cluster), the default ``model`` of :meth:`complete` / :meth:`chat`.
    model: str | None = None
    #: How :meth:`restart` starts this server again (set by the launcher; None for attached and reused servers).
    respawn: Respawner | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        """``prefill-0``, ``decode-1``, ``proxy``."""
        return "proxy" if self.role == "proxy" else f"{self.role}-{self.index}"

    @property
    def port(self) -> int:
        """The HTTP port."""
        url = httpx.URL(self.url)
        return url.port or (443 if url.scheme == "https" else 80)

    @property
    def side_channel_port(self) -> int | None:
        """The NIXL side-channel port (``VLLM_NIXL_SIDE_CHANNEL_PORT``), None for the proxy or attached servers."""
        return self.ports.side_channel if self.ports is not None and self.role != "proxy" else None

    @property
    def headers(self) -> dict[str, str]:
        """Headers every request needs (the API key, when the servers require one)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def client(self) -> httpx.Client:
        """A reusable httpx client with ``base_url`` set and the API key sent."""
        if self._client is None or self._client.is_closed:
            # The transport adds the test's cache_salt and names this server in timeouts (clients.py); under it,
            # the guard turns a server that died under a test into one clear error (health.py).
            guard = GuardedTransport(self.health, self.name) if self.health is not None else None
            self._client = clients.make_client(self.label, self.url, self.headers, inner=guard)
        return self._client

    def async_client(self, **kwargs: Any) -> httpx.AsyncClient:
        """A new `httpx.AsyncClient` for this server (same salt and timeout rules); the caller closes it."""
        if self.health is not None and "transport" not in kwargs:
            kwargs["inner"] = AsyncGuardedTransport(self.health, self.name)
        return clients.make_async_client(self.label, self.url, self.headers, **kwargs)

    @property
    def label(self) -> str:
        """``decode-0 (http://127.0.0.1:8200)``: how errors name this server."""
        return f"{self.name} ({self.url})"

    def complete(self, prompt: str | list[int], **body: Any) -> dict[str, Any]:
        """POST ``/v1/completions`` to this server (temperature 0 unless given) and return the JSON.

        :raises RequestFailed: (an ``AssertionError``) on any answer but HTTP 200 (``clients.request_failed``, the rule
            ``assertions.complete`` follows too), naming the server and the request.
        """
        __tracebackhide__ = True
        payload: dict[str, Any] = {"prompt": prompt, "temperature": 0.0, **body}
        return self._post_json("/v1/completions", payload)

    def complete_within(self, total: float, prompt: str | list[int], **body: Any) -> dict[str, Any]:
        """:meth:`complete`, answered in full within ``total`` seconds (``httpx.ReadTimeout`` past it): for the
        plugin's own checks, which a server trickling its answer must not hold (httpx's timeouts are per read)."""
        __tracebackhide__ = True
        payload: dict[str, Any] = {"prompt": prompt, "temperature": 0.0, **body}
        return self._post_json("/v1/completions", payload, total=total)

    def chat(self, messages: Sequence[Mapping[str, Any]] | str, **body: Any) -> dict[str, Any]:
        """POST ``/v1/chat/completions`` (a string is one user message; temperature 0 unless given)."""
        __tracebackhide__ = True
        msgs = [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)
        payload: dict[str, Any] = {"messages": msgs, "temperature": 0.0, **body}
        return self._post_json("/v1/chat/completions", payload)

    def reset_prefix_cache(self, *, reset_external: bool = True) -> bool:
        """``POST /reset_prefix_cache``; False when the server has no such route (vLLM needs
        ``VLLM_SERVER_DEV_MODE=1``, which the plugin sets). :raises AssertionError: the reset failed.

        ``reset_external=True`` (unlike vLLM's default) also empties the KV connector's own cache, an
        OffloadingConnector's CPU tier, so the next request is cold there too."""
        __tracebackhide__ = True
        return clients.reset_prefix_cache(self.client, self.label, reset_external=reset_external)

    def _post_json(self, path: str, payload: dict[str, Any], total: float | None = None) -> dict[str, Any]:
        __tracebackhide__ = True
        if self.model is not None:
            payload.setdefault("model", self.model)
        response = self.client.post(path, json=payload, extensions=within(total) if total is not None else None)
        if clients.request_failed(response):
            raise RequestFailed(
                REQUEST_FAILED_MESSAGE.format(
                    name=self.name,
                    method="POST",
                    url=self.url,
                    path=path,
                    status=response.status_code,
                    body=clients.body_excerpt(response.text),
                    request=clients.summarize(response.request),
                ),
                response.status_code,
            )
        result: dict[str, Any] = response.json()
        return result

    def metrics(self) -> MetricsSnapshot:
        """Scrape ``/metrics`` now."""
        return scrape(self.client)

    # ------------------------------------------------------------------ faults a test causes on purpose
    # The cluster's death detection (running/health.py) is told of each: while this server is down on purpose, what
    # requests meet because of it (a refused connection, a proxy's 502, a KV load that fails) is passed through for
    # the test to assert on, never turned into ServerDied. A server still down at the end of the test is resumed, or
    # its cluster stopped (glue/fixtures.py), so the next test never meets it.

    def unread_bytes(self) -> int:
        """Bytes that reached this server's HTTP port and that it has not read yet (Linux: /proc/net/tcp): above 0
        while a paused server holds a request, so a test can wait until its request is really waiting on it."""
        return proctree.unread_bytes(self.port)

    @property
    def down(self) -> str | None:
        """Why this server is down on purpose (``"paused by the test"``, ...), None when it is not."""
        return self.health.expected.get(self.name) if self.health is not None else None

    @contextlib.contextmanager
    def expect_down(self, why: str = "down on purpose") -> Iterator[ServerHandle]:
        """Tell the cluster's death detection that this server is down on purpose for the block (a fault the test
        causes some other way: a signal of its own, a firewall rule); :meth:`pause` and :meth:`kill` use it."""
        self._expect(why)
        try:
            yield self
        finally:
            self._unexpect()

    def pause(self) -> None:
        """SIGSTOP this server and every process it started (a hung server: it keeps its ports and connections,
        accepts and answers nothing) until :meth:`resume`."""
        proc = self._own_process("pause")
        self._expect("paused by the test")
        proc.pause()

    def resume(self) -> None:
        """SIGCONT what :meth:`pause` stopped; the server is expected to be up again."""
        self._own_process("resume").resume()
        self._unexpect()

    def kill(self) -> None:
        """SIGKILL this server and every process it started (a crash), its log kept; down on purpose until
        :meth:`restart`."""
        proc = self._own_process("kill")
        self._expect("killed by the test")
        proc.stop(grace=0)

    def restart(self) -> float:
        """Start this server again, with the same command, ports, GPUs and log (appended to), stopping it first if it
        still runs; returns the seconds until it answered ``/health`` and listed its model. That is HTTP-ready: for
        P/D-ready, ``assertions.assert_pd_ready(cluster)``.

        :raises PDServeError: an attached or reused server (pdserve did not start it in this run).
        :raises ServerStartupError: it did not come up again (its log tail and a hint, as at a start).
        """
        proc = self._own_process("restart")
        if self.respawn is None:
            raise PDServeError(f"{self.name}: this run did not start it, so it cannot start it again")
        self._expect("restarting")
        fresh = self.respawn(proc)
        self.process = fresh
        if self._client is not None:  # its connections went with the old process
            self._client.close()
            self._client = None
        self._unexpect()
        return fresh.ready_seconds()

    @contextlib.contextmanager
    def paused(self) -> Iterator[ServerHandle]:
        """:meth:`pause` for the block, :meth:`resume` after it (also when the block fails)."""
        self.pause()
        try:
            yield self
        finally:
            self.resume()

    @contextlib.contextmanager
    def killed(self) -> Iterator[ServerHandle]:
        """:meth:`kill` for the block, :meth:`restart` after it (also when the block fails)."""
        self.kill()
        try:
            yield self
        finally:
            self.restart()

    def _own_process(self, what: str) -> ServerProcess:
        if self.process is None:
            raise PDServeError(
                f"{self.name} ({self.url}): cannot {what} it: pdserve did not start it in this run (an attached or"
                " a reused kept server), so it has no process to signal"
            )
        return self.process

    def _expect(self, why: str) -> None:
        if self.health is not None:
            self.health.expected[self.name] = why

    def _unexpect(self) -> None:
        if self.health is not None:
            self.health.expected.pop(self.name, None)

    def log_offset(self) -> int:
        """Current size of the log file (0 for attached servers)."""
        return log_size(self.log_path)

    def read_log(self, since: int = 0, max_bytes: int = 256 * 1024) -> str:
        """Log text written after byte offset ``since`` (the last ``max_bytes`` of it)."""
        return read_since(self.log_path, since, max_bytes)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


@dataclass
class PDCluster:
    """A running (or attached) P/D cluster: what ``pd_cluster`` gives a test.

    ``cluster.client`` talks to the proxy; ``cluster.prefill[i]`` / ``cluster.decode[j]`` to each server.
    """

    spec: ClusterSpec
    engine: str
    model: str
    block_size: int
    #: The attention backend asked for (the spec's, else the session's; None or ``auto``: the engine picks). What
    #: the servers run is :attr:`attention_backend`.
    attention_backend_asked: str | None
    prefill: tuple[ServerHandle, ...]
    decode: tuple[ServerHandle, ...]
    proxy: ServerHandle
    attached: bool = False
    #: "cuda", "rocm" or "cpu": where the servers run (examples skip what a platform cannot do).
    platform: str = "cpu"
    vllm_version: str | None = None
    started_seconds: float = 0.0
    _stopped: bool = field(default=False, repr=False)
    #: ``{server name: verify.ObservedConfig}``: what each server really runs, read back at start (verify.py).
    observed: dict[str, Any] = field(default_factory=dict, repr=False)
    #: Seconds the P/D-ready round trip took after HTTP readiness (None: not run).
    pd_ready_seconds: float | None = None
    #: Set when this run reused a kept cluster (``--pd-reuse``): which one and how old it is.
    reused: Reused | None = None
    #: What vLLM runs instead of what was asked, what a cluster value overrode of the session's, and limits vLLM has
    #: under requests (pytest_pdserve/rules/, effective.py): one line each, also in the ready line.
    notes: tuple[str, ...] = ()
    #: Whether a server died under a test (health.py); every client of the cluster shares it.
    health: ClusterHealth = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.health = ClusterHealth(self.spec.name, lambda: self.servers)
        for server in self.servers:
            self._adopt(server)

    @classmethod
    def of(
        cls,
        spec: ClusterSpec,
        servers: Sequence[ServerHandle],
        proxy: ServerHandle,
        *,
        engine: str,
        model: str,
        block_size: int,
        attention_backend_asked: str | None,
        attached: bool = False,
        platform: str = "cpu",
        vllm_version: str | None = None,
        started_seconds: float = 0.0,
        reused: Reused | None = None,
        notes: tuple[str, ...] = (),
    ) -> PDCluster:
        """The one way pdserve makes a cluster (a fresh start, attach mode, a kept cluster adopted): its prefill and
        decode ``servers`` (in index order within each role) and ``proxy``, split by role here."""
        return cls(
            spec=spec, engine=engine, model=model, block_size=block_size,
            attention_backend_asked=attention_backend_asked,
            prefill=tuple(s for s in servers if s.role == "prefill"),
            decode=tuple(s for s in servers if s.role == "decode"), proxy=proxy, attached=attached, platform=platform,
            vllm_version=vllm_version, started_seconds=started_seconds, reused=reused, notes=notes,
        )  # fmt: skip

    def set_proxy(self, proxy: ServerHandle) -> None:
        """Put ``proxy`` in front of the cluster (attach mode starts it after the servers answered)."""
        self.proxy = proxy
        self._adopt(proxy)

    def _adopt(self, server: ServerHandle) -> None:
        if server.model is None:  # server.complete()/chat() send the served model by default
            server.model = self.model
        server.health = self.health
        if server._client is not None:  # made before it joined the cluster (readiness): rebuild it guarded
            server._client.close()
            server._client = None

    @property
    def attention_backend(self) -> str | None:
        """The attention backend the servers run: the one read back at the start (``verify.py``) when they agree on
        one, else :attr:`attention_backend_asked`. The start fails when a server runs another backend than a named
        one asked, so the two differ only where ``auto`` (or nothing) was asked: this is then what vLLM picked."""
        seen = {getattr(o, "attention_backend", None) for o in self.observed.values()}
        if len(seen) == 1 and None not in seen:
            return seen.pop()
        return self.attention_backend_asked

    @property
    def effective(self) -> dict[str, Any]:
        """The older name of :attr:`observed` (kept working; ``effective.AskedConfig`` is what was asked)."""
        return self.observed

    @property
    def url(self) -> str:
        """The proxy's base URL; OpenAI routes live under ``/v1``."""
        return self.proxy.url

    @property
    def base_url(self) -> str:
        """``<proxy>/v1``, for OpenAI-style clients."""
        return f"{self.proxy.url}/v1"

    @property
    def client(self) -> httpx.Client:
        """httpx client for the proxy."""
        return self.proxy.client

    @property
    def servers(self) -> tuple[ServerHandle, ...]:
        """Prefill servers, decode servers, then the proxy."""
        return (*self.prefill, *self.decode, self.proxy)

    @property
    def log_paths(self) -> dict[str, Path]:
        """``{name: log file}`` for every server that has one."""
        return {s.name: s.log_path for s in self.servers if s.log_path is not None}

    def metrics(self) -> dict[str, MetricsSnapshot]:
        """Scrape every prefill and decode server: ``{name: snapshot}``."""
        return {s.name: s.metrics() for s in (*self.prefill, *self.decode)}

    def complete(self, prompt: str | list[int], **body: Any) -> dict[str, Any]:
        """POST ``/v1/completions`` through the proxy (temperature 0 unless given) and return the JSON."""
        __tracebackhide__ = True
        return self.proxy.complete(prompt, **{"model": self.model, **body})

    def chat(self, messages: Sequence[Mapping[str, Any]] | str, **body: Any) -> dict[str, Any]:
        """POST ``/v1/chat/completions`` through the proxy (a string is one user message)."""
        __tracebackhide__ = True
        return self.proxy.chat(messages, **{"model": self.model, **body})

    def describe(self) -> str:
        """The one-line summary printed when the cluster is ready."""
        parts = []
        for s in (*self.prefill, *self.decode):
            gpu = f" gpu={','.join(s.gpus)}" if s.gpus else ""
            side = f" nixl={s.side_channel_port}" if s.side_channel_port else ""
            parts.append(f"{s.name}={_where(s)}{gpu}{side}")
        parts.append(f"proxy={_where(self.proxy)}")
        backend = self.attention_backend or "auto"
        how = "attached" if self.attached else f"ready in {self.started_seconds:.1f}s"
        if self.reused is not None:
            how = f"reused {self.reused.describe()}, ready in {self.started_seconds:.2f}s"
        if self.pd_ready_seconds is not None:
            how += f" (P/D round trip {self.pd_ready_seconds:.2f}s)"
        seen = sorted({e.describe() for e in self.observed.values()})
        effective = f" effective: {' | '.join(seen)}" if seen else ""
        notes = "".join(f"; {note}" for note in self.notes)
        return (
            f"pdserve: cluster {self.spec.name} ({self.engine}, {len(self.prefill)}P x {len(self.decode)}D) {how}: "
            f"{' '.join(parts)} backend={backend} model={self.model}{effective}{notes}"
        )


def _where(server: ServerHandle) -> str:
    """``:PORT`` for our own loopback servers, ``host:port`` for attached remote ones."""
    host = httpx.URL(server.url).host
    return f":{server.port}" if host == "127.0.0.1" else f"{host}:{server.port}"


def served_model_name(argv: Sequence[str], model: str) -> str:
    """The model id clients must send: the first value of the last ``--served-model-name`` in argv, else ``model``.

    The extra args may rename the model (``VLLM_SERVE_EXTRA_ARGS=--served-model-name,x``); readiness and
    ``PDCluster.complete`` must then use the new name, or the start waits for a model that is never listed.
    """
    name = model
    for i, arg in enumerate(argv):
        if arg == "--served-model-name" and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            name = argv[i + 1]
        elif arg.startswith("--served-model-name="):
            name = arg.split("=", 1)[1]
    return name
