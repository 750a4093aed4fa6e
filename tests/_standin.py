"""A tiny stdlib HTTP stand-in for a vLLM server, used by the process/watchdog tests.

Run as ``python tests/_standin.py --port N [knobs]``. It serves ``GET /health`` and ``GET /v1/models``
and prints machine-readable lines to stdout (which ``ServerProcess`` sends to the log file):

* ``CHILD_PID <pid>``: the pid of the ``setsid`` child made by ``--spawn-child``;
* ``READY_AT <t>``: ``time.monotonic()`` right after the socket listens (CLOCK_MONOTONIC is
  system-wide on Linux, so the test can compare it with its own clock);
* ``EXITING_AT <t>``: the same, just before a ``--crash-after`` exit.

Knobs: ``--delay S`` before listening; ``--crash-after S`` then print ``--crash-message`` and exit with
``--exit-code``; ``--hang`` never listens; ``--health-status CODE``; ``--ignore-sigterm``;
``--spawn-child`` (a grandchild in a new session: it left our process group, only the env token finds
it); ``--spam-bytes N`` of log before listening.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STANDIN = __file__


def _handler(model: str, health_status: int) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            if self.path == "/health":
                self._reply(health_status, b"")
            elif self.path == "/v1/models":
                body = {"object": "list", "data": [{"id": model, "object": "model"}]}
                self._reply(200, json.dumps(body).encode())
            else:
                self._reply(404, b"")

        def _reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # keep the log readable; the readiness loop polls every 10 ms

    return Handler


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--model", default="standin-model")
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--crash-after", type=float, default=None)
    p.add_argument("--exit-code", type=int, default=3)
    p.add_argument("--crash-message", default="RuntimeError: stand-in crashed on purpose")
    p.add_argument("--hang", action="store_true")
    p.add_argument("--health-status", type=int, default=200)
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--spawn-child", action="store_true")
    p.add_argument("--spam-bytes", type=int, default=0)
    args = p.parse_args()

    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"stand-in starting pid={__import__('os').getpid()}", flush=True)
    if args.spawn_child:
        child = subprocess.Popen(
            [sys.executable, "-c", "import time\nwhile True: time.sleep(60)"],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
        print(f"CHILD_PID {child.pid}", flush=True)
    if args.spam_bytes:
        line = "INFO chatty stand-in log line " + "x" * 90 + "\n"
        for _ in range(args.spam_bytes // len(line) + 1):
            sys.stdout.write(line)
        sys.stdout.flush()
    if args.crash_after is not None:
        time.sleep(args.crash_after)  # timing: the --crash-after knob
        print(args.crash_message, flush=True)
        print(f"EXITING_AT {time.monotonic():.6f}", flush=True)
        return int(args.exit_code)
    if args.hang:
        print("stand-in hanging forever", flush=True)
        while True:
            time.sleep(60)
    time.sleep(args.delay)  # timing: the --delay knob
    server = ThreadingHTTPServer(("127.0.0.1", args.port), _handler(args.model, args.health_status))
    print(f"READY_AT {time.monotonic():.6f}", flush=True)
    server.serve_forever(poll_interval=0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
