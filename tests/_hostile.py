"""A 127.0.0.1 HTTP server that answers like a vLLM server, except on the routes told to be hostile (issue 43, class
4's attacker): an endless body, a content-length of 10 GiB, a gzip bomb, a 1 MiB header line.

It counts, per route, the requests it got and the body bytes it managed to send: a client that reads a bounded
amount and hangs up stops the sending, so ``sent`` says how much the client read (plus the socket buffers).
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
import socket
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

MODEL = "hostile-model"
#: The most an endless answer sends before it ends on its own (a safety net: a bounded client hangs up far earlier).
ENDLESS_CAP = 512 << 20
_CHUNK = b"# pdserve hostile stand-in: this line repeats without end\n" * (1 << 14)  # ~0.9 MiB

#: What each behaviour answers; ``endless``, ``declared``, ``gzip`` and ``giant-header`` are the attacks.
BEHAVIOURS = ("health", "models", "endless", "declared", "gzip", "giant-header", "not-found")


@functools.cache
def _bomb() -> bytes:
    """128 MiB of zeros, gzipped to about 130 KB: twice the plugin's bound once decoded."""
    return gzip.compress(b"0" * (128 << 20), compresslevel=9)


@dataclass
class Hostile:
    url: str
    requests: Counter[str] = field(default_factory=Counter)
    sent: Counter[str] = field(default_factory=Counter)


def _head(status: str, headers: Mapping[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    return "\r\n".join(lines).encode()


def _read_request(conn: socket.socket) -> tuple[str, str] | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode(errors="replace").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = next((int(v) for k, _, v in (h.partition(": ") for h in lines[1:]) if k.lower() == "content-length"), 0)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return method, path


@contextlib.contextmanager
def hostile_server(routes: Mapping[str, str]) -> Iterator[Hostile]:
    """Serve ``routes`` (path -> behaviour); ``/health`` and ``/v1/models`` answer as vLLM's do unless given, any
    other path 404. Every connection is closed after its answer (no keep-alive)."""
    table = {"/health": "health", "/v1/models": "models", **routes}
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()
    hostile = Hostile(f"http://127.0.0.1:{listener.getsockname()[1]}")
    lock = threading.Lock()

    def count(path: str, sent: int) -> None:
        with lock:
            hostile.sent[path] += sent

    def answer(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(30)
            request = _read_request(conn)
            if request is None:
                return
            path = request[1].split("?")[0]
            behaviour = table.get(path, "not-found")
            with lock:
                hostile.requests[path] += 1
            close = {"connection": "close"}
            if behaviour == "health":
                conn.sendall(_head("200 OK", {"content-length": "0", **close}))
            elif behaviour == "models":
                body = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
                conn.sendall(_head("200 OK", {"content-type": "application/json", "content-length": str(len(body)),
                                              **close}) + body)  # fmt: skip
            elif behaviour == "endless":
                conn.sendall(_head("200 OK", {"content-type": "text/plain", **close}))
                sent = 0
                while sent < ENDLESS_CAP and not stop.is_set():
                    conn.sendall(_CHUNK)
                    sent += len(_CHUNK)
                    count(path, len(_CHUNK))
            elif behaviour == "declared":
                conn.sendall(_head("200 OK", {"content-type": "text/plain", "content-length": str(10 << 30), **close}))
                conn.sendall(_CHUNK[:65536])  # a little of the 10 GiB, then it hangs up
                count(path, 65536)
            elif behaviour == "gzip":
                bomb = _bomb()
                conn.sendall(_head("200 OK", {"content-type": "text/plain", "content-encoding": "gzip",
                                              "content-length": str(len(bomb)), **close}) + bomb)  # fmt: skip
                count(path, len(bomb))
            elif behaviour == "giant-header":
                conn.sendall(_head("200 OK", {"content-length": "0", "x-giant": "y" * (1 << 20), **close}))
            else:
                conn.sendall(_head("404 Not Found", {"content-length": "0", **close}))

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield hostile
    finally:
        stop.set()
        listener.close()
        thread.join(5)
