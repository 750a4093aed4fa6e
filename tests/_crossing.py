"""A server whose keep-alive close crosses the next request: the race a CI run lost (issue 28).

uvicorn closes a connection idle for its keep-alive; a client that reuses the connection at that moment gets
"Server disconnected without sending a response". That moment is a race, so this server makes it certain: a
request that arrives on a connection idle for longer than ``close_after`` seconds is answered by closing the
connection, as a server that had just timed it out would. A client that drops idle connections sooner
(``common/client_options.py``: ``KEEPALIVE_EXPIRY_S``) opens a new one and is answered.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

ANSWER = {
    "id": "cmpl-crossing",
    "object": "text_completion",
    "model": "crossing",
    "choices": [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    "kv_transfer_params": {"remote_engine_id": "crossing"},
}


class CrossingServer:
    def __init__(self, close_after: float) -> None:
        self.close_after = close_after
        self.answered = 0
        self.crossed = 0  # requests met by a close
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            idle_since = time.monotonic()
            buffered = b""
            while not self._stop.is_set():
                while b"\r\n\r\n" not in buffered:
                    try:
                        chunk = conn.recv(65536)
                    except OSError:
                        return
                    if not chunk:
                        return
                    buffered += chunk
                head, _, rest = buffered.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(rest) < length:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    rest += chunk
                buffered = rest[length:]
                if time.monotonic() - idle_since > self.close_after:
                    self.crossed += 1
                    return  # the keep-alive timer won: closed without an answer
                body = json.dumps(ANSWER).encode()
                self.answered += 1  # before sending: the client may look as soon as it has the answer
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                idle_since = time.monotonic()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            thread.start()
            self._threads.append(thread)


@contextmanager
def crossing_server(close_after: float) -> Iterator[CrossingServer]:
    server = CrossingServer(close_after)
    acceptor = threading.Thread(target=server._accept, daemon=True)
    acceptor.start()
    try:
        yield server
    finally:
        server._stop.set()
        server._listener.close()
        acceptor.join(timeout=5)
