"""A 127.0.0.1 HTTP server that trickles its answer: one byte every 0.5 s (issue 25, class 4's attacker), for ten
minutes: a deadline that does not cut it leaves the test waiting far past any bound a loaded machine could reach."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

#: How long a trickling answer would take in full (one byte per 0.5 s, 600 s): far beyond every deadline tested here.
TRICKLE_BYTES = 1200
TRICKLE_EVERY_S = 0.5


@contextlib.contextmanager
def trickler(*, headers_too: bool = False) -> Iterator[str]:
    """A 127.0.0.1 HTTP server answering every request 200 with its body (or, ``headers_too``, its header lines
    as well) one byte per 0.5 s; yields its URL. Bounded: each answer ends after TRICKLE_BYTES bytes."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def answer(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            with contextlib.suppress(OSError):
                conn.recv(65536)
                head = f"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {TRICKLE_BYTES}\r\n"
                if not headers_too:
                    conn.sendall(head.encode() + b"\r\n")
                slow = (head + "x-slow: " + "y" * TRICKLE_BYTES).encode() if headers_too else b"z" * TRICKLE_BYTES
                for i in range(len(slow)):
                    if stop.wait(TRICKLE_EVERY_S):  # timing: the trickle's pace
                        return
                    conn.sendall(slow[i : i + 1])

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
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()
        thread.join(5)
