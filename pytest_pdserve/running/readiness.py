"""What "ready" means for one server over HTTP: ``GET /health`` is 200, then ``GET /v1/models`` lists the model.

:class:`pytest_pdserve.running.process.ServerProcess` asks this once per poll, after checking that the process is alive;
the answer says what it is still waiting for, which ends up in the startup-timeout message. [pytest-free]
"""

from __future__ import annotations

import errno
import socket
from urllib.parse import urlsplit

import httpx

from pytest_pdserve.common.deadline import get_within, http_transport
from pytest_pdserve.errors import AuthRefused

__all__ = ["REQUEST_TIMEOUT", "ReadinessCheck", "readiness_client"]

REQUEST_TIMEOUT = 0.5
"""Per readiness request; a wedged server costs at most this per round."""


class ReadinessCheck:
    """The HTTP readiness conditions of one server.

    :param health_url: must answer 200.
    :param models_url: if given, must answer 200 (and list ``model_id`` if given).
    :param api_key: sent as ``Authorization: Bearer`` (vLLM ``--api-key``).
    """

    def __init__(self, health_url: str, models_url: str | None, model_id: str | None, api_key: str | None) -> None:
        self.health_url = health_url
        self.models_url = models_url
        self.model_id = model_id
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        parts = urlsplit(health_url)
        self._address = (parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80))
        #: What the last check waited for, in words (``GET http://...: HTTP 503``).
        self.waiting_for = "the process to start"
        #: The model list of the check that found the server ready (the start's read-back uses it: verify.py).
        self.models_answer: object = None

    def check(self, client: httpx.Client) -> bool:
        """One round of requests; True when every condition holds.

        :raises AuthRefused: a request was refused with 401/403.
        """
        if _refused(self._address):
            # Most of a start is this answer, and it costs a connect() alone: an HTTP request through the client
            # (its pool, the deadline's thread) costs about 20 times the CPU, polled every few ms by every server.
            self.waiting_for = f"GET {self.health_url}: connection refused"
            return False
        if self._get_ok(client, self.health_url) is None:
            return False
        if self.models_url is None:
            return True
        r = self._get_ok(client, self.models_url)
        if r is None:
            return False
        try:
            body = r.json()
            ids = [m.get("id") for m in body.get("data", [])]
        except (ValueError, AttributeError, TypeError):
            if self.model_id is None:
                return True
            self.waiting_for = f"GET {self.models_url}: not an OpenAI model list: {r.text[:200]!r}"
            return False
        if self.model_id is not None and self.model_id not in ids:
            self.waiting_for = f"model {self.model_id!r} in GET {self.models_url} (it lists {ids})"
            return False
        self.models_answer = body
        return True

    def _get_ok(self, client: httpx.Client, url: str) -> httpx.Response | None:
        """``GET url``; the response if it is 200, else None (and what we wait for is remembered)."""
        try:
            r = get_within(client, url, REQUEST_TIMEOUT, headers=self._headers)
        except httpx.HTTPError as exc:
            self.waiting_for = f"GET {url}: {_short(exc)}"
            return None
        if r.status_code != 200:
            self.waiting_for = f"GET {url}: HTTP {r.status_code}"
            if r.status_code in (401, 403):
                raise AuthRefused(self.waiting_for)
            return None
        return r


def readiness_client() -> httpx.Client:
    """The client readiness requests go through."""
    # trust_env=False: an HTTP(S)_PROXY in the environment must not intercept 127.0.0.1 checks.
    return httpx.Client(trust_env=False, timeout=REQUEST_TIMEOUT, transport=http_transport())


def _refused(address: tuple[str, int]) -> bool:
    """Whether a TCP connection to ``address`` is refused right now: nothing listens there yet. Any other outcome
    (it connects, a timeout, another error) is left to the HTTP request, which says what happened."""
    try:
        with socket.create_connection(address, timeout=REQUEST_TIMEOUT):
            return False
    except OSError as exc:
        return exc.errno == errno.ECONNREFUSED


def _short(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) < 120 else text[:117] + "..."
