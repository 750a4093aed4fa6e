"""The one SSL context of a process's HTTP clients: verifying, with its CA bundle read at the first TLS handshake.

Why not ``httpx.create_ssl_context()`` at once: reading the CA bundle costs 14-28 ms of CPU, and every ``httpx``
client or transport built without a context reads it again. Nearly every request the plugin and its proxy send goes
to ``http://127.0.0.1``, where no context is ever used, and the reading fell where a start is short of CPU: the
plugin's readiness client and the proxy's two clients were built while both servers imported (docs/benchmarks.md).
A URL that is ``https`` still gets the same verification httpx gives (``SSL_CERT_FILE``, ``SSL_CERT_DIR``, else
certifi's bundle; hostname checked, certificate required), read at its first handshake. [pytest-free]
"""

from __future__ import annotations

import functools
import os
import ssl
import sys
import threading
from typing import Any

import certifi

__all__ = ["ssl_context"]


class _CABundleAtFirstUse(ssl.SSLContext):
    """``ssl.create_default_context(cafile=...)``, except that the CA bundle is read when a connection is first
    wrapped (``wrap_socket``: httpx's sync clients; ``wrap_bio``: anyio, which the async clients use)."""

    _loaded = False
    _lock = threading.Lock()

    def _load_ca_bundle(self) -> None:
        with self._lock:
            if self._loaded:
                return
            # httpx.create_ssl_context(): $SSL_CERT_FILE, else $SSL_CERT_DIR, else certifi's bundle.
            if os.environ.get("SSL_CERT_FILE"):
                self.load_verify_locations(cafile=os.environ["SSL_CERT_FILE"])
            elif os.environ.get("SSL_CERT_DIR"):
                self.load_verify_locations(capath=os.environ["SSL_CERT_DIR"])
            else:
                self.load_verify_locations(cafile=certifi.where())
            self._loaded = True

    def wrap_socket(self, *args: Any, **kwargs: Any) -> ssl.SSLSocket:
        self._load_ca_bundle()
        return super().wrap_socket(*args, **kwargs)

    def wrap_bio(self, *args: Any, **kwargs: Any) -> ssl.SSLObject:
        self._load_ca_bundle()
        return super().wrap_bio(*args, **kwargs)


@functools.lru_cache(maxsize=1)
def ssl_context() -> ssl.SSLContext:
    """The process's one verifying context (shared by every client: a kept cluster's attach builds a dozen)."""
    # What ssl.create_default_context() sets besides the CA bundle (tests/common/test_tls.py compares the two).
    ctx = _CABundleAtFirstUse(ssl.PROTOCOL_TLS_CLIENT)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = True
    if sys.version_info >= (3, 13):
        ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN | ssl.VERIFY_X509_STRICT
    keylog = os.environ.get("SSLKEYLOGFILE")
    if keylog and not sys.flags.ignore_environment:
        ctx.keylog_filename = keylog
    return ctx
