"""A P/D proxy that never calls prefill: every request goes to decode alone (a broken P/D setup that still
answers). Usage: python bypass_prefill.py --port PORT --decode-host HOST --decode-port PORT.

tests/test_require_kv_transfer.py runs modules through it: their answers stay right, and only decode's
external_kv_transfer tokens and NIXL bytes (0) show that P/D was bypassed. Standard library only.
"""

from __future__ import annotations

import argparse
import http.client
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ARGS = argparse.Namespace()


class Handler(BaseHTTPRequestHandler):
    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        conn = http.client.HTTPConnection(ARGS.decode_host, ARGS.decode_port, timeout=300)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
        conn.request(self.command, self.path, body=body or None, headers=headers)
        upstream = conn.getresponse()
        data = upstream.read()
        self.send_response(upstream.status)
        for key, value in upstream.getheaders():
            if key.lower() not in ("transfer-encoding", "content-length", "connection"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        conn.close()

    def do_GET(self) -> None:  # noqa: N802 (http.server's names)
        if self.path == "/healthcheck":
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")
            return
        self._forward()

    def do_POST(self) -> None:  # noqa: N802
        self._forward()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--decode-host", default="127.0.0.1")
    parser.add_argument("--decode-port", type=int, required=True)
    parser.parse_args(namespace=ARGS)
    ThreadingHTTPServer(("127.0.0.1", ARGS.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
