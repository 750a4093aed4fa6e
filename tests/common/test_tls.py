"""The one SSL context of the plugin's and the proxy's clients (``common/tls.py``).

It promises two things, each tried here against a real TLS server on 127.0.0.1 with a self-signed certificate:
it verifies as httpx's default context does (a certificate nobody vouches for is refused, by the sync clients and by
the async ones, and ``SSL_CERT_FILE`` is honoured as httpx honours it), and it reads no CA bundle until a TLS
handshake needs one (plain ``http://`` requests, nearly all the plugin sends, never pay for it). Each case runs
in a fresh interpreter: the context is built once per process.
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from pytest_pdserve.common.tls import ssl_context


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002  (http.server's signature)
        pass


def _serve(server: ThreadingHTTPServer) -> Iterator[str]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A self-signed certificate for IP 127.0.0.1 (its key beside it, ``key.pem``)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a self-signed certificate (Debian: apt install openssl)")
    where = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(where / "key.pem"), "-out", str(where / "cert.pem")],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return where / "cert.pem"


@pytest.fixture(scope="module")
def https_address(cert: Path) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, cert.with_name("key.pem"))
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    yield from _serve(server)


@pytest.fixture(scope="module")
def http_address() -> Iterator[str]:
    yield from _serve(ThreadingHTTPServer(("127.0.0.1", 0), _Ok))


#: Run in a fresh interpreter: GET each URL through a client of the kind named, print what happened and how many
#: CA certificates the shared context holds after each request.
_CLIENT = r"""
import asyncio, json, sys
import httpx
from pytest_pdserve.common.deadline import get_within, http_transport
from pytest_pdserve.common.tls import ssl_context

def get(url):
    if sys.argv[1] == "async":  # as the proxy builds its clients
        async def one():
            async with httpx.AsyncClient(trust_env=False, verify=ssl_context(), timeout=60) as client:
                return (await client.get(url)).status_code
        return asyncio.run(one())
    with httpx.Client(trust_env=False, transport=http_transport()) as client:  # as the plugin builds its clients
        if sys.argv[1] == "sync-as-other-name":  # the handshake checks the certificate against another name
            return client.get(url, extensions={"sni_hostname": "other.test"}).status_code
        return get_within(client, url, 10).status_code

out = []
for url in sys.argv[2:]:
    try:
        what = get(url)
    except httpx.ConnectError as exc:
        what = "refused: " + str(exc)
    out.append([what, ssl_context().cert_store_stats()["x509_ca"]])
print(json.dumps(out))
"""


def _run(kind: str, *urls: str, env: dict[str, str] | None = None) -> list[list[object]]:
    base = {k: v for k, v in __import__("os").environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}
    proc = subprocess.run(
        [sys.executable, "-c", _CLIENT, kind, *urls], env={**base, **(env or {})}, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result: list[list[object]] = json.loads(proc.stdout)
    return result


def test_the_context_sets_what_httpx_default_context_sets() -> None:
    ours, httpx_default = ssl_context(), httpx.create_ssl_context()
    for attr in ("protocol", "verify_mode", "check_hostname", "options", "verify_flags", "minimum_version",
                 "maximum_version"):  # fmt: skip
        assert getattr(ours, attr) == getattr(httpx_default, attr), attr


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_plain_http_reads_no_ca_bundle_and_https_verifies(kind: str, http_address: str, https_address: str) -> None:
    (plain, certs_after_plain), (tls, certs_after_tls) = _run(
        kind, f"http://{http_address}/", f"https://{https_address}/"
    )
    assert plain == 200
    assert certs_after_plain == 0, "a plain http:// request read the CA bundle"
    # Nobody vouches for the self-signed certificate: refused, after the bundle was read for the handshake.
    assert "CERTIFICATE_VERIFY_FAILED" in str(tls), tls
    assert int(str(certs_after_tls)) > 0


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_ssl_cert_file_is_honoured(kind: str, cert: Path, https_address: str) -> None:
    # As httpx.create_ssl_context() does: $SSL_CERT_FILE instead of certifi's bundle, so the certificate verifies
    # (hostname 127.0.0.1 included: the certificate names that IP).
    [(status, certs)] = _run(kind, f"https://{https_address}/", env={"SSL_CERT_FILE": str(cert)})
    assert status == 200
    assert certs == 1


def test_a_certificate_for_another_name_is_refused(cert: Path, https_address: str) -> None:
    # The hostname check is on: the certificate is trusted, but it names 127.0.0.1, not other.test.
    [(what, _)] = _run("sync-as-other-name", f"https://{https_address}/", env={"SSL_CERT_FILE": str(cert)})
    assert "CERTIFICATE_VERIFY_FAILED" in str(what), what
