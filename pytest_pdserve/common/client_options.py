"""The process-wide options of the plugin's clients: request timeout, its remedy, the current test's salt, and how
long an idle connection is kept.

Apart from ``clients.py`` (which re-exports every name) so that the plugin can set the salt around each test
without importing httpx: a session whose tests start no cluster never loads it (60-180 ms of CPU per session,
paid by every inner pytest session of a suite that runs many). [pytest-free, stdlib]
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["KEEPALIVE_EXPIRY_S", "OPTIONS", "ClientOptions", "salt_for", "salted"]

#: How long every client of the plugin (tests', checks', the proxy's upstream) keeps an idle connection for reuse.
#: Why: uvicorn, under vLLM and the simulator alike, closes a connection idle for its keep-alive (vLLM's
#: ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s). httpx's own expiry is also 5 s, so a request sent on a connection idle for
#: just under 5 s met the server's close and failed with "Server disconnected without sending a response" (a CI
#: run on a loaded machine, between two contract tests). An expiry well below the server's leaves no such window.
#: The servers' keep-alive is bounded from below by it (config/bounds.py).
KEEPALIVE_EXPIRY_S = 1.0


@dataclass
class ClientOptions:
    """Process-wide options of the clients (one pytest process = one session)."""

    request_timeout: float = 600.0
    #: Appended to timeout errors: how to raise the limit (the plugin names its setting's flag, env var, ini key).
    timeout_remedy: str = ""
    #: The current test's ``cache_salt``; ``None`` adds none.
    salt: str | None = None


OPTIONS = ClientOptions()


def salt_for(test_id: str, session_token: str) -> str:
    """A salt unique to one test of one session, valid for vLLM (1-128 chars, none of ``@ / \\ NUL``)."""
    digest = hashlib.blake2b(f"{session_token}|{test_id}".encode(), digest_size=16).hexdigest()
    return f"pdserve-{digest}"


@contextlib.contextmanager
def salted(salt: str | None) -> Iterator[str | None]:
    """Send requests with *salt* inside the block (``None``: none added), then restore the previous one."""
    previous, OPTIONS.salt = OPTIONS.salt, salt
    try:
        yield salt
    finally:
        OPTIONS.salt = previous
